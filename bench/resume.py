"""Where a trainer resumes, after N checkpoints: read back from the end against read from the start.

    python bench/resume.py [--counts 1,100,1000,10000] [--repeats 5] [--other-groups 0]

A trainer's resume (``Trainer._resume``) looks up its group's newest committed ``Checkpoint``
event in ``<ns>.checkpoints`` (``committed_checkpoint``), then loads that one checkpoint's
files. The lookup is the only part whose cost can grow with the checkpoints written before.
For every N of ``--counts``, a fresh namespace gets N Checkpoint events of one group (as a
trainer writes them, the last 100 one transaction each, the ones before in transactions of 500
to keep the setup short), and ``--other-groups`` other groups' events after each of the
group's. Then, ``--repeats`` times each, in the same process against the same broker:

- ``from_start``: the lookup as it was before (``git show eb670ce:reef_stream/consumers/
  trainer/trainer.py``): read the whole topic with a ``TopicReader`` and keep the last match;
- ``newest_first``: ``committed_checkpoint`` as it is: windows back from the end
  (``NewestFirst``), stopping at the first window holding one.

Both must find the same event (checked); each is called once before the timed calls. Per N it prints the median seconds of each and the
records the new lookup read; the last line:

    RESUME counts=... from_start_s=... newest_first_s=... newest_first_records=...

The broker is ``REEF_BOOTSTRAP_SERVERS``, or a one-node KRaft broker started for the run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from common import run, say, servers  # first: it puts the project on sys.path

from confluent_kafka import Producer

from reef_stream.consumers.trainer.trainer import committed_checkpoint
from reef_stream.core.events import Checkpoint, TopicOffset
from reef_stream.core.serde import SchemaRegistry
from reef_stream.core.settings import load_settings
from reef_stream.topics import declarations
from reef_stream.topics.admin import ensure_topics
from reef_stream.topics.connect import client_config, new_admin
from reef_stream.topics.reading import NewestFirst, TopicReader

REGISTRY = SchemaRegistry.default()
RECIPE, GROUP = "sao", "run-1"
#: The newest events of the group written one transaction each, as a trainer acknowledges.
ONE_EACH = 100
BATCH = 500


def event(group: str, step: int) -> Checkpoint:
    """A Checkpoint event of a trainer's size: one offset, a few metrics."""
    return Checkpoint(checkpoint_id=uuid.uuid4().hex, recipe=RECIPE, trainer_group=group,
                      step=step, model="sao-demo", policy_version=step,
                      uri=f"file:///var/reef/checkpoints/{group}/writer-0/step-{step:08d}",
                      sha256="0" * 64,
                      offsets=(TopicOffset(topic="reef.units.sao", partition=0, offset=step * 8),),
                      trained_unit_count=step * 8,
                      metrics={"loss": 0.5, "reward_mean": 0.25, "grad_norm": 1.0},
                      created_at=1_700_000_000_000 + step)


def write(bootstrap: str, namespace: str, count: int, other_groups: int) -> None:
    """``count`` events of ``GROUP`` (steps 1..count), each followed by ``other_groups``
    other groups' events."""
    topic = declarations.checkpoints(namespace)
    ensure_topics(new_admin(bootstrap), [t for t in declarations.declare_topics(namespace)
                                         if t.name == topic])
    producer = Producer(client_config(bootstrap, {"transactional.id": uuid.uuid4().hex,
                                                  "linger.ms": 5}))
    producer.init_transactions(30)
    steps = list(range(1, count + 1))
    split = max(len(steps) - ONE_EACH, 0)
    batches = [steps[i:i + BATCH] for i in range(0, split, BATCH)] + [[s] for s in steps[split:]]
    for batch in batches:
        producer.begin_transaction()
        for step in batch:
            for group in [GROUP, *(f"other-{g}" for g in range(other_groups))]:
                value, headers = REGISTRY.encode(event(group, step))
                producer.produce(topic, key=group.encode(), value=value, headers=headers)
        producer.commit_transaction(60)


def from_start(bootstrap: str, namespace: str) -> Checkpoint | None:
    """The lookup before ``NewestFirst``: the whole topic, the last match kept."""
    newest, key = None, GROUP.encode()
    with TopicReader(bootstrap, declarations.checkpoints(namespace)) as reader:
        for message in reader.to_end():
            if message.key() != key:
                continue
            found = REGISTRY.decode(message.value(), message.headers(), Checkpoint)
            if found.recipe == RECIPE and found.trainer_group == GROUP:
                newest = found
    return newest


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="1,100,1000,10000",
                        help="checkpoints of the group before the resume, one namespace each")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--other-groups", type=int, default=0,
                        help="other groups' events after each of the group's [default: 0]")
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    settings = load_settings()
    rows = []
    with tempfile.TemporaryDirectory(prefix="reef-bench-resume-") as home, \
            servers(settings, Path(home)) as at:
        for count in counts:
            namespace = f"bresume{uuid.uuid4().hex[:8]}"
            started = time.monotonic()
            write(at.bootstrap, namespace, count, args.other_groups)
            say(f"N={count}: {count * (1 + args.other_groups)} events written in "
                f"{time.monotonic() - started:.1f} s")
            from_start(at.bootstrap, namespace)   # warm: the process's first reads are slower
            committed_checkpoint(at.bootstrap, namespace, RECIPE, GROUP)
            old_s, new_s, records = [], [], []
            for _ in range(args.repeats):
                started = time.monotonic()
                old = from_start(at.bootstrap, namespace)
                old_s.append(time.monotonic() - started)
                reader = NewestFirst(at.bootstrap, declarations.checkpoints(namespace))
                started = time.monotonic()
                new = committed_checkpoint(at.bootstrap, namespace, RECIPE, GROUP,
                                           reader=reader)
                new_s.append(time.monotonic() - started)
                records.append(reader.records_read)
                if new != old or new is None or new.step != count:
                    raise SystemExit(f"N={count}: the lookups disagree: {old} against {new}")
            rows.append((count, statistics.median(old_s), statistics.median(new_s),
                         max(records)))
            say(f"N={count}: from_start {rows[-1][1]:.3f} s, newest_first {rows[-1][2]:.3f} s "
                f"({rows[-1][3]} records read), medians of {args.repeats}")
    print()
    print(f"{'checkpoints':>11}  {'from_start_s':>12}  {'newest_first_s':>14}  "
          f"{'records_read':>12}")
    for count, old, new, read in rows:
        print(f"{count:>11}  {old:>12.3f}  {new:>14.3f}  {read:>12}")
    print("RESUME counts=" + ",".join(str(r[0]) for r in rows)
          + " from_start_s=" + ",".join(f"{r[1]:.3f}" for r in rows)
          + " newest_first_s=" + ",".join(f"{r[2]:.3f}" for r in rows)
          + " newest_first_records=" + ",".join(str(r[3]) for r in rows))
    return 0


if __name__ == "__main__":
    run(main)
