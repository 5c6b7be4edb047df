"""SAO (Streaming Advantage Optimization): the small, complete example method.

Read it in this order (``README.md`` walks through it):

- ``processor.py``: recorded generations + feedback -> one-sample ``RolloutUnit``\\ s;
- ``objective.py``: units + running per-prompt reward statistics -> advantages, metrics
  and the updated statistics (proposed);
- ``loss.py``: the ``sao_truncated_pg`` loss family: a truncated importance-weighted
  policy gradient;
- ``recipe.py``: ``recipe(model=..., reward=..., evaluator=...)``, the factory binding the
  three to a schedule and a task's model, reward and evaluator. The method knows no task:
  ``reef_stream.demo.recipes:sao`` is SAO bound to the demo task.
"""

from .recipe import recipe

__all__ = ["recipe"]
