from dofla.eval.metrics import attention_errors, heldout_loss, relative_error

__all__ = ["attention_errors", "heldout_loss", "relative_error"]
