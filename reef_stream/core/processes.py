"""Processes: the background servers reef-stream runs (Kafka nodes, Redis) and the one signal
handler every long-running stage and command stops on (``stop_on_signals``)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil


def port_is_free(port: int) -> bool:
    """True if nothing listens on ``127.0.0.1:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports that were free a moment ago."""
    sockets, ports = [], []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
            ports.append(sock.getsockname()[1])
    finally:
        for sock in sockets:
            sock.close()
    return ports


def listening_port(lowest: int = 20000) -> int:
    """A free port for a server to listen on, chosen below the kernel's ephemeral range (from
    ``lowest``). A port from ``free_ports`` lies inside that range, so any process's outgoing
    connection may take it before the server binds it; one below the range only another
    server that chose it can (seen: vLLM, which binds ~30 s after it starts, once found its
    port taken by the demo's own clients). Falls back to ``free_ports`` when none is free."""
    try:
        first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768
    if first_ephemeral - lowest >= 100:
        choose = random.SystemRandom()
        for _ in range(200):
            port = choose.randrange(lowest, first_ephemeral)
            if port_is_free(port):
                return port
    return free_ports(1)[0]


def process_matches(pid: int | None, marker: str) -> bool:
    """True if ``pid`` is a live process whose command line contains ``marker``.

    Checking the command line guards against a pid recycled after a reboot.
    A command line that reads empty (a process in the middle of exec'ing, as
    the java launcher does at start) counts as a match.
    """
    if not pid:
        return False
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        cmdline = process.cmdline()
        return not cmdline or marker in " ".join(cmdline)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def reap(pid: int | None) -> None:
    """Collect the exit status of ``pid`` if this process started it (no zombie left)."""
    if not pid:
        return
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def terminate(pid: int, alive: Callable[[], bool], timeout: float) -> None:
    """Stop a server process: SIGTERM, then SIGKILL if ``alive()`` still holds after
    ``timeout`` seconds; its exit status is collected. Blocks until it is gone."""
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while alive() and time.monotonic() < deadline:
        reap(pid)
        time.sleep(0.1)
    if alive():
        os.kill(pid, signal.SIGKILL)
    reap(pid)


def log_tail(path: Path, lines: int = 25) -> str:
    """The end of a log file for an error message: from its last ERROR or FATAL line
    (where the cause is, above any stack trace) if there is one, else the last lines."""
    if not path.exists():
        return f"(no log at {path})"
    text = path.read_text(errors="replace").splitlines()
    errors = [i for i, line in enumerate(text) if " ERROR " in line or " FATAL " in line]
    start = errors[-1] if errors and errors[-1] >= len(text) - 200 else len(text) - lines
    return "\n".join(text[max(start, 0):][:lines])


def interrupt_on_sigterm() -> None:
    """Make SIGTERM raise ``KeyboardInterrupt`` in the main thread, as Ctrl-C does, so a
    long-running command stopped by a supervisor (or ``kill``, or a backgrounded shell job,
    where SIGINT is ignored) runs its ``finally`` blocks: stops the stage processes and the
    servers it started instead of leaving them behind.

    Only the first SIGTERM or SIGINT interrupts: a second one (``timeout`` and a supervisor
    both signalling, or an impatient Ctrl-C) would raise inside those ``finally`` blocks and
    leave the stages running, each in a session of its own. It is ignored, with a line on
    stderr saying the command is stopping them (SIGKILL still ends it at once)."""
    def stopping(signum: int, _frame: Any) -> None:
        print(f"signal {signum}: already stopping the stages and servers this command "
              "started; SIGKILL (kill -9) leaves them running", file=sys.stderr, flush=True)

    def interrupt(signum: int, _frame: Any) -> None:
        for again in (signal.SIGTERM, signal.SIGINT):
            signal.signal(again, stopping)
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)


#: The signals a long-running stage stops on, after its current unit of work.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stop_on_signals(stop: Callable[[], None]) -> Iterator[None]:
    """While the block runs, SIGTERM and SIGINT call ``stop`` (which asks the stage to finish
    its current work and return) instead of killing the process; the previous handlers come
    back afterwards. Must be entered on the main thread."""
    previous = {signum: signal.signal(signum, lambda *_: stop()) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
