"""``interrupt_on_sigterm``: a command stopped by a signal runs its ``finally`` blocks to the
end, also when more signals come while they run (``timeout`` and a supervisor both
signalling, or a second Ctrl-C): otherwise the stage processes it started, each in a session
of its own, are left running. A real process, really signalled."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

PROGRAM = """
import sys, time
from reef_stream.core.processes import interrupt_on_sigterm
interrupt_on_sigterm()
try:
    print("working", flush=True)
    time.sleep(60)
finally:
    print("cleaning up", flush=True)
    time.sleep(1.5)          # stopping the stages takes a while
    print("cleaned up", flush=True)
"""


def _started() -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", PROGRAM], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "working\n"
    return process


@pytest.mark.parametrize("first, again", [(signal.SIGTERM, signal.SIGTERM),
                                          (signal.SIGTERM, signal.SIGINT),
                                          (signal.SIGINT, signal.SIGTERM)])
def test_a_second_signal_while_cleaning_up_does_not_cut_the_cleanup_short(first, again):
    process = _started()
    process.send_signal(first)
    assert process.stdout.readline() == "cleaning up\n"
    process.send_signal(again)
    time.sleep(0.2)
    process.send_signal(again)
    out, err = process.communicate(timeout=30)
    assert out == "cleaned up\n", err
    assert process.returncode != 0                      # it still ends as interrupted
    assert err.count("already stopping the stages and servers") == 2, err
    assert "KeyboardInterrupt" in err


def test_sigkill_still_ends_it_at_once():
    process = _started()
    process.send_signal(signal.SIGTERM)
    assert process.stdout.readline() == "cleaning up\n"
    process.kill()
    out, _ = process.communicate(timeout=30)
    assert out == "" and process.returncode == -signal.SIGKILL
