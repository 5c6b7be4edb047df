"""The producer SDK under faults: a broker killed mid-run, a producing process killed
mid-run, a spool filled while the broker is down. Nothing handed over is lost."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections import Counter

from reef_stream.core.events import Generation
from reef_stream.core.serde import decode
from reef_stream.core.settings import PROJECT_ROOT, load_settings
from reef_stream.intake.producer import (
    MESSAGE_TIMEOUT_MS, DeliveryState, RecordProducer, record_key,
)
from reef_stream.intake.spool import Spool, SpoolFull
from reef_stream.topics.declarations import generations
from tests.faults.records import generation
from tests.helpers import consume_all, reef, wait_until


def _generation_ids(bootstrap: str, namespace: str, expected: int) -> Counter:
    messages = consume_all(bootstrap, generations(namespace), expected)
    return Counter(decode(m.value(), m.headers(), Generation).generation_id for m in messages)


def _local_env(cli_env):
    return {k: v for k, v in cli_env.items() if k != "REEF_BOOTSTRAP_SERVERS"}


def test_every_record_handed_to_send_survives_a_broker_killed_mid_run(
        cluster, cli_env, namespace, tmp_path):
    producer = RecordProducer(cluster.bootstrap, settings=load_settings(), namespace=namespace,
                              spool_dir=tmp_path / "spool")
    total, handed = 12_000, []
    started, killed = threading.Event(), threading.Event()

    def kill_then_restart():
        if not started.wait(120) or len(handed) < 4_000:   # the producing loop failed
            return
        cluster.kill(1)
        killed.set()
        time.sleep(5)  # the outage: the broker stays down this long while records keep coming
        reef("kafka", "up", "--data", str(cluster.data_dir), env=_local_env(cli_env))

    chaos = threading.Thread(target=kill_then_restart)
    chaos.start()
    try:
        for i in range(total):
            handed.append(producer.send(generation(i)))
            if i == 4_000:
                started.set()
            if killed.is_set() and i % 100 == 0:
                time.sleep(0.005)  # keep producing through the outage, a little slower
    finally:
        started.set()
        chaos.join()
    report = producer.flush(120)
    producer.close()

    assert report.complete and report.failed == 0, report
    assert all(h.state is DeliveryState.ACKNOWLEDGED for h in handed)
    ids = _generation_ids(cluster.bootstrap, namespace, total)
    missing = {generation(i).generation_id for i in range(total)} - set(ids)
    assert not missing, f"{len(missing)} records lost, e.g. {sorted(missing)[:5]}"
    duplicates = sum(n - 1 for n in ids.values())
    print(f"\n{total} sent across a SIGKILL of the broker: all present, {duplicates} duplicates")


def test_a_new_producer_delivers_what_a_killed_one_had_spooled(cluster, cli_env, namespace, tmp_path):
    spool = tmp_path / "spool"
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.faults.spooling_producer", cluster.bootstrap, namespace,
         str(spool)], cwd=PROJECT_ROOT, stdout=subprocess.PIPE, text=True)
    durable: list[str] = []
    try:
        # Some records reach the broker, then the broker goes and the rest pile up in the spool.
        while len(durable) < 2_000:
            durable.append(child.stdout.readline().split()[1])
        cluster.kill(1)
        target = len(durable) + 3_000
        while len(durable) < target:
            line = child.stdout.readline()
            assert line, "the producing process died by itself"
            durable.append(line.split()[1])
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        child.kill()
    durable += [line.split()[1] for line in child.stdout.read().splitlines()]

    reef("kafka", "up", "--data", str(cluster.data_dir), env=_local_env(cli_env))
    successor = RecordProducer(cluster.bootstrap, settings=load_settings(), namespace=namespace,
                               spool_dir=spool)
    report = successor.flush(120)
    successor.close()

    assert report.complete, report
    ids = _generation_ids(cluster.bootstrap, namespace, len(durable))
    lost = set(durable) - set(ids)
    assert not lost, f"{len(lost)} durable records lost, e.g. {sorted(lost)[:5]}"
    print(f"\n{len(durable)} records were durable when the producer was killed; "
          f"the successor replayed {report.acknowledged}; all present")


def test_a_full_spool_pushes_back_then_refuses_and_loses_nothing(cluster, cli_env, namespace, tmp_path):
    producer = RecordProducer(cluster.bootstrap, settings=load_settings(), namespace=namespace,
                              spool_dir=tmp_path / "spool", spool_max_bytes=200_000,
                              block_timeout=1.0)
    accepted = [producer.send(generation(i)) for i in range(100)]
    assert producer.flush(30).complete
    cluster.kill(1)

    refused_at, deadline = None, time.monotonic() + 60
    for i in range(100, 50_000):
        started = time.monotonic()
        try:
            accepted.append(producer.send(generation(i)))
        except SpoolFull as full:
            refused_at, waited, error = i, time.monotonic() - started, full
            break
        if i % 100 == 0:  # records go to the client until it reports the broker gone
            time.sleep(0.01)
        if started > deadline:
            break
    assert refused_at is not None, "the spool never filled"
    assert waited >= 1.0, "the caller was refused without being made to wait"
    assert "is full" in str(error) and "retry" in str(error)
    assert all(h.durable for h in accepted if h.state is not DeliveryState.PENDING)

    reef("kafka", "up", "--data", str(cluster.data_dir), env=_local_env(cli_env))
    report = producer.flush(120)
    producer.close()
    assert report.complete and report.failed == 0, report
    ids = _generation_ids(cluster.bootstrap, namespace, len(accepted))
    assert set(ids) == {generation(i).generation_id for i in range(refused_at)}
    print(f"\nspool full after {refused_at - 100} records with the broker down; none lost")


def test_without_fsync_records_still_spool_and_deliver(cluster, cli_env, namespace, tmp_path):
    # fsync="always" is what the killed-producer test above runs with.
    producer = RecordProducer(cluster.bootstrap, settings=load_settings(), namespace=namespace,
                              spool_dir=tmp_path / "spool", fsync="never")
    cluster.kill(1)
    handles = [producer.send(generation(i)) for i in range(300)]
    # Records go to the spool once the client reports every broker down, at
    # the latest when librdkafka gives them back after MESSAGE_TIMEOUT_MS.
    wait_until(lambda: any(h.state is DeliveryState.SPOOLED for h in handles),
               MESSAGE_TIMEOUT_MS / 1000 + 15, "a record spooled while the broker is down",
               poll_s=0.2)
    assert producer.report().spooled > 0
    reef("kafka", "up", "--data", str(cluster.data_dir), env=_local_env(cli_env))
    assert producer.flush(120).complete
    producer.close()
    assert all(h.state is DeliveryState.ACKNOWLEDGED for h in handles)


def test_send_many_into_a_full_spool_says_which_records_it_accepted(namespace, tmp_path):
    # No broker at all: the client's queue (5 records) fills, then the spool (about 20 records).
    producer = RecordProducer("127.0.0.1:9", settings=load_settings(), namespace=namespace,
                              spool_dir=tmp_path / "spool", spool_max_bytes=20_000,
                              block_timeout=0.5, metrics_every_s=None,
                              config={"queue.buffering.max.messages": 5})
    batch = [generation(i) for i in range(100)]
    started = time.monotonic()
    try:
        producer.send_many(batch)
    except SpoolFull as full:
        error, waited = full, time.monotonic() - started
    else:
        raise AssertionError("100 records fitted in a 5-record queue and a 20 KB spool")
    accepted = error.handles
    assert 0 < len(accepted) < 40 and waited >= 0.5
    assert [h.key for h in accepted] == [record_key(r) for r in batch[:len(accepted)]]
    # The first ones may have gone to the client's queue before it found no broker; once one
    # is spooled, every later one is.
    in_memory = sum(h.state is DeliveryState.PENDING for h in accepted)
    assert in_memory <= 5
    assert [h.state for h in accepted] == \
        [DeliveryState.PENDING] * in_memory + [DeliveryState.SPOOLED] * (len(accepted) - in_memory)
    assert producer.report().spooled == len(accepted) - in_memory
    producer.close(0)
    # The rest of the batch is the caller's: the spool holds exactly the accepted ones, in order.
    spooled = [entry.key for entry in Spool(tmp_path / "spool").unacked()]
    assert spooled == [h.key for h in accepted[in_memory:]]


def test_records_in_flight_when_the_broker_stalls_are_spooled_past_the_bound(cluster, namespace,
                                                                            tmp_path):
    # A stalled broker (SIGSTOP): the records wait in the client until their timeout and come
    # back. They were accepted, so they go to the spool although it is far too small for them,
    # and the background thread that spools them never waits for room.
    producer = RecordProducer(cluster.bootstrap, settings=load_settings(), namespace=namespace,
                              spool_dir=tmp_path / "spool", spool_max_bytes=20_000,
                              block_timeout=0.5, metrics_every_s=None,
                              config={"message.timeout.ms": 2_000, "request.timeout.ms": 1_500})
    producer.send(generation(0)).wait(30)
    cluster.kill(1, signal.SIGSTOP)
    try:
        handles = producer.send_many([generation(i) for i in range(1, 301)])
        wait_until(lambda: all(h.state is DeliveryState.SPOOLED for h in handles), 20,
                   "every record in flight spooled", poll_s=0.1)
        assert producer.report().spooled == 300  # about 300 KB in a 20 KB spool
    finally:
        cluster.kill(1, signal.SIGCONT)
    report = producer.flush(60)
    producer.close()
    assert report.complete and report.failed == 0, report
    assert all(h.state is DeliveryState.ACKNOWLEDGED for h in handles)
    ids = _generation_ids(cluster.bootstrap, namespace, 301)
    assert set(ids) == {generation(i).generation_id for i in range(301)}
