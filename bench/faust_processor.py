"""The processor's job on faust-streaming, against a raw loop and the transactional loop.

    pip install 'reef-stream[faust]'      # faust-streaming: an extra, for this benchmark only
    python bench/faust_processor.py [--generations 6000] [--skip-exactly-once]

Issue 4 asked for the processor runtime on faust-streaming first, and for the
measurements that decide otherwise. Same data and baselines as
``bench/processor.py`` (imported from it: groups of 4 ~1 KB generations and
their feedback, shuffled within windows, keyed by group, produced before
anything runs), in one run against one broker:

- ``raw``: ``bench/processor.py``'s bare confluent-kafka consume-and-produce loop;
- ``transactional loop``: ``ProcessorRuntime`` (reef process), from its first
  assignment until every unit is committed;
- ``faust``: a faust-streaming app (in a child process, so faust's event loop,
  signal handlers and logging stay out of this one) doing the same job as the
  nearest faust equivalent: one agent over both topics (faust co-partitions
  them), one ``ProcessorState`` per partition driven by ``offer`` on each
  decoded event, units and dead letters sent to topics of its own, and every
  state key the event touched written to a changelog-backed ``Table`` (the
  snapshot as raw JSON bytes; faust writes the table's changelog per event).
  Timed from its first event until the broker acknowledged every unit, with
  ``processing_guarantee="at_least_once"``; then once more with
  ``"exactly_once"`` (a fresh app id), which is reported as working only if a
  ``read_committed`` reader sees every unit.

Not in the faust app (so its figure is an upper bound for a faust runtime):
rebuilding the states from the table after a rebalance or restart, the clock
synchronisation of the two topics, ticks (expiry), checkpoints (staleness).
Uses REEF_BOOTSTRAP_SERVERS if set, otherwise a throw-away single-node
broker. Figures, never assertions.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FAUST_PARTITIONS = 6  # declarations.DATA_PARTITIONS


def _bench_processor():
    """bench/processor.py as a module (its data, raw baseline and loop runner)."""
    spec = importlib.util.spec_from_file_location("bench_processor", ROOT / "bench" / "processor.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# =========================================================================== the faust worker


def worker(bootstrap: str, ns: str, units: int, guarantee: str, result: Path, *,
           with_table: bool = True) -> None:
    """Run the faust app until killed; write {"elapsed": s, ...} to ``result`` once every
    one of ``units`` units is acknowledged. ``with_table``: write the state snapshots to
    the changelog-backed table (without: what the table costs)."""
    import logging

    import faust

    from reef_stream.core.errors import InvalidRecord
    from reef_stream.core.events import Feedback, Generation
    from reef_stream.api.processor import Origin
    from reef_stream.engine.join import ProcessorState
    from reef_stream.engine.snapshots import dumps_snapshot
    from reef_stream.topics import declarations
    from reef_stream.core.serde import SchemaRegistry
    from tests.integration.test_processor_runtime import RECIPE

    tag = _tag(guarantee, with_table)
    app = faust.App(
        f"faust-{ns}-{tag}", broker=f"kafka://{bootstrap}", store="memory://",
        processing_guarantee=guarantee, topic_partitions=FAUST_PARTITIONS,
        topic_replication_factor=1, key_serializer="raw", value_serializer="raw",
        web_enabled=False, consumer_auto_offset_reset="earliest", producer_linger_ms=5,
        producer_max_request_size=16 << 20,  # (no lz4: aiokafka lacks its library here)
        consumer_max_fetch_size=16 << 20, stream_buffer_maxsize=4096,
        table_standby_replicas=0)
    gens, fbs = declarations.generations(ns), declarations.feedback(ns)
    source = app.topic(gens, fbs, key_type=bytes, value_type=bytes)
    out_units = app.topic(f"{ns}.faust-units-{tag}", partitions=FAUST_PARTITIONS,
                          key_type=bytes, value_type=bytes)
    out_dead = app.topic(f"{ns}.faust-dead-letters-{tag}", partitions=FAUST_PARTITIONS,
                         key_type=bytes, value_type=bytes)
    table = app.Table("state", partitions=FAUST_PARTITIONS, key_type=str, value_type=bytes)
    registry = SchemaRegistry.default()
    states: dict[int, ProcessorState] = {}
    progress = {"first": None, "acked": 0, "events": 0, "dead": 0, "done": False}

    def acked(_fut) -> None:
        progress["acked"] += 1
        if progress["acked"] >= units and not progress["done"]:
            progress["done"] = True
            result.write_text(json.dumps({
                "elapsed": time.perf_counter() - progress["first"], "events": progress["events"],
                "units": progress["acked"], "dead_letters": progress["dead"]}))

    @app.agent(source)
    async def process(stream):
        async for event in stream.events():
            message = event.message
            progress["first"] = progress["first"] or time.perf_counter()
            progress["events"] += 1
            p, topic = message.partition, message.topic
            state = states.get(p)
            if state is None:
                state = states[p] = ProcessorState.for_recipe(RECIPE)
            try:
                record = registry.decode(event.value, message.headers,
                                         Generation if topic == gens else Feedback,
                                         topic=topic, partition=p, offset=message.offset)
            except InvalidRecord:
                progress["dead"] += 1
                await out_dead.send(key=message.key, value=event.value)
                continue
            step = state.offer(record, at=int(message.timestamp * 1000),
                               origin=Origin(topic, p, message.offset))
            for emitted in step.units:
                value, headers = registry.encode(emitted.unit)
                await out_units.send(key=emitted.unit_id.encode(), value=value,
                                     headers=headers, callback=acked)
            for outcome in (*step.generations, *step.feedback):
                kind = getattr(outcome, "outcome", None) or outcome.fate
                if kind.dead_letter:
                    progress["dead"] += 1
                    event_record = getattr(outcome, "generation", None) or outcome.feedback
                    value, headers = registry.encode(event_record)
                    await out_dead.send(key=message.key, value=value, headers=headers)
            for key in step.touched if with_table else ():
                snapshot = state.snapshot(key)
                if snapshot is None:
                    table.pop(key, None)
                else:
                    table[key] = dumps_snapshot(snapshot)

    logging.basicConfig(level=logging.WARNING)
    faust.Worker(app, loglevel="warning", quiet=True, redirect_stdouts=False).execute_from_commandline()


# =========================================================================== the measurement


def committed_count(bootstrap: str, topic: str, deadline_s: float) -> int:
    """How many records a ``read_committed`` reader finds in ``topic`` within the deadline."""
    from confluent_kafka import Consumer

    from reef_stream.topics.connect import client_config

    consumer = Consumer(client_config(bootstrap, {
        "group.id": f"count-{uuid.uuid4().hex[:6]}", "auto.offset.reset": "earliest",
        "enable.auto.commit": False, "isolation.level": "read_committed"}))
    consumer.subscribe([topic])
    seen, idle, end = 0, 0, time.monotonic() + deadline_s
    while time.monotonic() < end and idle < 5:
        batch = consumer.consume(5000, timeout=1.0)
        seen += sum(1 for m in batch if m.error() is None)
        idle = 0 if batch else idle + 1
    consumer.close()
    return seen


def _tag(guarantee: str, with_table: bool) -> str:
    return guarantee.replace("_", "-") + ("" if with_table else "-no-table")


def run_faust(bootstrap: str, ns: str, units: int, guarantee: str, with_table: bool = True,
              timeout_s: float = 150) -> dict:
    """The faust worker in a child process: its result, or why there is none (the log tail)."""
    from confluent_kafka.admin import AdminClient

    from reef_stream.topics.connect import client_config
    from reef_stream.topics.admin import ensure_topics
    from reef_stream.topics.declarations import Topic

    tag = _tag(guarantee, with_table)
    ensure_topics(AdminClient(client_config(bootstrap)), [  # the broker creates no topic itself
        Topic(f"{ns}.faust-{what}-{tag}", FAUST_PARTITIONS, config={"max.message.bytes": str(16 << 20)})
        for what in ("units", "dead-letters")])
    workdir = Path(tempfile.mkdtemp(prefix="reef-faust-"))
    result, log = workdir / "result.json", workdir / "worker.log"
    with log.open("w") as out:
        child = subprocess.Popen(
            [sys.executable, __file__, "--worker", "--bootstrap", bootstrap, "--ns", ns,
             "--units", str(units), "--guarantee", guarantee, "--result", str(result),
             *([] if with_table else ["--no-table"])],
            cwd=workdir, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
    started = time.monotonic()
    try:
        while not result.exists() and child.poll() is None and time.monotonic() - started < timeout_s:
            time.sleep(0.2)
        if not result.exists():
            time.sleep(1)
        if result.exists():
            time.sleep(0.5)
            figures = json.loads(result.read_text())
            # what a read_committed reader sees (exactly_once commits on its commit interval)
            figures["committed_units"] = committed_count(bootstrap, f"{ns}.faust-units-{tag}", 60)
            return figures
        why = "exited" if child.poll() is not None else f"no result within {timeout_s:.0f} s"
        return {"error": why, "log_tail": log.read_text()[-6000:]}
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGTERM)
            try:
                child.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generations", type=int, default=6000)
    parser.add_argument("--skip-exactly-once", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", help=argparse.SUPPRESS)
    parser.add_argument("--ns", help=argparse.SUPPRESS)
    parser.add_argument("--units", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--guarantee", default="at_least_once", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--no-table", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if importlib.util.find_spec("faust") is None:
        sys.exit("bench/faust_processor.py needs faust-streaming, an optional extra of "
                 "reef-stream: pip install -e '.[faust]' (or REEF_SETUP_EXTRAS=test,faust "
                 "bash scripts/setup.sh)")
    if args.worker:
        return worker(args.bootstrap, args.ns, args.units, args.guarantee, args.result,
                      with_table=not args.no_table)

    bench = _bench_processor()
    from reef_stream.core.settings import load_settings
    from reef_stream.servers.kafka_local import configured_or_throwaway

    settings = load_settings()
    workdir = Path(tempfile.mkdtemp(prefix="reef-bench-"))
    with configured_or_throwaway(settings, workdir) as bootstrap:
        ns = f"bench{uuid.uuid4().hex[:6]}"
        groups_per_window = 50
        work = bench.make_workload(max(1, args.generations // (4 * groups_per_window)),
                                   groups_per_window, seed=1)
        bench.create_topics(bootstrap, ns)
        bench.produce(bootstrap, ns, work.windows)
        gens = len(work.generations)
        records = sum(len(w) for w in work.windows)
        units = len(work.complete) // 4
        print(f"data: {gens} generations, {records} records (generations + feedback), {units} units")
        raw_s = bench.run_raw(bootstrap, ns, records)
        print(f"raw consume+produce loop: {records / raw_s:10.0f} records/s  "
              f"{gens / raw_s:9.0f} generations/s", flush=True)
        loop_s = bench.run_processor(bootstrap, ns, units)
        print(f"transactional loop (reef process): {records / loop_s:10.0f} records/s  "
              f"{gens / loop_s:9.0f} generations/s  (ratio to raw {raw_s / loop_s:.2f})", flush=True)
        runs = [("at_least_once", True), ("at_least_once", False)]
        runs += [] if args.skip_exactly_once else [("exactly_once", True)]
        for guarantee, with_table in runs:
            figures = run_faust(bootstrap, ns, units, guarantee, with_table)
            name = guarantee + ("" if with_table else ", without the table")
            if "error" in figures:
                print(f"faust ({name}): FAILED, {figures['error']}; worker log tail:\n"
                      f"{figures['log_tail']}", flush=True)
                continue
            faust_s = figures["elapsed"]
            print(f"faust ({name}): {records / faust_s:10.0f} records/s  "
                  f"{gens / faust_s:9.0f} generations/s  (ratio to raw {raw_s / faust_s:.2f}, "
                  f"to the transactional loop {loop_s / faust_s:.2f}); {figures['units']} units "
                  f"acknowledged, {figures['committed_units']} visible to read_committed, "
                  f"{figures['dead_letters']} dead letters", flush=True)


if __name__ == "__main__":
    main()
