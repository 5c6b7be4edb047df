"""The emulated-hosts harness (``tests/cluster/hosts.py``) itself: hosts reach one another over
the bridge, a partition cuts a host off both ways and a heal restores it, a one-way partition
drops one direction only, ``kill_host`` leaves no process, and everything the harness made is
gone afterwards, also when the block inside it raised or its owner was SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.cluster.hosts import Hosts, links, namespace_pids, namespaces, sweep
from tests.helpers import wait_until


@pytest.fixture(autouse=True)
def _as_root():
    """Network namespaces need root, as CI has it: without it these tests fail, never skip."""
    assert os.geteuid() == 0, "the emulated-host tests make network namespaces: run them as root"


def _state(pid: int | None = None) -> tuple[list[str], list[str]]:
    """``ip netns list`` and ``ip link`` names of the harnesses of ``pid`` (default: this
    process), sorted. Only theirs: pytest-xdist runs other tests, these among them, on another
    worker at the same time (tests/faults/test_cluster.py, in the serial heavy pass, compares
    the whole lists)."""
    pid = pid or os.getpid()
    return (sorted(n for n in namespaces() if n.startswith(f"reefh-{pid}-")),
            sorted(n for n in links() if n.startswith(f"rh{pid}-")))


#: The port every host's listener (``_listen``) accepts on.
PORT = 7001


def _listen(hosts: Hosts, host: str) -> None:
    """Accept connections on ``PORT`` in ``host`` for ever (until the host is torn down)."""
    code = ("import socket; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, "
            f"socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', {PORT})); s.listen()\n"
            "while True: s.accept()[0].close()")
    hosts.spawn(host, [sys.executable, "-c", code])


def _reaches(hosts: Hosts, source: str | None, target: str) -> bool:
    """A TCP connection from ``source`` (None: the root namespace) to ``target``'s listener."""
    code = (f"import socket; socket.create_connection(({hosts.address(target)!r}, {PORT}), "
            "timeout=1).close()")
    wrap = hosts.wrap(source) if source else []
    return subprocess.run([*wrap, sys.executable, "-c", code],
                          capture_output=True).returncode == 0


def _listening(hosts: Hosts, names) -> None:
    for name in names:
        _listen(hosts, name)
    deadline = time.monotonic() + 20
    while not all(_reaches(hosts, None, name) for name in names):
        assert time.monotonic() < deadline, "the listeners did not start"
        time.sleep(0.2)


def test_hosts_reach_each_other_and_partitions_cut_them_off():
    assert _state() == ([], [])
    with Hosts(["a", "b", "c"]) as hosts:
        assert len(_state()[0]) == 4 and len(_state()[1]) == 1   # 3 hosts, the bridge's
        assert len({hosts.address(h) for h in ("a", "b", "c")}) == 3
        _listening(hosts, ["a", "b", "c"])    # reached from the root namespace too
        assert _reaches(hosts, "a", "b") and _reaches(hosts, "c", "a")
        hosts.partition("b")
        assert not _reaches(hosts, "a", "b") and not _reaches(hosts, "b", "c")
        assert _reaches(hosts, "a", "c")
        hosts.heal("b")
        assert _reaches(hosts, "a", "b") and _reaches(hosts, "b", "c")

        # One way: b's packets to a are dropped (so neither side's connection completes),
        # b to c is untouched; then a's packets from b are dropped on a's side.
        hosts.partition_one_way("b", ["a"], direction="out")
        assert not _reaches(hosts, "b", "a") and not _reaches(hosts, "a", "b")
        assert _reaches(hosts, "b", "c")
        hosts.heal("b")
        assert _reaches(hosts, "b", "a")
        hosts.partition_one_way("a", ["b"], direction="in")
        assert not _reaches(hosts, "b", "a") and _reaches(hosts, "c", "a")
        hosts.heal("a")
        assert _reaches(hosts, "b", "a")

        sleeper = hosts.spawn("c", ["sleep", "600"])
        hosts.pause(sleeper.pid)
        hosts.resume(sleeper.pid)
        assert sleeper.pid in hosts.pids("c")
        assert hosts.kill_host("c") == 2   # the sleeper and the listener
        assert hosts.pids("c") == [] and sleeper.poll() == -signal.SIGKILL
        workdir = hosts.workdir
    assert _state() == ([], [])
    assert not workdir.exists()


def test_everything_is_removed_when_the_block_raises():
    with pytest.raises(RuntimeError, match="inside"), Hosts(["x", "y"]) as hosts:
        sleeper = hosts.spawn("x", ["sleep", "600"])
        raise RuntimeError("a failure inside the block")
    assert sleeper.poll() is not None
    assert _state() == ([], [])


def test_sweep_removes_what_a_killed_owner_left():
    # An owner that makes hosts, starts a process in one and is SIGKILLed: no cleanup of its
    # own runs; the next harness (or sweep) removes what it left.
    code = ("from tests.cluster.hosts import Hosts; import time; h = Hosts(['p', 'q']); "
            "h.start(); h.spawn('p', ['sleep', '600']); print('up', flush=True); "
            "time.sleep(600)")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert owner.stdout.readline().strip() == "up"
        left = _state(owner.pid)
        assert len(left[0]) == 3 and len(left[1]) == 1
        sleepers = [p for ns in left[0] for p in namespace_pids(ns)]
        assert len(sleepers) == 1
    finally:
        owner.kill()
        owner.wait()
    sweep()   # or another worker's harness did, starting: either way, all of it is gone
    assert _state(owner.pid) == ([], [])
    wait_until(lambda: not any(os.path.exists(f"/proc/{p}") for p in sleepers), 10,
               "the killed owner's process in its host is gone")
