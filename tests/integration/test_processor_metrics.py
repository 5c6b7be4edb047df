"""The processor runtime's counts reach ``<ns>.metrics`` as Metric events, and they are true.

A small workload whose every outcome is known in advance (records are sent
generations first, then feedback, so their order is fixed): complete
groups (UNIT), a group behind the newest checkpoint (TOO_STALE), a group
whose members disagree on its size (INVALID), ungrouped generations without
feedback (EXPIRED); feedback that is late (for each of those non-unit
generations), duplicate, from a source the processor ignores, or for a
generation that never comes (ORPHANED); duplicate generations and a record
that does not decode. The test checks the committed log first (units and
dead letters say what really happened), then that the newest Metric event of
each name and label in ``<ns>.metrics`` holds exactly those counts, while the
runtime still runs (they are written at most every ``metrics_every_s``, not
only at exit); and so do the distributions (rewards of version 4 by source,
completion lengths, truncation) and the consumer lag, 0 once all is read.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
from collections import Counter

import pytest
from confluent_kafka import Producer

from reef_stream.consumers.processor.runtime import ProcessorRuntime
from reef_stream.core import metric_names
from reef_stream.core.events import Checkpoint, DeadLetter, FinishReason, Metric, RolloutUnit
from reef_stream.core.serde import SchemaRegistry
from reef_stream.topics import declarations
from reef_stream.topics.connect import client_config
from tests.helpers import events_to_end, wait_until
from tests.integration.test_processor_runtime import (
    _COMPLETION, RECIPE, create_topics, feedback, generation, produce,
)

INSTANCE = "metrics-test"


def publish_checkpoint(bootstrap: str, namespace: str, version: int) -> None:
    value, headers = SchemaRegistry.default().encode(Checkpoint(
        checkpoint_id=f"ckpt-{version}", recipe=RECIPE.name, trainer_group="trainers", step=version,
        model="tiny", policy_version=version, uri="file:///tmp/ckpt", sha256="00" * 32,
        offsets=(), trained_unit_count=8 * version, created_at=1_795_000_000_000))
    producer = Producer(client_config(bootstrap))
    producer.produce(declarations.checkpoints(namespace), value=value, headers=headers)
    assert producer.flush(30) == 0


def latest_metrics(bootstrap: str, namespace: str, instance: str) -> dict[tuple, float]:
    """The newest value of each (name, label) of the processor stage of ``instance``, in
    ``<ns>.metrics`` up to its current end (a running runtime writes on: read to the end
    offsets, never until the topic goes quiet)."""
    latest: dict[tuple, float] = {}
    events = events_to_end(bootstrap, declarations.metrics(namespace), Metric)
    for event in events:  # key = stage: one partition, in the order written
        labels = dict(event.labels)
        if event.stage != metric_names.STAGE_PROCESSOR or labels.pop("instance", None) != instance:
            continue
        assert labels.pop("recipe") == RECIPE.name and "group" in labels.keys()
        labels.pop("group")
        latest[(event.name, *sorted(labels.items()))] = event.value
    return latest


def wait_for(condition, timeout: float, what: str) -> None:
    """``wait_until``, polling every 0.2 s."""
    wait_until(condition, timeout, what, poll_s=0.2)


def test_metrics_topic_holds_the_true_running_counts(kafka_bootstrap, namespace):
    create_topics(kafka_bootstrap, namespace)
    publish_checkpoint(kafka_bootstrap, namespace, 5)  # max_staleness 2: version 0 is too stale
    runtime = ProcessorRuntime(RECIPE, bootstrap=kafka_bootstrap, namespace=namespace,
                               instance=INSTANCE, metrics_every_s=0.5)
    failures: list[BaseException] = []

    def run() -> None:
        try:
            runtime.run()
        except BaseException as error:  # noqa: BLE001 - reported below
            failures.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: runtime.newest_checkpoint == 5 or failures, 60, "the checkpoint")

        def fresh(gid, group, size):
            # groups u0 and u1 (8 generations) were cut at max_tokens
            cut = group in ("u0", "u1")
            return dataclasses.replace(generation(gid, group, size), policy_version=4,
                                       finish_reason=FinishReason.LENGTH if cut else FinishReason.STOP)

        units = [fresh(f"u{g}m{m}", f"u{g}", 4) for g in range(6) for m in range(4)]
        stale = [generation(f"stale-m{m}", "stale", 4) for m in range(4)]  # policy_version 0
        invalid = [fresh(f"bad-m{m}", "bad", size) for m, size in enumerate((3, 3, 2))]
        lonely = [fresh(f"lonely-{i}", None, 1) for i in range(3)]
        gens = units + stale + invalid + lonely
        first = [*gens, units[0], units[5],  # 2 duplicate generations
                 *(feedback(g.generation_id, g.group_id, 0.25 * i) for i, g in enumerate(
                     units + stale + invalid)),  # used; late for stale and invalid ones
                 feedback("u0m0", "u0", 1.0, suffix="-again"),  # 3 duplicates (same source)
                 feedback("u1m1", "u1", 1.0, suffix="-again"),
                 feedback("u2m2", "u2", 1.0, suffix="-again"),
                 feedback("u3m3", "u3", 1.0, source="a-judge-nobody-asked"),  # ignored
                 feedback("ghost", None, 1.0)]  # orphaned: its generation never comes
        produce(kafka_bootstrap, namespace, [first])
        garbage = Producer(client_config(kafka_bootstrap))
        garbage.produce(declarations.generations(namespace), key=b"junk", value=b"not avro")
        assert garbage.flush(30) == 0
        # The lonely generations expire (3 s without feedback); then their feedback is late.
        wait_for(lambda: runtime.counts["generations.expired"] == 3 or failures, 30, "expiry")
        produce(kafka_bootstrap, namespace, [[feedback(g.generation_id, None, 1.0) for g in lonely]])

        expected = {
            (metric_names.PROCESSOR_GENERATIONS, ("outcome", "unit")): 24,
            (metric_names.PROCESSOR_GENERATIONS, ("outcome", "expired")): 3,
            (metric_names.PROCESSOR_GENERATIONS, ("outcome", "too_stale")): 4,
            (metric_names.PROCESSOR_GENERATIONS, ("outcome", "invalid")): 3,
            (metric_names.PROCESSOR_FEEDBACK, ("fate", "used")): 24,
            (metric_names.PROCESSOR_FEEDBACK, ("fate", "late")): 4 + 3 + 3,
            (metric_names.PROCESSOR_FEEDBACK, ("fate", "duplicate")): 3,
            (metric_names.PROCESSOR_FEEDBACK, ("fate", "ignored")): 1,
            (metric_names.PROCESSOR_FEEDBACK, ("fate", "orphaned")): 1,
            (metric_names.PROCESSOR_FEEDBACK, ("fate", "unused")): 0,
            (metric_names.PROCESSOR_DUPLICATE_GENERATIONS,): 2,
            (metric_names.PROCESSOR_UNITS,): 6,
            (metric_names.PROCESSOR_INVALID_RECORDS,): 1,
            (metric_names.PROCESSOR_ABORTED_TRANSACTIONS,): 0,
        }
        # The committed log says what really happened: it must agree with the expectation.
        # Each try reads both topics to their current end (committed records only).
        logged: dict = {}
        kinds: Counter = Counter()

        def log_agrees() -> bool:
            nonlocal logged, kinds
            unit_events = events_to_end(kafka_bootstrap, declarations.units(namespace, RECIPE.name),
                                        RolloutUnit)
            kinds = Counter(d.error_type for d in events_to_end(
                kafka_bootstrap, declarations.dead_letters(namespace), DeadLetter))
            logged = {
                (metric_names.PROCESSOR_GENERATIONS, ("outcome", "unit")):
                    sum(len(u.members) for u in unit_events),
                (metric_names.PROCESSOR_UNITS,): len({u.unit_id for u in unit_events}),
                **{(metric_names.PROCESSOR_GENERATIONS, ("outcome", o)): kinds[f"processor.{o}"]
                   for o in ("expired", "too_stale", "invalid")},
                **{(metric_names.PROCESSOR_FEEDBACK, ("fate", f)): kinds[f"processor.{f}"]
                   for f in ("late", "orphaned", "unused")},
                (metric_names.PROCESSOR_INVALID_RECORDS,): sum(
                    n for k, n in kinds.items() if not k.startswith("processor.")),
            }
            return all(expected[k] == v for k, v in logged.items())

        wait_until(log_agrees, 45, lambda: f"the log to agree with the expected counts: "
                   f"{logged} from dead letters {dict(kinds)}", poll_s=0.2)
        assert logged == {k: expected[k] for k in logged}, (logged, dict(kinds))
        # The newest Metric of each name and label, written while the runtime runs.
        latest: dict = {}

        def metrics_written() -> bool:
            nonlocal latest
            latest = latest_metrics(kafka_bootstrap, namespace, INSTANCE)
            return all(latest.get(k) == v for k, v in expected.items())

        wait_until(metrics_written, 20, lambda: f"the expected metrics {expected}; the newest are "
                   f"{ {k: latest.get(k) for k in expected} } (runtime failures: {failures})",
                   poll_s=0.2)
        assert not failures, failures
        assert {k: latest.get(k) for k in expected} == expected
        assert thread.is_alive(), "the metrics were written by the running runtime"
        # The distributions: the 24 used rewards 0.25 * i of version 4 (source exact_match),
        # and the 24 unit members' completion lengths and truncation (8 cut).
        rewards = [0.25 * i for i in range(24)]
        v4, source = ("policy_version", "4"), ("source", "exact_match")
        reward, tokens = metric_names.PROCESSOR_REWARD, metric_names.PROCESSOR_RESPONSE_TOKENS
        distributions = {
            (f"{reward}.count", v4, source): 24,
            (f"{reward}.mean", v4, source): pytest.approx(statistics.fmean(rewards)),
            (f"{reward}.std", v4, source): pytest.approx(statistics.pstdev(rewards)),
            **{(f"{reward}.bucket", ("le", le), v4, source): n for le, n in (
                ("-1", 0), ("-0.5", 0), ("0", 1), ("0.25", 2), ("0.5", 3), ("0.75", 4), ("1", 5),
                ("+Inf", 24))},
            (f"{tokens}.count", v4): 24,
            (f"{tokens}.mean", v4): len(_COMPLETION),
            (f"{tokens}.std", v4): 0,
            (metric_names.PROCESSOR_TRUNCATION_RATE, v4): pytest.approx(8 / 24),
            (f"{metric_names.PROCESSOR_TRUNCATION_RATE}.count", v4): 24,
        }
        assert {k: latest.get(k) for k in distributions} == distributions
        assert not [k for k in latest if k[0].startswith(f"{reward}.")
                    and k not in distributions], "no reward series but version 4's"
        # Lag per partition, read to the end of both input topics: all 0 at the last write.
        lag_topics = {dict(k[1:])["topic"] for k in latest if k[0] == metric_names.CONSUMER_LAG}
        assert lag_topics == {declarations.generations(namespace), declarations.feedback(namespace)}
        assert all(v == 0 for k, v in latest.items() if k[0] == metric_names.CONSUMER_LAG), latest
    finally:
        runtime.stop()
        thread.join(30)
    assert not failures, failures
    # At exit the final counts are written (and flushed): transactions included.
    latest = latest_metrics(kafka_bootstrap, namespace, INSTANCE)
    assert runtime.transactions > 0
    assert latest[(metric_names.PROCESSOR_TRANSACTIONS,)] == runtime.transactions
    assert {k: latest.get(k) for k in expected} == expected
    assert runtime.metrics_dropped == 0
