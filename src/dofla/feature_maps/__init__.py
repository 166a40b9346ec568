"""Feature maps φ (log space). Importing this package registers every map in ``FEATURE_MAPS``."""
from dofla.feature_maps.base import FEATURE_MAPS, FeatureMap, build_feature_map
from dofla.feature_maps.blocks import HeadBlockFeatureMap, build_layer_feature_map, mean_dim
from dofla.feature_maps.dijiang import DiJiangFeatureMap
from dofla.feature_maps.elu1 import Elu1FeatureMap
from dofla.feature_maps.hedgehog import HedgehogFeatureMap, HedgehogJointFeatureMap
from dofla.feature_maps.learned_prf import LearnedPRFFeatureMap
from dofla.feature_maps.performer import PerformerFeatureMap

__all__ = [
    "FEATURE_MAPS",
    "FeatureMap",
    "build_feature_map",
    "build_layer_feature_map",
    "HeadBlockFeatureMap",
    "mean_dim",
    "DiJiangFeatureMap",
    "Elu1FeatureMap",
    "HedgehogFeatureMap",
    "HedgehogJointFeatureMap",
    "LearnedPRFFeatureMap",
    "PerformerFeatureMap",
]
