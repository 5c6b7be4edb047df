"""``bench/raw.py``, the baseline ``bench/loop.py`` divides the loop's infra CPU by: it sends
exactly the records it divides by (whole rounds), no faster than its pace, and reads every one
back, through the real broker."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from reef_stream.demo.run import DemoOptions
from reef_stream.topics.connect import new_consumer, watermarks

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from raw import paced_raw_cpu_per_record, raw_cpu_per_record  # noqa: E402


def _records_in(bootstrap: str, topic: str) -> int:
    consumer = new_consumer(bootstrap, f"{topic}-count")
    try:
        return sum(high - low for low, high in (
            watermarks(consumer, topic, p) for p in range(DemoOptions.partitions)))
    finally:
        consumer.close()


def test_the_paced_baseline_sends_its_rounds_at_its_rate_and_reads_them_all(
        kafka_bootstrap, namespace):
    topic = f"{namespace}.raw-paced"
    started = time.monotonic()
    # 200 a second for 1.5 s in rounds of 32: ceil(300 / 32) = 10 rounds, the last due at
    # 9 x 0.16 s = 1.44 s after the first.
    per_record = paced_raw_cpu_per_record(kafka_bootstrap, topic, rate=200, seconds=1.5,
                                          round_size=32, producers=2, broker_pids=[])
    assert time.monotonic() - started >= 1.44
    assert _records_in(kafka_bootstrap, topic) == 320
    assert per_record > 0   # this process's CPU at least: the broker's pids were not given


def test_the_burst_baseline_sends_and_reads_its_records(kafka_bootstrap, namespace):
    topic = f"{namespace}.raw-burst"
    assert raw_cpu_per_record(kafka_bootstrap, topic, 500, broker_pids=[]) > 0
    assert _records_in(kafka_bootstrap, topic) == 500


@pytest.mark.parametrize("bad", [{"rate": 0}, {"seconds": -1}, {"round_size": 0},
                                 {"producers": 0}])
def test_the_paced_baseline_refuses_what_cannot_pace(bad):
    arguments = {"rate": 100, "seconds": 1, "round_size": 8, "producers": 1, **bad}
    with pytest.raises(ValueError, match="must be positive"):
        paced_raw_cpu_per_record("127.0.0.1:1", "unused", broker_pids=[], **arguments)
