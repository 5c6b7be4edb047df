"""Throughput of reef-stream's typed serde against raw fastavro, for Generations of ~1 KB and ~16 KB.

    python bench/serde.py [--records N]

"reef" is the full path a producer and a consumer take: a typed
``Generation`` → value bytes + headers (``encode``) and back to a
``Generation`` (``decode``, with the fingerprint lookup, the fully-consumed
check and zero-copy arrays). "raw" is fastavro alone on a pre-built dict with
the same parsed schema. MB/s counts encoded value bytes (1 MB = 10^6 bytes).
Each figure is the best of three passes. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from io import BytesIO

import numpy as np
from fastavro import schemaless_reader, schemaless_writer

from reef_stream.core.events import FinishReason, Generation, SamplingParams, now_ms, to_avro
from reef_stream.core.serde import SchemaRegistry

PROMPT_LEN = 64
TARGET_SIZES = {"~1 KB": 1024, "~16 KB": 16 * 1024}


def make_generation(completion_len: int) -> Generation:
    rng = np.random.default_rng(0)
    return Generation(
        generation_id="gen-00000000-0000-0000-0000-000000000001",
        request_id="req-00000000-0000-0000-0000-000000000001",
        prompt_id="gsm8k/train/00042",
        group_id="grp-00000000-0000-0000-0000-000000000001",
        group_size=8,
        model="qwen2.5-0.5b-instruct",
        policy_version=12,
        replica_id="vllm-replica-0",
        prompt_token_ids=rng.integers(0, 151_000, PROMPT_LEN, dtype=np.int32),
        completion_token_ids=rng.integers(0, 151_000, completion_len, dtype=np.int32),
        completion_logprobs=-rng.exponential(1.0, completion_len).astype(np.float32),
        finish_reason=FinishReason.STOP,
        sampling=SamplingParams(temperature=0.7, top_p=0.95, top_k=50, max_tokens=4096, seed=1234),
        created_at=now_ms(),
        metadata={"dataset": "gsm8k"},
    )


def generation_of_size(registry: SchemaRegistry, target: int) -> Generation:
    """A Generation whose encoded value is close to ``target`` bytes (8 bytes per completion token)."""
    base = len(registry.encode(make_generation(0))[0])
    return make_generation(max(0, (target - base) // 8))


def best_seconds(operation: Callable[[], object], records: int) -> float:
    """The fastest of three passes of ``records`` calls, in seconds."""
    operation()  # warm up
    passes = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(records):
            operation()
        passes.append(time.perf_counter() - start)
    return min(passes)


def measure(registry: SchemaRegistry, event: Generation, records: int) -> dict[str, float]:
    """Seconds for ``records`` encodes and decodes, reef and raw."""
    parsed = registry.current(Generation.SCHEMA).parsed
    record = to_avro(event)
    value, headers = registry.encode(event)

    def raw_encode() -> bytes:
        buffer = BytesIO()
        schemaless_writer(buffer, parsed, record)
        return buffer.getvalue()

    return {
        "reef encode": best_seconds(lambda: registry.encode(event), records),
        "raw encode": best_seconds(raw_encode, records),
        "reef decode": best_seconds(lambda: registry.decode(value, headers, Generation), records),
        "raw decode": best_seconds(lambda: schemaless_reader(BytesIO(value), parsed), records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20_000, help="records per pass (default 20000)")
    records = parser.parse_args().records
    registry = SchemaRegistry.default()

    print(f"{records} records per pass, best of 3\n")
    print(f"{'size':>7} {'value B':>8} {'path':<12} {'records/s':>11} {'MB/s':>8} {'reef/raw':>9}")
    for label, target in TARGET_SIZES.items():
        event = generation_of_size(registry, target)
        size = len(registry.encode(event)[0])
        seconds = measure(registry, event, records)
        for path in ("encode", "decode"):
            for side in ("reef", "raw"):
                rate = records / seconds[f"{side} {path}"]
                ratio = seconds[f"raw {path}"] / seconds[f"reef {path}"]
                shown_ratio = f"{ratio:9.2f}" if side == "reef" else ""
                print(
                    f"{label:>7} {size:>8} {side + ' ' + path:<12} {rate:>11,.0f} "
                    f"{rate * size / 1e6:>8.1f} {shown_ratio}"
                )


if __name__ == "__main__":
    main()
