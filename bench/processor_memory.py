"""Processor state memory: bytes the state machine holds per concluded generation. No broker.

    python bench/processor_memory.py [--generations 200000] [--rate 300] [--lag-ms 500]
                                     [--measure tracemalloc|rss]

Feeds SAO's processor (``methods.sao.processor``: ungrouped, one feedback
source, so every generation is a group of its own) ``--generations``
demo-sized generations (~8 prompt tokens, one completion token, random
32-hex ids) at ``--rate`` per second of record time, each one's feedback
``--lag-ms`` later, along the runtime's code path
(``reef_stream.consumers.processor.runtime``): every record encoded and decoded by
the schema registry (decoded arrays are views of the message bytes, as in
the runtime), ``ProcessorState.offer`` in batches of 2,000 records, then
``next_deadline`` / ``tick`` with the newest record time, then ``snapshot``
and ``dumps_snapshot`` of every touched key (the changelog records). The
retention is the default (1 hour), longer than the run's record time, so at
the end every generation is concluded and still remembered.

Prints the memory held by the state per concluded generation, and as the
baseline the memory of a Python ``set`` holding the same ids (what an exact
duplicate check by id would pay), and their ratio. ``--measure tracemalloc``
(default; exact, slower) counts the Python allocations freed when the state
is dropped; then it restores a fresh state from the last changelog record of
every key (as ``ProcessorRuntime._restore`` does), says how many keys and
bytes that is, how long it took and whether the restored state's snapshots
equal the live one's. ``--measure rss``: the growth of the process's
resident memory instead (allocator slack included; no restore). Figures,
never assertions.

Measured (2 shared cores, 200,000 generations, default options), before the
ledger (``reef_stream.engine.ledger``) and with it: 1,252 -> 108 bytes per
concluded generation (tracemalloc; RSS 1,472 -> 134), against 123 for a set
of the ids (ratio 10.2 -> 0.88); changelog written 459 -> 157 bytes per
generation; restore 200,000 keys (72.5 MiB) in 7.7 s -> 668 keys (12.3 MiB)
in 0.5 s.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
import tracemalloc
import uuid
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reef_stream.demo.recipes import sao as _sao  # noqa: E402

REWARD_SOURCE, processor = _sao.reward.source, _sao.processor
from reef_stream.core.events import Feedback, FinishReason, Generation, SamplingParams  # noqa: E402
from reef_stream.api.processor import Origin  # noqa: E402
from reef_stream.engine.join import ProcessorState  # noqa: E402
from reef_stream.engine.snapshots import dumps_snapshot, loads_snapshot  # noqa: E402
from reef_stream.core.serde import SchemaRegistry  # noqa: E402

BATCH = 2000  # records per transaction, as reef_stream.consumers.processor.runtime.BATCH
START_MS = 1_700_000_000_000
MiB = 1 << 20


def ids(count: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return [uuid.UUID(int=rng.getrandbits(128)).hex for _ in range(count)]


def records(generation_ids: list[str], rate: float, lag_ms: int):
    """(record, arrival ms) in arrival order: each generation, its feedback ``lag_ms`` later."""
    prompt = np.arange(8, dtype=np.int32)
    pending: list[tuple[int, str]] = []
    for number, gid in enumerate(generation_ids):
        at = START_MS + int(number * 1000 / rate)
        while pending and pending[0][0] <= at:
            yield feedback(*pending.pop(0))
        yield Generation(
            generation_id=gid, request_id=gid, prompt_id="what is 3 + 4", model="tiny",
            policy_version=3, replica_id="replica-0", prompt_token_ids=prompt,
            completion_token_ids=np.array([7], np.int32),
            completion_logprobs=np.array([-0.4], np.float32), finish_reason=FinishReason.LENGTH,
            sampling=SamplingParams(max_tokens=1), created_at=at), at
        pending.append((at + lag_ms, gid))
    for item in pending:
        yield feedback(*item)


def feedback(at: int, gid: str) -> tuple[Feedback, int]:
    return Feedback(feedback_id=f"{gid}:{REWARD_SOURCE}", generation_id=gid,
                    source=REWARD_SOURCE, reward=1.0, components={}, created_at=at), at


def run(state: ProcessorState, generation_ids: list[str], rate: float, lag_ms: int,
        table: dict[str, bytes] | None) -> tuple[int, int]:
    """Drive ``state`` as the runtime does; (concluded generations, changelog bytes written)."""
    registry, concluded, written, batch = SchemaRegistry.default(), 0, 0, []
    stream = records(generation_ids, rate, lag_ms)
    while True:
        batch = [next(stream, None) for _ in range(BATCH)]
        batch = [item for item in batch if item is not None]
        if not batch:
            break
        touched: set[str] = set()
        for offset, (record, at) in enumerate(batch):
            value, headers = registry.encode(record)
            topic = "generations" if isinstance(record, Generation) else "feedback"
            decoded = registry.decode(value, headers, type(record))
            step = state.offer(decoded, at=at, origin=Origin(topic, 0, offset))
            touched.update(step.touched)
            concluded += len(step.generations)
        due = state.next_deadline()
        if due is not None and due <= state.clock:
            step = state.tick(state.clock)
            touched.update(step.touched)
            concluded += len(step.generations)
        for key in sorted(touched):
            snapshot = state.snapshot(key)
            data = None if snapshot is None else dumps_snapshot(snapshot)
            written += len(data or b"")
            if table is not None:
                if data is None:
                    table.pop(key, None)
                else:
                    table[key] = data
    return concluded, written


def held(measure: str) -> int:
    gc.collect()
    if measure == "tracemalloc":
        return tracemalloc.get_traced_memory()[0]
    return psutil.Process().memory_info().rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generations", type=int, default=200_000)
    parser.add_argument("--rate", type=float, default=300.0, help="generations per second")
    parser.add_argument("--lag-ms", type=int, default=500, help="feedback after its generation")
    parser.add_argument("--measure", choices=("tracemalloc", "rss"), default="tracemalloc")
    args = parser.parse_args()

    generation_ids = ids(args.generations)
    SchemaRegistry.default()
    state = ProcessorState(processor, recipe="sao", max_staleness=16)
    traced = args.measure == "tracemalloc"
    table: dict[str, bytes] | None = {} if traced else None  # the changelog's last records
    if traced:
        tracemalloc.start()
    before = held(args.measure)
    started = time.perf_counter()
    concluded, written = run(state, generation_ids, args.rate, args.lag_ms, table)
    elapsed = time.perf_counter() - started
    keys, pending = len(state.keys()), len(state.pending_generations())
    if traced:  # what freeing the state gives back: the state alone, not the table
        with_state = held(args.measure)
        del state
        state_bytes = with_state - held(args.measure)
    else:
        state_bytes = held(args.measure) - before

    before = held(args.measure)
    raw = set(ids(args.generations))
    raw_bytes = held(args.measure) - before
    del raw
    if traced:
        tracemalloc.stop()

    per_state, per_raw = state_bytes / concluded, raw_bytes / args.generations
    print(f"{args.generations} generations at {args.rate:g}/s of record time, feedback "
          f"{args.lag_ms} ms later; {concluded} concluded, {pending} pending, "
          f"{keys} state keys; {elapsed:.1f} s ({args.measure})")
    print(f"state:              {state_bytes / MiB:8.1f} MiB  {per_state:7.1f} bytes per "
          "concluded generation")
    print(f"set of the ids:     {raw_bytes / MiB:8.1f} MiB  {per_raw:7.1f} bytes per id")
    print(f"state / set of ids: {per_state / per_raw:8.2f}")
    print(f"changelog written:  {written / MiB:8.1f} MiB  {written / concluded:7.1f} bytes per "
          "concluded generation")
    if table is None:
        return
    # A restart: a fresh state restored from the last changelog record of every key.
    started = time.perf_counter()
    restored = ProcessorState(processor, recipe="sao", max_staleness=16)
    for key, data in table.items():
        restored.restore(key, loads_snapshot(data))
    elapsed = time.perf_counter() - started
    same = len(restored.keys()) == keys and all(  # the live state's last snapshot of each key
        dumps_snapshot(restored.snapshot(key)) == data for key, data in table.items())
    print(f"restore:            {len(table)} changelog keys, "
          f"{sum(map(len, table.values())) / MiB:.1f} MiB, {elapsed:.1f} s; "
          f"restored state equals the live one: {same}")


if __name__ == "__main__":
    main()
