"""The trainer's backlog bound with several processor instances of one group (real broker):
together they emit the bound, each its share, not the whole bound each.

An instance knows its own units only; it scales them by the share of the partitions it holds
(``consumers.backlog``). Its states count the units it emits in a batch one by one; counted
against the whole bound they let each instance emit the bound in one batch (the units of a
batch are counted before the next estimate), so two instances emitted up to twice the bound."""

from __future__ import annotations

import dataclasses
import threading

from reef_stream.consumers.processor.backlog import share
from reef_stream.consumers.processor.runtime import ProcessorRuntime
from reef_stream.topics.declarations import DATA_PARTITIONS
from tests.helpers import wait_until
from tests.integration.test_processor_runtime import RECIPE, create_topics, make_workload, produce
from tests.integration.test_processor_runtime_paths import _checkpoint_at, fresh

BOUND = 16  # max_backlog_steps 2 of 8 units


def test_two_instances_of_a_group_emit_the_backlog_bound_together_not_each(kafka_bootstrap,
                                                                          namespace):
    create_topics(kafka_bootstrap, namespace)
    bounded = dataclasses.replace(RECIPE, schedule=dataclasses.replace(
        RECIPE.schedule, max_backlog_steps=2))
    assert bounded.schedule.max_backlog_units == BOUND
    _checkpoint_at(kafka_bootstrap, namespace, 3, {})      # a trainer, which never moves on
    work = fresh(make_workload(windows=3, groups_per_window=20, seed=17), version=3)
    runtimes = [ProcessorRuntime(bounded, bootstrap=kafka_bootstrap, namespace=namespace,
                                 instance=name, log_every_s=5) for name in ("a", "b")]
    threads = []
    try:
        for runtime in runtimes:  # the second joins once the first runs: the partitions split
            ready = threading.Event()
            threads.append(threading.Thread(target=runtime.run, kwargs={"ready": ready},
                                            daemon=True))
            threads[-1].start()
            wait_until(ready.is_set, 60, "the processor's partitions", poll_s=0.2)
        held = [set(runtime._parts) for runtime in runtimes]

        def split() -> bool:
            held[:] = [set(runtime._parts) for runtime in runtimes]
            return (all(held) and not held[0] & held[1]
                    and held[0] | held[1] == set(range(DATA_PARTITIONS))
                    and all(runtime.newest_checkpoint == 3 for runtime in runtimes))

        wait_until(split, 60, "the partitions split between the two, the checkpoint seen",
                   poll_s=0.2)
        produce(kafka_bootstrap, namespace, work.windows)   # 60 complete groups at once

        def concluded() -> int:
            return sum(n for runtime in runtimes for kind, n in runtime.counts.items()
                       if kind.startswith("generations.") and kind != "generations.duplicate")

        wait_until(lambda: concluded() == len(work.generations), 60,
                   "every generation concluded", poll_s=0.2)
        assert [set(runtime._parts) for runtime in runtimes] == held, "a rebalance meanwhile"
    finally:
        for runtime in runtimes:
            runtime.stop()
        for thread in threads:
            thread.join(30)
    units = [runtime.counts["units"] for runtime in runtimes]
    shares = [share(BOUND, len(partitions), DATA_PARTITIONS) for partitions in held]
    assert units == shares and sum(units) == BOUND, (units, shares, held,
                                                     [r.counts for r in runtimes])
    assert all(runtime.counts["generations.shed"] > 0 for runtime in runtimes)
