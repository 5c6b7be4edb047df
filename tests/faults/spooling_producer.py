"""A producing process for the fault tests, killed with SIGKILL by the test.

    python -m tests.faults.spooling_producer BOOTSTRAP NAMESPACE SPOOL_DIR

Sends generations gen-0, gen-1, ... as fast as it can and prints one line
``durable <generation id>`` as soon as each record is durable (spooled or
acknowledged), so the test knows what it may demand after the kill.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from reef_stream.core.settings import load_settings
from reef_stream.intake.producer import RecordProducer
from tests.faults.records import generation

_print_lock = threading.Lock()


def main() -> None:
    bootstrap, namespace, spool_dir = sys.argv[1:4]
    producer = RecordProducer(bootstrap, settings=load_settings(), namespace=namespace,
                              spool_dir=Path(spool_dir), fsync="always", block_timeout=600)
    printed: set[str] = set()

    def report(handle, generation_id):
        if handle.durable and generation_id not in printed:
            printed.add(generation_id)
            with _print_lock:
                sys.stdout.write(f"durable {generation_id}\n")
                sys.stdout.flush()

    i = 0
    while True:
        record = generation(i)
        handle = producer.send(record)
        producer.add_state_listener(handle, lambda h, g=record.generation_id: report(h, g))
        i += 1


if __name__ == "__main__":
    main()
