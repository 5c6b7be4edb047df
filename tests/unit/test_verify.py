"""The code that grades fault and chaos runs, graded on logs built by hand (no broker).

``reef_stream.demo.verify`` decides whether every generation ended in exactly one outcome and
whether every acknowledged generation is in its topic; its ``ledger_counts`` whether a unit
was lost or trained twice; ``FaultRun.checks`` turns those counts into the verdict. Each
failure a run can have must be caught, and a clean log must pass."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from reef_stream.core.events import DeadLetter, MessageHeader, RolloutUnit
from reef_stream.core.metric_names import STAGE_PROCESSOR, STAGE_REWARD, STAGE_TRAINER
from reef_stream.core.serde import SchemaRegistry
from reef_stream.demo.faults import FaultRun
from reef_stream.demo.run import DemoResult
from reef_stream.demo.verify import (
    OutcomeTally, checkpoint_chain, ledger_counts, letter_unit, processor_letter_generation, take_records,
)
from reef_stream.topics import declarations
from tests.faults.records import generation as sized_generation
from tests.unit_log import rollout_unit

NS, RECIPE = "tverify", "sao"
GENERATIONS = declarations.generations(NS)
UNITS = declarations.units(NS, RECIPE)
LETTERS = declarations.dead_letters(NS)
registry = SchemaRegistry.default()


# ----------------------------------------------------------------- records, built by hand


def generation(generation_id: str):
    return dataclasses.replace(sized_generation(0), generation_id=generation_id)


def unit(*generation_ids: str, unit_id: str | None = None) -> RolloutUnit:
    template = rollout_unit(0, recipe=RECIPE, group_size=len(generation_ids))
    members = tuple(dataclasses.replace(m, generation_id=g)
                    for m, g in zip(template.members, generation_ids))
    return dataclasses.replace(template, members=members,
                               unit_id=unit_id or "u-" + "-".join(generation_ids))


def letter(record, *, stage: str, source_topic: str) -> DeadLetter:
    """A dead letter keeping ``record`` whole, as every stage writes them."""
    value, headers = registry.encode(record)
    return DeadLetter(reason="test", error_type="Test", source_topic=source_topic,
                      source_partition=0, source_offset=0, key=None, value=value,
                      headers=tuple(MessageHeader(key=k, value=v) for k, v in headers),
                      stage=stage, created_at=1_795_000_000_000)


def expired(generation_id: str) -> DeadLetter:
    """The processor's dead letter of a generation: its one outcome (expired, too stale...)."""
    return letter(generation(generation_id), stage=STAGE_PROCESSOR, source_topic=GENERATIONS)


class Message:
    """What ``TopicReader.to_end`` yields, as far as the readers use it."""

    def __init__(self, value: bytes, headers) -> None:
        self._value, self._headers = value, list(headers)

    def value(self) -> bytes:
        return self._value

    def headers(self):
        return self._headers


class Log:
    """Hand-built topics. ``since(topic)`` gives what was appended since the previous call,
    as a reader of the topic to its end would."""

    def __init__(self) -> None:
        self.topics: dict[str, list[Message]] = {GENERATIONS: [], UNITS: [], LETTERS: []}
        self.read = dict.fromkeys(self.topics, 0)

    def append(self, topic: str, *records) -> Log:
        for record in records:
            if isinstance(record, bytes):   # a record that does not decode
                self.topics[topic].append(Message(record, [("reef.schema", b"nope")]))
            else:
                self.topics[topic].append(Message(*registry.encode(record)))
        return self

    def since(self, topic: str) -> list[Message]:
        messages = self.topics[topic][self.read[topic]:]
        self.read[topic] += len(messages)
        return messages


class Outcomes:
    """What ``GenerationOutcomes`` does with the records its readers bring: ``take_records``
    into an ``OutcomeTally``, here over a hand-built log."""

    def __init__(self, log: Log) -> None:
        self.log, self.tally = log, OutcomeTally()

    def update(self) -> dict[str, int]:
        take_records(self.tally, registry, RolloutUnit, GENERATIONS,
                     generations=self.log.since(GENERATIONS), units=self.log.since(UNITS),
                     letters=self.log.since(LETTERS))
        return self.tally.counts()


@pytest.fixture
def log() -> Log:
    """A clean log: five generations, two units, one generation the processor dead-lettered,
    plus letters and records that are no generation's outcome and must not count as one."""
    log = Log()
    log.append(GENERATIONS, *(generation(f"g{i}") for i in range(1, 6)), b"not avro")
    log.append(UNITS, unit("g1", "g2"), unit("g3", "g4"))
    log.append(LETTERS,
               expired("g5"),
               # Not outcomes of a generation: a unit the trainer dropped, a reward worker's
               # dead letter of g1 (the processor still joins g1), a letter with no record.
               letter(unit("g1", "g2"), stage=STAGE_TRAINER, source_topic=UNITS),
               letter(generation("g1"), stage=STAGE_REWARD, source_topic=GENERATIONS),
               dataclasses.replace(expired("g3"), value=None))
    return log


def holds(counts: dict[str, int]) -> bool:
    """What ``FaultRun.checks`` asks of the generations' side."""
    return counts["no_outcome"] == 0 and counts["more_than_one"] == 0


# ----------------------------------------------------------------- the generations' side


def test_a_clean_log_gives_every_generation_exactly_one_outcome(log):
    outcomes = Outcomes(log)
    counts = outcomes.update()
    assert counts == {"generations": 5, "in_units": 4, "dead_lettered": 1, "no_outcome": 0,
                      "more_than_one": 0, "undecodable": 1}
    assert holds(counts)
    assert outcomes.tally.missing([f"g{i}" for i in range(1, 6)]) == set()


def test_a_generation_with_no_outcome_is_caught(log):
    log.append(GENERATIONS, generation("g6"))     # neither in a unit nor dead-lettered: lost
    counts = Outcomes(log).update()
    assert counts["no_outcome"] == 1 and not holds(counts)


def test_a_generation_in_two_units_is_caught(log):
    log.append(UNITS, unit("g1", "g5", unit_id="u-again"))
    counts = Outcomes(log).update()
    # g1 in two units, g5 in a unit and a dead letter
    assert counts["more_than_one"] == 2 and not holds(counts)


def test_a_generation_both_in_a_unit_and_dead_lettered_is_caught(log):
    log.append(LETTERS, expired("g2"))
    counts = Outcomes(log).update()
    assert counts["more_than_one"] == 1 and not holds(counts)


def test_a_generation_dead_lettered_twice_is_caught(log):
    log.append(LETTERS, expired("g5"))
    assert Outcomes(log).update()["more_than_one"] == 1


def test_an_acknowledged_generation_missing_from_its_topic_is_caught(log):
    outcomes = Outcomes(log)
    outcomes.update()
    acknowledged = ["g1", "g2", "g3", "g4", "g5", "g7"]
    assert outcomes.tally.missing(acknowledged) == {"g7"}


def test_records_folded_in_turns_are_each_counted_once(log):
    outcomes = Outcomes(log)
    assert holds(outcomes.update())
    assert outcomes.update()["more_than_one"] == 0     # nothing new: nothing counted again
    log.append(GENERATIONS, generation("g6"))
    assert outcomes.update()["no_outcome"] == 1        # the processor has not caught up yet
    log.append(LETTERS, expired("g6"))
    counts = outcomes.update()
    assert counts["generations"] == 6 and holds(counts)
    assert outcomes.tally.ids == {f"g{i}" for i in range(1, 7)}


def test_outcomes_may_arrive_before_their_generations():
    tally = OutcomeTally()
    tally.add_unit(["a", "b"])
    tally.add_dead_letter("c")
    assert tally.counts()["generations"] == 0
    for generation_id in ("a", "b", "c"):
        tally.add_generation(generation_id)
    assert tally.counts() == {"generations": 3, "in_units": 2, "dead_lettered": 1,
                              "no_outcome": 0, "more_than_one": 0, "undecodable": 0}


def test_only_the_processors_letters_of_generations_are_outcomes():
    assert processor_letter_generation(expired("g1"), GENERATIONS, registry) == "g1"
    assert processor_letter_generation(
        letter(generation("g1"), stage=STAGE_REWARD, source_topic=GENERATIONS),
        GENERATIONS, registry) is None
    assert processor_letter_generation(expired("g1"), declarations.generations("other"),
                                       registry) is None
    assert processor_letter_generation(dataclasses.replace(expired("g1"), value=b"junk"),
                                       GENERATIONS, registry) is None


# ----------------------------------------------------------------- the trainer's side


CLEAN_STEPS = [["u1", "u2"], ["u3"]]
CLEAN_LOG = ["u1", "u2", "u3", "u4"]


def ledger_holds(ledger: dict[str, int]) -> bool:
    """What ``FaultRun.checks`` and ``reef demo`` ask of the ledger."""
    return ledger["trained_twice"] == 0 and ledger["lost"] == 0 and ledger["trained"] > 0


def test_a_clean_ledger_passes():
    ledger = ledger_counts(CLEAN_STEPS, CLEAN_LOG, {"u4"})    # u4 dropped: too stale
    assert ledger == {"trained": 3, "trained_twice": 0, "duplicates": 0, "dropped": 1, "lost": 0}
    assert ledger_holds(ledger)


def test_a_lost_unit_is_caught():
    ledger = ledger_counts(CLEAN_STEPS, [*CLEAN_LOG, "u5"], {"u4"})
    assert ledger["lost"] == 1 and not ledger_holds(ledger)
    # Dropped by the trainer is an outcome; not dropped, not trained is lost.
    assert ledger_counts(CLEAN_STEPS, CLEAN_LOG, set())["lost"] == 1


def test_a_unit_trained_in_two_steps_is_caught():
    ledger = ledger_counts([["u1", "u2"], ["u2", "u3"]], CLEAN_LOG, {"u4"})
    assert ledger["trained_twice"] == 1 and not ledger_holds(ledger)


def test_a_unit_trained_twice_in_one_step_is_caught():
    ledger = ledger_counts([["u1", "u2", "u1"], ["u3"]], CLEAN_LOG, {"u4"})
    assert ledger["trained_twice"] == 1 and not ledger_holds(ledger)


def test_a_unit_logged_twice_and_trained_once_is_a_duplicate_not_a_failure():
    ledger = ledger_counts(CLEAN_STEPS, [*CLEAN_LOG, "u2"], {"u4"})
    assert ledger["duplicates"] == 1 and ledger_holds(ledger)


def test_a_ledger_with_nothing_trained_does_not_pass():
    assert not ledger_holds(ledger_counts([], [], set()))


def test_only_letters_of_the_units_topic_are_dropped_units():
    dropped = rollout_unit(7, recipe=RECIPE)
    assert letter_unit(letter(dropped, stage=STAGE_TRAINER, source_topic=UNITS), UNITS,
                       registry) == dropped.unit_id
    assert letter_unit(expired("g1"), UNITS, registry) is None
    assert letter_unit(dataclasses.replace(
        letter(dropped, stage=STAGE_TRAINER, source_topic=UNITS), value=b"junk"),
        UNITS, registry) is None
    assert letter_unit(dataclasses.replace(
        letter(dropped, stage=STAGE_TRAINER, source_topic=UNITS), value=None),
        UNITS, registry) is None


# ----------------------------------------------------------------- the verdict


CLEAN_OUTCOMES = {"generations": 5, "in_units": 4, "dead_lettered": 1, "no_outcome": 0,
                  "more_than_one": 0, "undecodable": 0}
CLEAN_LEDGER = {"trained": 3, "trained_twice": 0, "duplicates": 0, "dropped": 1, "lost": 0}


def verdict(**changes) -> FaultRun:
    result = DemoResult(reached=True, seconds=100.0, accuracy=0.95, version=7,
                        report=Path("report.html"), ledger=dict(CLEAN_LEDGER),
                        outcomes=dict(CLEAN_OUTCOMES), missing_acknowledged=0)
    for name, value in changes.items():
        if name in ("ledger", "outcomes"):
            getattr(result, name).update(value)
        else:
            setattr(result, name, value)
    return FaultRun(result=result, baseline=True)


def failed(run: FaultRun) -> list[str]:
    return [what for what, held, _ in run.checks() if not held]


def test_the_verdict_of_a_clean_run_passes():
    run = verdict()
    assert run.passed, run.verdict()


@pytest.mark.parametrize("changes, check", [
    ({"ledger": {"lost": 1}}, "no unit trained twice, none lost"),
    ({"ledger": {"trained_twice": 1}}, "no unit trained twice, none lost"),
    ({"ledger": {"trained": 0}}, "no unit trained twice, none lost"),
    ({"missing_acknowledged": 1}, "every acknowledged generation is in its topic"),
    ({"missing_acknowledged": None}, "every acknowledged generation is in its topic"),
    ({"outcomes": {"more_than_one": 1}}, "every generation has exactly one outcome"),
    ({"outcomes": {"no_outcome": 1}}, "every generation has exactly one outcome"),
    ({"reached": False}, "the policy reached the target"),
])
def test_the_verdict_catches_each_failure(changes, check):
    run = verdict(**changes)
    assert failed(run) == [check] and not run.passed
    assert f"FAIL {check}" in run.verdict()


def test_a_run_that_never_counted_outcomes_does_not_pass():
    run = verdict()
    run.result.outcomes = {}
    assert failed(run) == ["every generation has exactly one outcome"]


def _checkpoint(step: int, offset: int, writer: str = "a"):
    from reef_stream.core.events import Checkpoint, TopicOffset

    return Checkpoint(checkpoint_id=f"c{step}{writer}", recipe="r", trainer_group="g", step=step,
                      model="m", policy_version=step, uri=f"/store/step-{step:08d}.{writer}",
                      sha256="0" * 64, offsets=(TopicOffset(topic="units", partition=0, offset=offset),),
                      trained_unit_count=4, created_at=0)


def test_one_chain_of_checkpoints_passes_even_across_a_resumed_writer():
    events = [_checkpoint(1, 4), _checkpoint(2, 8), _checkpoint(3, 12, "b")]
    assert checkpoint_chain(events) == {"checkpoints": 3, "steps": 3, "forks": 0, "breaks": 0,
                                        "writers": 2}
    assert checkpoint_chain([_checkpoint(7, 28)])["breaks"] == 0   # a store resumed at 7


def test_a_second_writer_of_a_step_is_a_fork_and_a_gap_or_a_step_back_a_break():
    forked = [_checkpoint(1, 4), _checkpoint(2, 8), _checkpoint(2, 8, "zombie")]
    assert checkpoint_chain(forked)["forks"] == 1 and checkpoint_chain(forked)["breaks"] == 1
    assert checkpoint_chain([_checkpoint(1, 4), _checkpoint(3, 12)])["breaks"] == 1
    assert checkpoint_chain([_checkpoint(1, 8), _checkpoint(2, 4)])["breaks"] == 1
