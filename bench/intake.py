"""Intake throughput: the producer SDK against a raw confluent-kafka producer.

    python bench/intake.py [--records N] [--sizes 1024,16384] [--batch 1000] [--repeat 1]
                           [--paths raw,sdk,many]

For each record size it runs, against the same broker and in the same
process:

- ``raw``: a bare ``confluent_kafka.Producer`` with the same settings
  (acks=all, idempotence, lz4, linger 5 ms) producing the same records
  already encoded, then ``flush``;
- ``sdk``: ``RecordProducer.send`` of typed Generations (validation + Avro
  encoding + produce), then ``flush`` until every record is acknowledged;
- ``many``: ``RecordProducer.send_many`` of the same Generations in batches
  of ``--batch``, then ``flush``.

It prints records/s and MB/s (of encoded values) for each, the ratio
path/raw (of records/s, which is also that of MB/s), and the CPU time this
process spent per record (its Python thread and the client's threads; not the
broker's): a figure the machine's other load disturbs less than the rates. With ``--repeat N`` each
path runs N times, interleaved, and the best run is shown (the machine's
other load only ever slows a run down). It uses REEF_BOOTSTRAP_SERVERS if
set, otherwise it starts a throw-away single-node broker of its own.
Figures, never assertions.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from reef_stream.core.settings import load_settings
from reef_stream.topics.connect import client_config
from reef_stream.core.events import FinishReason, Generation, SamplingParams
from reef_stream.intake.producer import RecordProducer, record_key
from reef_stream.servers.kafka_local import configured_or_throwaway
from reef_stream.topics.admin import ensure_topics
from reef_stream.topics.declarations import declare_topics, generations
from reef_stream.core.serde import SchemaRegistry

RAW_CONFIG = {"acks": "all", "enable.idempotence": True, "linger.ms": 5,
              "compression.type": "lz4", "queue.buffering.max.messages": 200_000,
              "queue.buffering.max.kbytes": 512 * 1024, "message.max.bytes": 17 * 1024 * 1024}


#: The paths measured, in the order they run and are printed.
PATHS = ("raw", "sdk", "many")


def make_generations(count: int, value_bytes: int) -> list[Generation]:
    """Generations whose encoded value is about ``value_bytes`` (8 bytes per completion token)."""
    completion = max(1, (value_bytes - 300) // 8)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 150_000, completion, dtype=np.int32)
    logprobs = -rng.random(completion, dtype=np.float32)
    prompt = rng.integers(0, 150_000, 24, dtype=np.int32)
    return [Generation(
        generation_id=f"gen-{i:08d}", request_id=f"req-{i}", prompt_id=f"prompt-{i % 512}",
        model="bench", policy_version=i // 1000, replica_id="replica-0",
        prompt_token_ids=prompt, completion_token_ids=tokens, completion_logprobs=logprobs,
        finish_reason=FinishReason.STOP, created_at=1_795_000_000_000 + i,
        sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=completion),
    ) for i in range(count)]


def run_sdk(bootstrap: str, namespace: str, records: list[Generation], spool: Path,
            batch: int | None = None) -> tuple[float, float]:
    """``send`` of each record, or ``send_many`` of batches of ``batch`` records: (wall, CPU)
    seconds."""
    producer = RecordProducer(bootstrap, settings=load_settings(), namespace=namespace,
                              spool_dir=spool)
    producer.send(records[0]).wait(60)  # connected, producer id acquired: not timed
    started, cpu = time.perf_counter(), time.process_time()
    if batch is None:
        for record in records[1:]:
            producer.send(record)
    else:
        for first in range(1, len(records), batch):
            producer.send_many(records[first:first + batch])
    report = producer.flush(300)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    producer.close()
    assert report.complete and report.acknowledged == len(records), report
    return elapsed, cpu


def run_raw(bootstrap: str, topic: str,
            encoded: list[tuple[bytes, bytes, list]]) -> tuple[float, float]:
    producer = Producer(client_config(bootstrap, RAW_CONFIG))
    key, value, headers = encoded[0]
    producer.produce(topic, value=value, key=key, headers=headers)
    producer.flush(60)  # connected, producer id acquired: not timed
    started, cpu = time.perf_counter(), time.process_time()
    for key, value, headers in encoded[1:]:
        while True:
            try:
                producer.produce(topic, value=value, key=key, headers=headers)
                break
            except BufferError:
                producer.poll(0.01)
        producer.poll(0)
    remaining = producer.flush(300)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    assert remaining == 0
    return elapsed, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--sizes", default="1024,16384", help="approximate value sizes in bytes")
    parser.add_argument("--batch", type=int, default=1000, help="records per send_many call")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each path (interleaved); the best is shown")
    parser.add_argument("--paths", default=",".join(PATHS),
                        help="the paths to run (raw is always run: the ratios are to it)")
    args = parser.parse_args()
    paths = ["raw"] + [p for p in PATHS if p != "raw" and p in args.paths.split(",")]

    settings = load_settings()
    workdir = Path(tempfile.mkdtemp(prefix="reef-bench-"))
    with configured_or_throwaway(settings, workdir) as bootstrap:
        registry = SchemaRegistry.default()
        print(f"{args.records} records per run, best of {args.repeat}, send_many batches of "
              f"{args.batch}, broker {bootstrap}\n")
        print(f"{'size':>8} {'path':<5} {'records/s':>11} {'MB/s':>8} {'/raw':>6} "
              f"{'cpu µs/rec':>10}")
        for size in (int(s) for s in args.sizes.split(",")):
            records = make_generations(args.records, size)
            encoded = []
            for record in records:
                value, headers = registry.encode(record)
                encoded.append((record_key(record), value, headers))
            megabytes = sum(len(v) for _, v, _ in encoded) / 1e6
            results: dict[str, float] = {}  # the best wall time of each path
            cpus: dict[str, float] = {}     # the least CPU time of each path
            for _ in range(args.repeat):
                for path in paths:  # raw first: it also warms the broker up
                    namespace = f"bench{uuid.uuid4().hex[:8]}"
                    ensure_topics(AdminClient(client_config(bootstrap)), declare_topics(namespace))
                    if path == "raw":
                        elapsed, cpu = run_raw(bootstrap, generations(namespace), encoded)
                    else:
                        elapsed, cpu = run_sdk(bootstrap, namespace, records, workdir / namespace,
                                               batch=args.batch if path == "many" else None)
                    results[path] = min(elapsed, results.get(path, elapsed))
                    cpus[path] = min(cpu, cpus.get(path, cpu))
            actual = megabytes * 1e6 / len(records)
            for path in paths:
                ratio = f"{results['raw'] / results[path]:6.2f}" if path != "raw" else ""
                print(f"{actual:8.0f} {path:<5} {(len(records) - 1) / results[path]:11,.0f} "
                      f"{megabytes / results[path]:8.1f} {ratio:>6} "
                      f"{cpus[path] * 1e6 / (len(records) - 1):10.1f}")


if __name__ == "__main__":
    main()
