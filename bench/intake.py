"""Intake throughput: the producer SDK against a raw confluent-kafka producer.

    python bench/intake.py [--records N] [--sizes 1024,16384]

For each record size it runs, against the same broker and in the same
process:

- ``sdk``: ``RecordProducer.send`` of typed Generations (validation + Avro
  encoding + produce), then ``flush`` until every record is acknowledged;
- ``raw``: a bare ``confluent_kafka.Producer`` with the same settings
  (acks=all, idempotence, lz4, linger 5 ms) producing the same records
  already encoded, then ``flush``.

It prints records/s and MB/s (of encoded values) for both and the ratio
sdk/raw. It uses REEF_BOOTSTRAP_SERVERS if set, otherwise it starts a
throw-away single-node broker of its own. Figures, never assertions.
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

from reef_stream.config import load_settings
from reef_stream.topics.connect import client_config
from reef_stream.topics.events import FinishReason, Generation, SamplingParams
from reef_stream.intake.producer import RecordProducer, record_key
from reef_stream.ops.kafka_local import configured_or_throwaway
from reef_stream.topics.admin import ensure_topics
from reef_stream.topics.declarations import declare_topics, generations
from reef_stream.topics.serde import SchemaRegistry

RAW_CONFIG = {"acks": "all", "enable.idempotence": True, "linger.ms": 5,
              "compression.type": "lz4", "queue.buffering.max.messages": 200_000,
              "queue.buffering.max.kbytes": 512 * 1024, "message.max.bytes": 17 * 1024 * 1024}


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


def run_sdk(bootstrap: str, namespace: str, records: list[Generation], spool: Path) -> float:
    producer = RecordProducer(bootstrap, settings=load_settings(), namespace=namespace,
                              spool_dir=spool)
    producer.send(records[0]).wait(60)  # connected, producer id acquired: not timed
    started = time.perf_counter()
    for record in records[1:]:
        producer.send(record)
    report = producer.flush(300)
    elapsed = time.perf_counter() - started
    producer.close()
    assert report.complete and report.acknowledged == len(records), report
    return elapsed


def run_raw(bootstrap: str, topic: str, encoded: list[tuple[bytes, bytes, list]]) -> float:
    producer = Producer(client_config(bootstrap, RAW_CONFIG))
    key, value, headers = encoded[0]
    producer.produce(topic, value=value, key=key, headers=headers)
    producer.flush(60)  # connected, producer id acquired: not timed
    started = time.perf_counter()
    for key, value, headers in encoded[1:]:
        while True:
            try:
                producer.produce(topic, value=value, key=key, headers=headers)
                break
            except BufferError:
                producer.poll(0.01)
        producer.poll(0)
    remaining = producer.flush(300)
    elapsed = time.perf_counter() - started
    assert remaining == 0
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--sizes", default="1024,16384", help="approximate value sizes in bytes")
    args = parser.parse_args()

    settings = load_settings()
    workdir = Path(tempfile.mkdtemp(prefix="reef-bench-"))
    with configured_or_throwaway(settings, workdir) as bootstrap:
        registry = SchemaRegistry.default()
        print(f"{args.records} records per run, broker {bootstrap}\n")
        print(f"{'size':>8} {'path':<5} {'records/s':>11} {'MB/s':>8} {'sdk/raw':>8}")
        for size in (int(s) for s in args.sizes.split(",")):
            records = make_generations(args.records, size)
            encoded = []
            for record in records:
                value, headers = registry.encode(record)
                encoded.append((record_key(record), value, headers))
            megabytes = sum(len(v) for _, v, _ in encoded) / 1e6
            results = {}
            for path in ("raw", "sdk"):  # raw first: it also warms the broker up
                namespace = f"bench{uuid.uuid4().hex[:8]}"
                ensure_topics(AdminClient(client_config(bootstrap)), declare_topics(namespace))
                if path == "raw":
                    results[path] = run_raw(bootstrap, generations(namespace), encoded)
                else:
                    results[path] = run_sdk(bootstrap, namespace, records, workdir / namespace)
            actual = megabytes * 1e6 / len(records)
            for path in ("raw", "sdk"):
                ratio = f"{results['raw'] / results['sdk']:8.2f}" if path == "sdk" else ""
                print(f"{actual:8.0f} {path:<5} {(len(records) - 1) / results[path]:11,.0f} "
                      f"{megabytes / results[path]:8.1f} {ratio}")


if __name__ == "__main__":
    main()
