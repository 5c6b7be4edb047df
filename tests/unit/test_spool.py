"""The on-disk spool: order, acknowledgement, reopening after a crash, damage, its bound."""

from __future__ import annotations

import threading
import time

import pytest

from reef_stream.core.errors import ConfigurationError
from reef_stream.intake.spool import Spool, SpoolFull


def _fill(spool: Spool, count: int, start: int = 0) -> list[int]:
    return [spool.append("t", f"k{i}".encode(), f"value-{i}".encode(), [("h", b"v")])
            for i in range(start, start + count)]


def test_records_come_back_in_order_with_everything_they_carried(tmp_path):
    spool = Spool(tmp_path)
    seqs = _fill(spool, 5)
    entries = list(spool.unacked())
    assert [e.seq for e in entries] == seqs == sorted(seqs)
    assert [e.value for e in entries] == [f"value-{i}".encode() for i in range(5)]
    assert entries[0].key == b"k0" and entries[0].headers == (("h", b"v"),)
    assert entries[0].topic == "t"


def test_acknowledged_records_leave_and_their_room_is_freed(tmp_path):
    spool = Spool(tmp_path)
    seqs = _fill(spool, 4)
    before = spool.pending_bytes
    spool.ack([seqs[1], seqs[3]])
    assert [e.seq for e in spool.unacked()] == [seqs[0], seqs[2]]
    assert spool.pending_bytes < before and len(spool) == 2
    spool.ack([seqs[0], seqs[2]])
    assert len(spool) == 0 and spool.pending_bytes == 0


def test_unacked_after_and_limit(tmp_path):
    spool = Spool(tmp_path)
    seqs = _fill(spool, 10)
    assert [e.seq for e in spool.unacked(after=seqs[3], limit=3)] == seqs[4:7]


def test_a_new_spool_on_the_same_directory_finds_what_was_not_acknowledged(tmp_path):
    spool = Spool(tmp_path, fsync="always")
    seqs = _fill(spool, 6)
    spool.ack(seqs[:2])
    # No close(): as if the process had been killed.
    reopened = Spool(tmp_path)
    assert [e.seq for e in reopened.unacked()] == seqs[2:]
    assert [e.value for e in reopened.unacked()] == [f"value-{i}".encode() for i in range(2, 6)]
    new = reopened.append("t", None, b"after restart")
    assert new > seqs[-1]  # sequence numbers never go back


def test_attachments_come_back_with_the_ack(tmp_path):
    spool = Spool(tmp_path)
    first = spool.append("t", None, b"a", attachment="handle-a")
    second = spool.append("t", None, b"b")
    assert spool.ack([first, second]) == {first: "handle-a"}


def test_a_torn_last_frame_is_reported_and_the_records_before_it_kept(tmp_path):
    spool = Spool(tmp_path)
    _fill(spool, 3)
    spool.close()
    segment = next(tmp_path.glob("seg-*.log"))
    data = segment.read_bytes()
    segment.write_bytes(data[:-4])  # the last frame was cut short by a crash

    reopened = Spool(tmp_path)
    assert [e.value for e in reopened.unacked()] == [b"value-0", b"value-1"]
    assert reopened.damaged and "cut short" in reopened.damaged[0][2]


def test_a_corrupted_frame_fails_its_checksum(tmp_path):
    spool = Spool(tmp_path)
    _fill(spool, 3)
    spool.close()
    segment = next(tmp_path.glob("seg-*.log"))
    data = bytearray(segment.read_bytes())
    data[-3] ^= 0xFF
    segment.write_bytes(bytes(data))

    reopened = Spool(tmp_path)
    assert len(list(reopened.unacked())) == 2
    assert reopened.damaged[0][2] == "checksum mismatch"


def test_a_full_spool_blocks_then_raises_and_writes_nothing(tmp_path):
    spool = Spool(tmp_path, max_bytes=100)
    spool.append("t", None, b"x" * 60)
    started = time.monotonic()
    with pytest.raises(SpoolFull, match="is full"):
        spool.append("t", None, b"y" * 60, timeout=0.3)
    assert time.monotonic() - started >= 0.3
    assert [e.value for e in spool.unacked()] == [b"x" * 60]


def test_a_full_spool_takes_the_record_once_room_is_freed(tmp_path):
    spool = Spool(tmp_path, max_bytes=100)
    first = spool.append("t", None, b"x" * 60)
    threading.Timer(0.2, spool.ack, args=([first],)).start()
    spool.append("t", None, b"y" * 60, timeout=5)
    assert [e.value for e in spool.unacked()] == [b"y" * 60]


def test_a_record_larger_than_the_bound_is_refused_at_once(tmp_path):
    spool = Spool(tmp_path, max_bytes=10)
    with pytest.raises(SpoolFull, match="can never fit"):
        spool.append("t", None, b"z" * 11, timeout=60)


def test_finished_segments_are_deleted(tmp_path, monkeypatch):
    monkeypatch.setattr("reef_stream.intake.spool._SEGMENT_BYTES", 200)
    spool = Spool(tmp_path)
    seqs = _fill(spool, 20)
    assert len(list(tmp_path.glob("seg-*.log"))) > 2
    spool.ack(seqs)
    assert len(list(tmp_path.glob("seg-*.log"))) <= 1  # only the one still being written


def test_bad_settings_are_configuration_errors(tmp_path):
    with pytest.raises(ConfigurationError, match="fsync"):
        Spool(tmp_path, fsync="sometimes")
    with pytest.raises(ConfigurationError, match="max_bytes"):
        Spool(tmp_path, max_bytes=0)
