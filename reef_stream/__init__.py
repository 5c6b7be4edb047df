"""reef-stream: event-sourced reinforcement learning on a durable Kafka log.

The public names, importable from here (``from reef_stream import Recipe, Schedule``):

- the author API (``reef_stream.api``, pure: no Kafka, no Redis): ``Recipe``, ``Backend``,
  ``Schedule``, the ``Processor`` protocols and the built-in parts, ``Objective`` and its
  result types, loss families, ``CandidateEvaluator``, ``Reward``, ``load_recipe``;
- what a serving fleet uses: ``RecordProducer``, ``AsyncRecordProducer`` (intake) and
  ``Follower`` (loads each newly published version);
- the event types of every topic (``Generation``, ``Feedback``, ``RolloutUnit``, ...);
- ``ReefError``, the root of every exception reef-stream raises.

Each name is imported on first use (PEP 562), so ``import reef_stream.api.recipe`` runs
this file without importing confluent_kafka, redis or torch; ``RecordProducer`` brings
confluent_kafka in only when it is asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Module of each public name.
_MODULES: dict[str, tuple[str, ...]] = {
    "reef_stream.api.recipe": ("Recipe", "Backend", "load_recipe"),
    "reef_stream.api.rewards": ("Reward", "RewardFunction", "NamedReward", "Transient"),
    "reef_stream.api.schedule": ("Schedule",),
    "reef_stream.api.processor": ("Processor", "Grouping", "FeedbackPolicy", "UnitBuilder",
                                  "Score", "Scored", "MissingFeedback"),
    "reef_stream.api.parts": ("ComposedProcessor", "ByGroupId", "Ungrouped", "RequireSources",
                              "RolloutUnits"),
    "reef_stream.api.objective": ("Objective", "ObjectiveResult", "Advantages",
                                  "PerSampleAdvantages", "PerTokenAdvantages"),
    "reef_stream.api.losses": ("LossFamily", "LossFunction", "LossOutput", "register_loss_family",
                               "POLICY_GRADIENT", "PolicyGradientInputs", "PolicyGradientLoss",
                               "ClippedPolicyGradient", "ClippedWeightPolicyGradient",
                               "VALUE_REGRESSION",
                               "ValueRegressionInputs", "ValueRegressionLoss",
                               "MaskedSquaredError"),
    "reef_stream.api.variants": ("AdvantageNormalisation", "TokenMean", "SequenceMeanTokenMean",
                                 "SequenceMeanTokenSum", "ConstantNormaliser", "RatioLevel",
                                 "KLEstimator", "KLPenalty", "EntropyBonus", "DecoupledProximal",
                                 "BehaviourWeightLevel", "BehaviourWeightMode", "LOG_RATIO_BOUND"),
    "reef_stream.api.evaluator": ("CandidateEvaluator", "Measurement", "Incumbent", "Selection",
                                  "AcceptEverything"),
    "reef_stream.intake.producer": ("RecordProducer", "SendHandle", "DeliveryState"),
    "reef_stream.intake.aio": ("AsyncRecordProducer",),
    "reef_stream.serving.follower": ("Follower", "LoadedVersion"),
    "reef_stream.core.events": ("Event", "Generation", "Feedback", "Sample", "SamplingParams",
                                  "FinishReason", "RolloutUnit", "TopicOffset", "Checkpoint",
                                  "Publication", "Decision", "Metric", "DeadLetter"),
    "reef_stream.core.errors": ("ReefError",),
}
_WHERE = {name: module for module, names in _MODULES.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use, and keep the name here."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'reef_stream' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
