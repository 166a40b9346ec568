from dofla.eval.metrics import (
    attention_errors,
    heldout_loss,
    layer_attention_error,
    perplexity,
    relative_error,
)

__all__ = ["attention_errors", "heldout_loss", "layer_attention_error", "perplexity", "relative_error"]
