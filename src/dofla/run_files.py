"""Names of the files in a run directory that one layer writes and another reads.

Here, below both, so that a reader (the model card, in ``dofla.models``) need not import the
writer's package (``dofla.eval``).
"""
from __future__ import annotations

MEASUREMENTS = "eval_measurements.json"  # the eval stage's measurements (dofla.eval.store)
