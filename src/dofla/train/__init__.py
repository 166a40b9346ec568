from dofla.precision import configure_matmul, teacher_dtype
from dofla.train import capacity, probe_steps
from dofla.train.direct import train_direct
from dofla.train.distill import prepare_trainable
from dofla.train.kl_targets import exact_kl, topk_targets
from dofla.train.layerwise import LayerTrainConfig, LayerTrainResult, layer_loss, run_layerwise, train_layer
from dofla.train.losses import LOSSES
from dofla.train.step import NonFiniteLossError
from dofla.train.teacher_acts import teacher_qk

__all__ = [
    "train_direct", "LayerTrainConfig", "LayerTrainResult", "NonFiniteLossError",
    "layer_loss", "run_layerwise", "train_layer", "LOSSES", "teacher_qk", "capacity",
    "prepare_trainable", "exact_kl", "topk_targets",  # the KL stage's pieces (dofla.train.distill, kl_targets)
    "probe_steps",  # one step of each trainer on cut models, as the preflight and the cost model time it
    "configure_matmul", "teacher_dtype",  # the arithmetic a `precision` trains in (dofla.precision)
]
