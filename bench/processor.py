"""Processor runtime: generations/s joined and grouped end to end, and completion-to-unit latency.

    python bench/processor.py [--generations 20000] [--rate 1000] [--seconds 10]
                              [--skip throughput|latency]

Against the same broker, in the same run, over the same pre-produced data
(groups of 4 ~1 KB generations and their feedback, shuffled within windows,
keyed by group):

- ``processor``: ``ProcessorRuntime`` (tests' recipe ``rt``: group by
  group_id, one feedback source), from its first assignment until every unit
  is committed; transactions of up to 2,000 records;
- ``raw``: a bare confluent-kafka consume-and-produce loop over the same two
  topics (each record copied to an output topic, no decoding, no
  transactions, offsets committed once at the end): the ceiling of the
  client on this machine.

Both print this process's CPU per generation (every thread, the loop's and
librdkafka's): on a shared machine the steadier figure, as wall time also
waits for cores.

Then, at a fixed offered rate (``--rate`` generations/s plus their
feedback, for ``--seconds``), the latency from the moment the last record
of a group was acknowledged by the broker to the moment its unit was read
by a ``read_committed`` consumer (``poll``, one record at a time, and in its
group before the records start: a ``consume(1000, timeout=0.1)`` reader that
joined as they started, as before issue 15's second pass, added up to 0.1 s of
its own batching to every figure and its group join to the first second's
units, the whole p99): p50 / p99. Uses
REEF_BOOTSTRAP_SERVERS if set, otherwise a throw-away single-node broker.
Figures, never assertions.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reef_stream.core.settings import load_settings  # noqa: E402
from reef_stream.topics.connect import client_config  # noqa: E402
from reef_stream.consumers.processor.runtime import ProcessorRuntime, tune_collector  # noqa: E402
from reef_stream.core.events import Feedback, Generation, RolloutUnit  # noqa: E402
from reef_stream.servers.kafka_local import configured_or_throwaway  # noqa: E402
from reef_stream.api.processor import unit_id  # noqa: E402
from reef_stream.topics import declarations  # noqa: E402
from reef_stream.topics.admin import ensure_topics  # noqa: E402
from reef_stream.topics.declarations import Topic  # noqa: E402
from reef_stream.core.serde import SchemaRegistry  # noqa: E402
from tests.integration.test_processor_runtime import (  # noqa: E402
    RECIPE,
    create_topics,
    key_of,
    make_workload,
    produce,
)

#: Longest the throughput run waits for every unit (a run that loses units ends, saying so).
DEADLINE_S = 180.0


def run_processor(bootstrap: str, ns: str, units: int) -> tuple[float, float]:
    """Seconds from the first assignment to the last unit, and this process's CPU seconds
    (every thread: the loop's and librdkafka's) meanwhile."""
    runtime = ProcessorRuntime(RECIPE, bootstrap=bootstrap, namespace=ns, log_every_s=3600)
    ready = threading.Event()
    thread = threading.Thread(target=runtime.run, kwargs={"ready": ready}, daemon=True)
    thread.start()
    ready.wait(120)
    started, cpu = time.perf_counter(), time.process_time()
    while runtime.counts["units"] < units:
        if time.perf_counter() - started > DEADLINE_S:
            runtime.stop()
            thread.join(30)
            raise SystemExit(f"the processor emitted {runtime.counts['units']} of {units} units "
                             f"in {DEADLINE_S:.0f} s: {dict(runtime.counts)}")
        time.sleep(0.01)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    runtime.stop()
    thread.join(30)
    return elapsed, cpu


def run_raw(bootstrap: str, ns: str, records: int) -> tuple[float, float]:
    """Seconds from the first record read to the last one delivered, and this process's CPU
    seconds meanwhile."""
    consumer = Consumer(client_config(bootstrap, {
        "group.id": f"raw-{uuid.uuid4().hex[:6]}", "auto.offset.reset": "earliest",
        "enable.auto.commit": False, "fetch.max.bytes": 64 << 20}))
    producer = Producer(client_config(bootstrap, {"linger.ms": 5, "compression.type": "lz4",
                                                  "acks": "all"}))
    consumer.subscribe([declarations.generations(ns), declarations.feedback(ns)])
    out, seen, started, cpu = f"{ns}.raw-out", 0, None, 0.0
    ensure_topics(AdminClient(client_config(bootstrap)),
                  [Topic(out, declarations.DATA_PARTITIONS, config={"max.message.bytes": str(8 << 20)})])
    while seen < records:
        for message in consumer.consume(2000, timeout=0.2):
            if message.error() is not None:
                continue
            if started is None:
                started, cpu = time.perf_counter(), time.process_time()
            producer.produce(out, value=message.value(), key=message.key(),
                             headers=message.headers())
            producer.poll(0)
            seen += 1
    producer.flush(60)
    consumer.commit(asynchronous=False)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    consumer.close()
    return elapsed, cpu


def latency(bootstrap: str, ns: str, rate: float, seconds: float) -> list[float]:
    """Completion-to-unit latencies (s) at ``rate`` generations/s."""
    registry = SchemaRegistry.default()
    windows_per_s = 10
    groups = max(1, int(rate / windows_per_s / 4))
    work = make_workload(int(seconds * windows_per_s), groups, seed=3)
    runtime = ProcessorRuntime(RECIPE, bootstrap=bootstrap, namespace=ns, log_every_s=3600)
    ready = threading.Event()
    threading.Thread(target=runtime.run, kwargs={"ready": ready}, daemon=True).start()
    ready.wait(120)
    done: dict[str, float] = {}  # unit id -> when its last record was acknowledged
    received: dict[str, float] = {}

    def read_units():
        consumer = Consumer(client_config(bootstrap, {
            "group.id": f"lat-{uuid.uuid4().hex[:6]}", "auto.offset.reset": "earliest",
            "enable.auto.commit": False, "isolation.level": "read_committed"}))
        assigned = []
        consumer.subscribe([declarations.units(ns, RECIPE.name)],
                           on_assign=lambda _consumer, partitions: assigned.append(partitions))
        while not stop.is_set():
            # poll, not consume(n, timeout): consume waits for n records or the timeout, which
            # put up to 0.1 s of this reader's own batching into every latency measured
            message = consumer.poll(0.1)
            if assigned:
                reading.set()  # in the group, fetching: the records can start
            if message is not None and message.error() is None:
                unit = registry.decode(message.value(), message.headers(), RolloutUnit)
                received.setdefault(unit.unit_id, time.perf_counter())
        consumer.close()

    stop, reading = threading.Event(), threading.Event()
    reader = threading.Thread(target=read_units, daemon=True)
    reader.start()
    # The first units would otherwise wait for this reader to join its group: up to 0.5 s
    # of the reader's start-up in the slowest percent of the figures (the first second's units).
    reading.wait(60)
    producer = Producer(client_config(bootstrap, {"acks": "all", "enable.idempotence": True,
                                                  "linger.ms": 5}))
    topics = {Generation: declarations.generations(ns), Feedback: declarations.feedback(ns)}
    started = time.perf_counter()
    for w, window in enumerate(work.windows):
        members: dict[str, set[str]] = {}  # complete groups ("w000g000") of this window
        remaining: dict[str, int] = {}  # records of each not yet acknowledged
        for record in window:
            if record.group_id and record.group_id[4:].startswith("g"):
                remaining[record.group_id] = remaining.get(record.group_id, 0) + 1
                if isinstance(record, Generation):
                    members.setdefault(record.group_id, set()).add(record.generation_id)
        for record in window:
            value, headers = registry.encode(record)

            def acked(error, message, group=record.group_id, remaining=remaining,
                      members=members):
                if error is None and group in remaining:
                    remaining[group] -= 1
                    if remaining[group] == 0:
                        done[unit_id(RECIPE.name, members[group])] = time.perf_counter()

            producer.produce(topics[type(record)], value=value, key=key_of(record),
                             headers=headers, on_delivery=acked)
            producer.poll(0)
        producer.poll(0)
        pause = started + (w + 1) / windows_per_s - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
    producer.flush(30)
    end = time.perf_counter() + 30
    while time.perf_counter() < end and not set(done) <= set(received):
        time.sleep(0.1)
    stop.set()
    runtime.stop()
    return [received[u] - t for u, t in done.items() if u in received]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generations", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--skip", choices=("throughput", "latency"), action="append", default=[],
                        help="leave out a part of the run (may be given twice)")
    args = parser.parse_args()
    tune_collector()  # as `reef process` does (the raw loop hardly allocates)
    settings = load_settings()
    workdir = Path(tempfile.mkdtemp(prefix="reef-bench-"))
    with configured_or_throwaway(settings, workdir) as bootstrap:
        ns = f"bench{uuid.uuid4().hex[:6]}"
        if "throughput" not in args.skip:
            throughput(bootstrap, ns, args.generations)
        if "latency" not in args.skip:
            lat = latency(bootstrap, f"{ns}lat", args.rate, args.seconds)
            if lat:
                p50, p99 = np.percentile(np.array(lat) * 1000, [50, 99])
                print(f"completion-to-unit latency at {args.rate:.0f} generations/s offered "
                      f"({len(lat)} units): "
                      f"p50 {p50:.0f} ms, p99 {p99:.0f} ms")
            else:
                print("no latency samples")


def throughput(bootstrap: str, ns: str, generations: int) -> None:
    groups_per_window = 50
    work = make_workload(max(1, generations // (4 * groups_per_window)), groups_per_window,
                         seed=1)
    create_topics(bootstrap, ns)
    produce(bootstrap, ns, work.windows)
    gens = len(work.generations)
    records = sum(len(w) for w in work.windows)
    units = len(work.complete) // 4
    raw_s, raw_cpu = run_raw(bootstrap, ns, records)
    proc_s, proc_cpu = run_processor(bootstrap, ns, units)
    print(f"data: {gens} generations, {records} records (generations + feedback), {units} units")
    print(f"raw consume+produce loop: {records / raw_s:10.0f} records/s  {gens / raw_s:9.0f} generations/s")
    print(f"processor (joined, grouped, transactional): {records / proc_s:10.0f} records/s  "
          f"{gens / proc_s:9.0f} generations/s")
    print(f"ratio processor/raw: {raw_s / proc_s:.2f}")
    # CPU per generation is the steadier figure on a shared machine (wall time waits for cores)
    print(f"CPU of this process per generation: raw {raw_cpu / gens * 1e6:.0f} µs, "
          f"processor {proc_cpu / gens * 1e6:.0f} µs", flush=True)


if __name__ == "__main__":
    main()
