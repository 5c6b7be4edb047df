"""SAO (Streaming Advantage Optimization): the small, complete example method.

Read it in this order (``README.md`` walks through it):

- ``processor.py``: recorded generations + feedback -> one-sample ``RolloutUnit``\\ s;
- ``objective.py``: units + running per-prompt reward statistics -> advantages, metrics
  and the updated statistics (proposed);
- ``loss.py``: the ``sao_truncated_pg`` loss family: a truncated importance-weighted
  policy gradient;
- ``recipe.py``: the three bound to a schedule and the demo task's model, reward and
  evaluator, as ``recipe`` (what ``load_recipe("methods.sao")`` takes).
"""

from .recipe import recipe

__all__ = ["recipe"]
