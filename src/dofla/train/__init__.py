from dofla.precision import configure_matmul, teacher_dtype
from dofla.train import capacity
from dofla.train.direct import train_direct
from dofla.train.layerwise import LayerTrainConfig, LayerTrainResult, layer_loss, run_layerwise, train_layer
from dofla.train.losses import LOSSES
from dofla.train.step import NonFiniteLossError
from dofla.train.teacher_acts import teacher_qk

__all__ = [
    "train_direct", "LayerTrainConfig", "LayerTrainResult", "NonFiniteLossError",
    "layer_loss", "run_layerwise", "train_layer", "LOSSES", "teacher_qk", "capacity",
    "configure_matmul", "teacher_dtype",  # the arithmetic a `precision` trains in (dofla.precision)
]
