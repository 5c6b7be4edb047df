"""GRPO: grouped sampling, group-normalised advantages, the built-in clipped policy gradient.

``processor.py`` (groups by ``group_id``, complete at the declared size),
``objective.py`` (``(r - mean) / (std + eps)`` within each group) and ``recipe.py``
(``recipe(model=..., reward=..., evaluator=..., group_size=16)``, the factory binding them to a
task; ``reef_stream.demo.recipes:grpo`` binds it to the demo task); ``README.md`` says more.
"""

from .recipe import recipe

__all__ = ["recipe"]
