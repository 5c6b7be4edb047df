"""Random events of every type, for the tests that compare the compiled Avro writers and readers
with fastavro (tests/unit/test_avro_writer.py, tests/unit/test_avro_reader.py).

Every optional field is None about a third of the time; strings include non-ASCII text and
lengths past one varint byte; numbers reach the edges of their Avro types; arrays, maps and
tuples are sometimes empty.
"""

from __future__ import annotations

import numpy as np

from reef_stream.core.events import (
    Checkpoint, DeadLetter, Decision, DecisionKind, DecisionOutcome, DecisionRequest, Feedback,
    FinishReason, Generation, MessageHeader, Metric, Publication, RolloutUnit, Sample,
    SamplingParams, TopicOffset,
)

_TEXT = ["", "a", "gen-0000001", "välue ✓", "模型-7b", "x" * 200, "judge:gpt"]
_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)
_SPECIAL_REALS = [0.0, -0.0, 1e308, -1e-308, float("inf"), float("-inf"), float("nan"), 5e-324]
#: timestamp-millis values fastavro can read back as a datetime (years 1 to 9999)
_MILLIS = (-62_135_596_800_000, 253_402_300_799_999)


class RandomEvents:
    """``RandomEvents(seed).of(cls)``: a random ``cls`` event.

    ``edges=False``: numbers of ordinary size only (no 10-byte varints, timestamps a
    ``datetime`` holds), the records every compiled path must take.
    """

    def __init__(self, seed: int, *, edges: bool = True) -> None:
        self.rng = np.random.default_rng(seed)
        self.edges = edges

    def text(self) -> str:
        if self.rng.random() < 0.2:
            codes = self.rng.integers(32, 0x2FFF, int(self.rng.integers(0, 300)))
            return "".join(map(chr, codes.tolist()))
        return _TEXT[int(self.rng.integers(len(_TEXT)))]

    def integer(self, bounds: tuple[int, int]) -> int:
        low, high = bounds if self.edges else (max(bounds[0], -(2**62)), min(bounds[1], 2**62 - 1))
        pick = self.rng.random()
        if pick < 0.15:
            return low if self.rng.random() < 0.5 else high
        if pick < 0.6:
            return int(self.rng.integers(-70, 70))
        return int(self.rng.integers(low, high, endpoint=True))

    def millis(self) -> int:
        if self.rng.random() < 0.3:
            return self.integer(_MILLIS)
        return int(self.rng.integers(0, 2**41))

    def real(self) -> float:
        pick = self.rng.random()
        if pick < 0.1:
            return float(self.rng.choice(_SPECIAL_REALS))
        return float(self.rng.normal(0, 10))

    def maybe(self, make):
        return None if self.rng.random() < 0.35 else make()

    def blob(self) -> bytes:
        return self.rng.bytes(int(self.rng.choice([0, 1, 8, 63, 64, 200, 9000])))

    def text_map(self) -> dict[str, str]:
        return {self.text(): self.text() for _ in range(int(self.rng.integers(0, 4)))}

    def real_map(self) -> dict[str, float]:
        return {self.text(): self.real() for _ in range(int(self.rng.integers(0, 4)))}

    def ids(self) -> np.ndarray:
        size = int(self.rng.choice([0, 1, 17, 500]))
        return self.rng.integers(-(2**31), 2**31 - 1, size, dtype=np.int32)

    def logprobs(self, size: int) -> np.ndarray:
        return (-self.rng.exponential(1.0, size)).astype(np.float32)

    def reason(self) -> FinishReason:
        return list(FinishReason)[int(self.rng.integers(len(FinishReason)))]

    def generation(self) -> Generation:
        completion = self.ids()
        return Generation(
            generation_id=self.text(), request_id=self.text(), prompt_id=self.text(),
            group_id=self.maybe(self.text), group_size=self.integer(_INT32), model=self.text(),
            policy_version=self.integer(_INT64), replica_id=self.text(),
            prompt_token_ids=self.ids(), completion_token_ids=completion,
            completion_logprobs=self.logprobs(len(completion)), finish_reason=self.reason(),
            sampling=SamplingParams(temperature=self.real(), top_p=self.real(),
                                    top_k=self.integer(_INT32), max_tokens=self.integer(_INT32),
                                    seed=self.maybe(lambda: self.integer(_INT64))),
            created_at=self.millis(), metadata=self.text_map())

    def feedback(self) -> Feedback:
        return Feedback(feedback_id=self.text(), generation_id=self.text(),
                        group_id=self.maybe(self.text), source=self.text(), reward=self.real(),
                        components=self.real_map(), created_at=self.millis())

    def sample(self) -> Sample:
        completion = self.ids()
        return Sample(generation_id=self.text(), prompt_id=self.text(),
                      policy_version=self.integer(_INT64), prompt_token_ids=self.ids(),
                      completion_token_ids=completion,
                      completion_logprobs=self.logprobs(len(completion)), reward=self.real(),
                      reward_components=self.real_map(), finish_reason=self.reason(),
                      temperature=self.real(), created_at=self.millis(),
                      policy_version_known=bool(self.rng.integers(0, 2)))

    def unit(self) -> RolloutUnit:
        members = tuple(self.sample() for _ in range(int(self.rng.choice([0, 1, 4, 9]))))
        return RolloutUnit(unit_id=self.text(), recipe=self.text(), group_key=self.text(),
                           members=members, created_at=self.millis())

    def checkpoint(self) -> Checkpoint:
        offsets = tuple(TopicOffset(topic=self.text(), partition=self.integer(_INT32),
                                    offset=self.integer(_INT64))
                        for _ in range(int(self.rng.integers(0, 5))))
        return Checkpoint(checkpoint_id=self.text(), recipe=self.text(), trainer_group=self.text(),
                          step=self.integer(_INT64), model=self.text(),
                          policy_version=self.integer(_INT64), uri=self.text(), sha256=self.text(),
                          offsets=offsets, trained_unit_count=self.integer(_INT64),
                          metrics=self.real_map(), created_at=self.millis(),
                          rolled_back_to=self.maybe(lambda: self.integer(_INT64)))

    def publication(self) -> Publication:
        return Publication(model=self.text(), policy_version=self.integer(_INT64),
                           checkpoint_id=self.text(), uri=self.text(), sha256=self.text(),
                           decision=list(Decision)[int(self.rng.integers(len(Decision)))],
                           reason=self.text(), evaluator=self.text(),
                           evaluated=bool(self.rng.random() < 0.5), measurement=self.real_map(),
                           incumbent_version=self.maybe(lambda: self.integer(_INT64)),
                           created_at=self.millis(), checkpoint_created_at=self.maybe(self.millis))

    def metric(self) -> Metric:
        return Metric(stage=self.text(), name=self.text(), value=self.real(),
                      labels=self.text_map(), created_at=self.millis())

    def dead_letter(self) -> DeadLetter:
        headers = tuple(MessageHeader(key=self.text(), value=self.maybe(self.blob))
                        for _ in range(int(self.rng.integers(0, 4))))
        return DeadLetter(reason=self.text(), error_type=self.text(), source_topic=self.text(),
                          source_partition=self.maybe(lambda: self.integer(_INT32)),
                          source_offset=self.maybe(lambda: self.integer(_INT64)),
                          key=self.maybe(self.blob), value=self.maybe(self.blob), headers=headers,
                          stage=self.text(), created_at=self.millis())

    def decision_request(self) -> DecisionRequest:
        return DecisionRequest(
            request_id=self.text(), kind=list(DecisionKind)[int(self.rng.integers(3))],
            model=self.text(), version=self.integer(_INT64),
            rolled_back_to=self.maybe(lambda: self.integer(_INT64)), decided_by=self.text(),
            reason=self.maybe(self.text), created_at=self.millis())

    def decision_outcome(self) -> DecisionOutcome:
        return DecisionOutcome(request_id=self.text(), model=self.text(),
                               applied=bool(self.rng.random() < 0.5), text=self.text(),
                               policy_version=self.maybe(lambda: self.integer(_INT64)),
                               evaluator_group=self.text(), created_at=self.millis())

    def of(self, cls: type):
        return {Generation: self.generation, Feedback: self.feedback, RolloutUnit: self.unit,
                Checkpoint: self.checkpoint, Publication: self.publication, Metric: self.metric,
                DeadLetter: self.dead_letter, DecisionRequest: self.decision_request,
                DecisionOutcome: self.decision_outcome}[cls]()
