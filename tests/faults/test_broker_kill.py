"""A broker killed with SIGKILL mid-stream and brought back with `reef kafka up`
serves every record that had been acknowledged before the kill."""

from __future__ import annotations

import threading
import time
from collections import Counter

from confluent_kafka import Producer

from reef_stream.topics.connect import client_config
from reef_stream.topics.declarations import generations
from tests.helpers import consume_all, reef, wait_until


def test_acknowledged_records_survive_sigkill_of_the_broker(cluster, cli_env, namespace):
    bootstrap = cluster.bootstrap
    topic = generations(namespace)

    acknowledged: list[bytes] = []
    failed: list[bytes] = []

    def on_delivery(error, message):
        (failed if error else acknowledged).append(message.key())

    producer = Producer(client_config(bootstrap, {
        "acks": "all", "enable.idempotence": True, "linger.ms": 5}))
    stop = threading.Event()
    sent = 0

    def produce_until_stopped():
        nonlocal sent
        while not stop.is_set():
            try:
                producer.produce(topic, key=f"gen-{sent:07d}".encode(), value=b"x" * 512,
                                 on_delivery=on_delivery)
                sent += 1
            except BufferError:
                pass  # the local queue is full while the broker is down: wait for it
            producer.poll(0.001 if sent % 100 == 0 else 0)

    thread = threading.Thread(target=produce_until_stopped)
    thread.start()
    try:
        wait_until(lambda: len(acknowledged) >= 5000 or not thread.is_alive(), 120,
                   "5000 acknowledged records", poll_s=0.05)
        assert thread.is_alive(), "the producing thread stopped by itself"
        acknowledged_before_kill = set(acknowledged)
        cluster.kill(1)  # SIGKILL, waits until the process is gone
        time.sleep(2)  # keep producing into a dead broker for a while
        stop.set()
        thread.join()

        reef("kafka", "up", "--data", str(cluster.data_dir),
             env={k: v for k, v in cli_env.items() if k != "REEF_BOOTSTRAP_SERVERS"})
        assert producer.flush(120) == 0, "records still unacknowledged after the restart"
    finally:
        stop.set()
        thread.join()

    keys = [m.key() for m in consume_all(bootstrap, topic, len(acknowledged))]
    present = set(keys)
    lost = acknowledged_before_kill - present
    assert not lost, f"{len(lost)} acknowledged records lost, e.g. {sorted(lost)[:5]}"
    # Everything handed to the producer was eventually acknowledged, and is there once.
    assert failed == []
    assert set(acknowledged) == present
    assert len(present) == sent
    duplicates = [k for k, n in Counter(keys).items() if n > 1]
    assert duplicates == [], f"idempotent producer wrote duplicates: {duplicates[:5]}"
    print(f"\nsent {sent}, acknowledged before the kill {len(acknowledged_before_kill)}, "
          f"all {len(present)} present after the restart")
