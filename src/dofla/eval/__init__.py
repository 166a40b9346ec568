from dofla.eval.metrics import (
    attention_errors,
    heldout_loss,
    layer_attention_error,
    perplexity,
    relative_error,
)
from dofla.eval.downstream import TRAIN_EXAMPLES
from dofla.eval.longctx import passkey_probe, passkey_trials
from dofla.eval.probes import without_linear_part

__all__ = ["TRAIN_EXAMPLES", "attention_errors", "heldout_loss", "layer_attention_error", "passkey_probe", "passkey_trials", "perplexity",
           "relative_error", "without_linear_part"]
