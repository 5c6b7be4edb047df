"""GRPO: grouped sampling, group-normalised advantages, the built-in clipped policy gradient.

``processor.py`` (groups by ``group_id``, complete at the declared size),
``objective.py`` (``(r - mean) / (std + eps)`` within each group) and ``recipe.py``
(bound to the demo task, as ``recipe``: what ``load_recipe("methods.grpo")`` takes);
``README.md`` says more.
"""

from .recipe import recipe

__all__ = ["recipe"]
