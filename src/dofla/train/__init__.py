from dofla.train.direct import train_direct
from dofla.train.layerwise import LayerTrainConfig, LayerTrainResult, run_layerwise, train_layer
from dofla.train.losses import LOSSES
from dofla.train.step import NonFiniteLossError

__all__ = [
    "train_direct", "LayerTrainConfig", "LayerTrainResult", "NonFiniteLossError",
    "run_layerwise", "train_layer", "LOSSES",
]
