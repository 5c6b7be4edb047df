"""``SandboxPool``: pre-started sandbox worker processes that run reward calls.

    pool = SandboxPool("my_project.recipes:recipe", size=8, limits=Limits(cpu_s=5))
    pool.start()                                   # raises ConfigurationError if none starts
    reward = pool.call(generation, timeout=10.0)   # Reward, or raises (below)
    pool.close()

Each worker is ``python -m reef_stream.consumers.reward.sandbox.worker`` (``reef_stream.consumers.reward.sandbox.worker``):
a fresh Python started with ``subprocess`` in a session of its own, which imports the reward
function once (only it, where the parent can name it: ``reef_stream.consumers.reward.sandbox.reference``, so a
worker need not import the recipe and torch) and forks one process per call under the
``Limits``. A call takes an idle
worker (a *warm* start; a *cold* start when it had to wait for one to be started), sends the
generation's Avro record and waits for the answer until ``timeout`` (wall clock). Past it
the call's process group is killed (SIGKILL: the forked call and whatever it started) and the
calling slot is free at once; on a thread of the pool's, the worker, which never ran the
reward's code itself, answers for the killed call and goes back to the idle ones
(``recycled``), or, silent for ``RECYCLE_S``, is killed too (its own process group) and
replaced (``restarts``). ``Ticket.kill`` kills a call from another thread (the reward
worker's watchdog). A worker that dies is replaced the same way.

``call`` returns a ``Reward`` or raises ``RaisedInSandbox`` (the function raised) or
``SandboxFailure`` (``reef_stream.consumers.reward.sandbox.categories``). It never returns a reward for a
failure.

A worker starts with ``-P`` in ``/`` (no module from the working directory runs in it) and
an environment of its own (``worker_environment``: ``ALLOWED_ENV`` only, no credentials).

Network: each worker tries a network namespace of its own at start; when that is refused
the pool logs a warning at start-up, ``network`` says why and ``stats()`` reports
``network_isolated`` 0. When the pool runs as root, each worker's calls run as a user of
their own, a uid of ``uid_base .. uid_base + UID_COUNT - 1`` the worker holds for its life (a
lock file, ``worker.claim_uid``: never another worker's, in this pool or another), so the
process limit is the call's and the call cannot write to files it does not own; at each
call's end every other process of the worker's cgroup (its slot, ``cgroups``; without one,
every process of that uid), and at ``close`` every process of that uid, is killed.

Thread-safe: any number of threads may call at once (one worker each).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from typing import Any

from reef_stream.api.rewards import Reward
from reef_stream.consumers.reward.sandbox.categories import (
    SANDBOX_UNAVAILABLE, TIMEOUT, Limits, RaisedInSandbox, SandboxFailure,
)
from reef_stream.consumers.reward.sandbox.cgroups import find as find_cgroups
from reef_stream.consumers.reward.sandbox.cgroups import remove_stale
from reef_stream.consumers.reward.sandbox.latency import LatencyWindow
from reef_stream.consumers.reward.sandbox.reference import worker_target
from reef_stream.consumers.reward.sandbox.worker import kill_user, write_frame
from reef_stream.core.errors import ConfigurationError
from reef_stream.core.serde import encode

__all__ = ["ALLOWED_ENV", "AUTO", "DEFAULT_UID_BASE", "UID_COUNT", "SandboxPool", "Ticket",
           "import_path", "worker_environment"]

log = logging.getLogger(__name__)

AUTO = "auto"
#: The first user id of the calls of a pool run as root (one per worker).
DEFAULT_UID_BASE = 61000
#: How many user ids from ``uid_base`` the workers of every pool on this machine share.
UID_COUNT = 4000
#: The variables a worker (and so a call) takes from this process's environment; nothing
#: else reaches it (``worker_environment``).
ALLOWED_ENV = ("LANG", "LC_ALL", "LC_CTYPE", "TZ")
#: A worker's ``PATH``: system directories only.
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Seconds a worker has to answer for a call killed at its deadline before it is replaced.
RECYCLE_S = 10.0
#: Seconds between two tries to start a worker after one failed to.
RESTART_DELAY_S = 1.0


class _Deadline(Exception):
    pass


class _Worker:
    """One worker process and the frames read from it."""

    def __init__(self, popen: subprocess.Popen, index: int, spawned: float) -> None:
        self.popen, self.index, self.spawned = popen, index, spawned
        self.pid = popen.pid
        self.out = popen.stdout.fileno()
        self.into = popen.stdin.fileno()
        self.buffer = b""
        self.call_dir = ""  # the running (or last) call's directory
        self.uid: int | None = None  # the user its calls run as
        self.network = ""
        self.dead = False

    def read_frame(self, deadline: float | None) -> dict:
        while True:
            if len(self.buffer) >= 4:
                size = struct.unpack(">I", self.buffer[:4])[0]
                if len(self.buffer) >= 4 + size:
                    frame, self.buffer = self.buffer[4:4 + size], self.buffer[4 + size:]
                    return json.loads(frame)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise _Deadline
            ready, _, _ = select.select([self.out], [], [], left)
            if not ready:
                raise _Deadline
            chunk = os.read(self.out, 65536)
            if not chunk:
                raise EOFError("the sandbox worker closed its pipe")
            self.buffer += chunk


class Ticket:
    """A running call as its caller's watchdog sees it: ``kill(reason)`` ends it (the call
    then raises ``SandboxFailure`` ``timeout`` with ``reason``). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._worker: _Worker | None = None
        self._call_pid = 0
        self.killed: str | None = None
        #: Calls made with this ticket so far: ``kill(call=...)`` kills only that one.
        self.calls = 0

    def _attach(self, worker: _Worker) -> None:
        with self._lock:
            self._worker, self._call_pid, self.killed = worker, 0, None
            self.calls += 1

    def _started(self, pid: int) -> None:
        with self._lock:
            self._call_pid = pid
            killed = self.killed is not None
        if killed and pid:
            _killpg(pid)

    def _detach(self) -> None:
        with self._lock:
            self._worker = None

    def kill(self, reason: str, call: int | None = None) -> bool:
        """Kill the running call's process group (SIGKILL); False if none runs (or, with
        ``call``, if the running one is not the ticket's ``call``-th). Its worker answers for
        it at once, and the call raises ``SandboxFailure`` ``timeout``."""
        with self._lock:
            if self._worker is None or self.killed is not None \
                    or call is not None and call != self.calls:
                return False
            self.killed = reason
            pid = self._call_pid
        if pid:
            _killpg(pid)
        return True


class SandboxPool:
    """See the module docstring. ``target``: ``module:attribute`` naming a ``Recipe`` (its
    reward function is used, after ``overrides``) or a reward function, importable in this
    process (a worker gets the directories that hold it: ``import_path``). ``uid_base``: the
    first of the ``UID_COUNT`` user ids the calls may run as when run as root (``AUTO``:
    ``DEFAULT_UID_BASE`` as root, none otherwise; None: never change user).
    """

    def __init__(self, target: str, *, overrides: tuple[str, ...] = (), size: int = 4,
                 limits: Limits = Limits(), uid_base: int | str | None = AUTO,
                 isolate_network: bool = True, start_timeout: float = 120.0,
                 python: str | None = None) -> None:
        problems = limits.problems()
        if size < 1:
            problems.append(f"sandbox pool size must be at least 1, not {size}")
        if problems:
            raise ConfigurationError(problems)
        self.target, self.overrides, self.size, self.limits = target, tuple(overrides), size, limits
        if uid_base == AUTO:
            uid_base = DEFAULT_UID_BASE if os.geteuid() == 0 else None
        self.uid_base = uid_base
        self.isolate_network = isolate_network
        self.start_timeout = start_timeout
        self.python = python or sys.executable
        self._lock = threading.Condition()
        self._idle: deque[_Worker] = deque()
        self._live: dict[int, _Worker] = {}  # index -> worker, started or starting
        self._closed = False
        self._tmp = ""  # the workers' calls' directories are made under it
        self._import_path: list[str] = []  # the workers' PYTHONPATH (``import_path``)
        #: Why the network is not isolated ("" until a worker said; "isolated" when it is).
        self.network = ""
        #: ``v1``/``v2`` when each call runs in its worker's cgroup (its slot: memory and
        #: processes limited per call); else ``none (why)``.
        self.cgroup = ""
        #: ``filtered`` when each call runs under the seccomp filter; else why not.
        self.seccomp = ""
        #: ``private`` when each call gets its own tmp mounts; else why not (a worker says).
        self.filesystem = ""
        #: The user ids the calls of this pool's workers have run as.
        self.uids: set[int] = set()
        #: The Python installation's directory, when the calls' users cannot read it.
        self.unreadable = ""
        self.last_start_error = ""
        #: What the workers import (``reef_stream.consumers.reward.sandbox.reference``), set by ``start``.
        self.worker_target: dict[str, Any] = {"target": target, "overrides": list(overrides)}
        #: Whether the last worker started had torch imported (its ready frame says).
        self.worker_torch = False
        self.warm_starts = self.cold_starts = self.restarts = self.started = self.recycled = 0
        self.failures: Counter[str] = Counter()
        self.start_latency = LatencyWindow(256)
        self.call_latency = LatencyWindow(1024)

    # ----------------------------------------------------------------- public

    def start(self) -> None:
        """Start ``size`` workers and wait until they are ready (up to ``start_timeout``).
        Raises ``ConfigurationError`` when none could start (naming why)."""
        self.worker_target = worker_target(self.target, self.overrides)
        self._import_path = import_path(self.target, self.worker_target["target"])
        self._tmp = tempfile.mkdtemp(prefix="reef-sandbox-")
        if self.uid_base is not None:
            os.chmod(self._tmp, 0o711)  # the calls' users reach their own directories
        threads = [threading.Thread(target=self._start_one, args=(index, False),
                                    name="reef-sandbox-start", daemon=True)
                   for index in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(self.start_timeout)
        with self._lock:
            ready = len(self._idle)
        if not ready:
            self.close()
            raise ConfigurationError(f"no sandbox worker started for {self.target}: "
                                     f"{self.last_start_error or 'timed out'}")
        if self.unreadable:
            log.warning("sandbox: the calls' users cannot read the Python installation (%s): "
                        "a reward can import only what its module (or the worker) imported "
                        "before the call", self.unreadable)
        if not self.cgroup.startswith("v"):
            log.warning("sandbox: memory and processes are limited per process, not per call: "
                        "no cgroup for the calls (%s)", self.cgroup)
        if self.seccomp != "filtered":
            log.warning("sandbox: reward calls run without a seccomp filter (%s)", self.seccomp)
        if self.filesystem != "private":
            log.warning("sandbox: reward calls share /tmp, /var/tmp, /dev/shm and /run with "
                        "this machine (%s)", self.filesystem)
        if self.network != "isolated":
            log.warning("sandbox: the network of reward calls is NOT isolated (%s)", self.network)
        else:
            log.info("sandbox: %d workers ready for %s (they import %s%s); network isolated; "
                     "calls run as %s", ready, self.target, self.worker_target["target"],
                     ", torch too" if self.worker_torch else "",
                     "uid %d+" % self.uid_base if self.uid_base is not None else "this user")

    def call(self, generation: Any, timeout: float, ticket: Ticket | None = None) -> Reward:
        """Run the reward function on ``generation`` in a worker; see the module docstring."""
        value, headers = encode(generation)
        request = {"value": base64.b64encode(value).decode(),
                   "headers": [[k, base64.b64encode(v or b"").decode()] for k, v in headers]}
        began = time.monotonic()
        deadline = began + timeout
        worker = self._take(deadline)
        if worker is None:
            raise self._failed(SandboxFailure(
                SANDBOX_UNAVAILABLE, f"no sandbox worker was free within {timeout:g} s"
                + (f" (the last start failed: {self.last_start_error})"
                   if self.last_start_error else "")))
        ticket = ticket or Ticket()
        ticket._attach(worker)
        pid_read = False
        try:
            write_frame(worker.into, request)
            started = worker.read_frame(deadline)
            pid_read = True
            worker.call_dir = str(started.get("dir", ""))
            ticket._started(int(started.get("pid", 0)))
            answer = worker.read_frame(deadline)
        except _Deadline:
            ticket._detach()
            if ticket._call_pid:
                _killpg(ticket._call_pid)
            self._recycle_later(worker, pid_read)
            raise self._failed(SandboxFailure(
                TIMEOUT, f"no result within {timeout:g} s (wall clock): the call's process "
                         "group was killed", wall=True)) from None
        except (OSError, EOFError, ValueError) as error:
            ticket._detach()
            if self._closed:  # close() killed it: neither a restart nor a failure of its own
                if ticket._call_pid:
                    _killpg(ticket._call_pid)
                raise SandboxFailure(SANDBOX_UNAVAILABLE, "the sandbox pool was closed during "
                                                          "the call") from None
            self._kill(worker, ticket._call_pid)
            raise self._failed(SandboxFailure(
                SANDBOX_UNAVAILABLE, f"the sandbox worker died during the call ({error}); "
                                     "it was replaced")) from None
        ticket._detach()
        self._give_back(worker)
        if ticket.killed is not None:  # its answer is the SIGKILL's: a timeout
            raise self._failed(SandboxFailure(TIMEOUT, ticket.killed, wall=True))
        self.call_latency.add(time.monotonic() - began)
        if "ok" in answer:
            ok = answer["ok"]
            return Reward(reward=ok["reward"], components=ok.get("components") or {})
        if "raised" in answer:
            raised = answer["raised"]
            raise RaisedInSandbox(str(raised.get("type")), str(raised.get("message")),
                                  transient=raised.get("transient") is True)
        if self._closed:  # close() killed it (every process of its uid): not its failure
            raise SandboxFailure(SANDBOX_UNAVAILABLE, "the sandbox pool was closed during the "
                                                      "call")
        failure = answer.get("failure") or {}
        raise self._failed(SandboxFailure(failure.get("category", "output_invalid"),
                                          str(failure.get("detail"))))

    def stats(self) -> dict[str, float]:
        """Numbers for the metrics (see ``reef_stream.core.metric_names``' ``SANDBOX_*``)."""
        with self._lock:
            idle, live = len(self._idle), len(self._live)
        stats = {"size": self.size, "live": live, "idle": idle, "warm_starts": self.warm_starts,
                 "cold_starts": self.cold_starts, "restarts": self.restarts,
                 "recycled": self.recycled,
                 "network_isolated": 1.0 if self.network == "isolated" else 0.0}
        for name, window in (("start", self.start_latency), ("call", self.call_latency)):
            for q in (50, 99):
                value = window.percentile(q)
                if value is not None:
                    stats[f"{name}_p{q}"] = value
        return stats

    def close(self) -> None:
        """Kill every worker (and its running call)."""
        with self._lock:
            self._closed = True
            workers = list(self._live.values())
            self._live.clear()
            self._idle.clear()
            self._lock.notify_all()
        for worker in workers:
            if worker.uid is not None:  # while its worker still holds the uid
                kill_user(worker.uid, reap=False)
            _killpg(worker.pid)
            _reap(worker)
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
        if workers and self.cgroup.startswith("v"):  # a call killed with its worker left its own
            remove_stale(find_cgroups(), 1.0)

    # ----------------------------------------------------------------- workers

    def _failed(self, failure: SandboxFailure) -> SandboxFailure:
        with self._lock:
            self.failures[failure.category] += 1
        return failure

    def _take(self, deadline: float) -> _Worker | None:
        with self._lock:
            cold = False
            while not self._idle and not self._closed:
                cold = True
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._lock.wait(left)
            if self._closed:
                return None
            if cold:
                self.cold_starts += 1
            else:
                self.warm_starts += 1
            return self._idle.popleft()

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            if self._closed or worker.dead:
                return
            self._idle.append(worker)
            self._lock.notify()

    def _recycle_later(self, worker: _Worker, pid_read: bool) -> None:
        """After a call killed at its deadline, on a thread of the pool's: read what its
        worker still says about it (the pid, when it was not read yet: that group is killed
        too; then the answer) within ``RECYCLE_S`` and give the worker back to the idle ones
        (``recycled``), or else kill it and start another (``restarts``)."""
        def recycle() -> None:
            deadline = time.monotonic() + RECYCLE_S
            pid = 0
            try:
                if not pid_read:
                    pid = int(worker.read_frame(deadline).get("pid", 0))
                    if pid:
                        _killpg(pid)
                worker.read_frame(deadline)
            except (_Deadline, OSError, EOFError, ValueError):
                self._kill(worker, pid)
                return
            with self._lock:
                self.recycled += 1
            self._give_back(worker)

        threading.Thread(target=recycle, name="reef-sandbox-recycle", daemon=True).start()

    def _kill(self, worker: _Worker, call_pid: int) -> None:
        """Kill a call's process group and its worker's; a thread replaces the worker."""
        if call_pid:
            _killpg(call_pid)
        _killpg(worker.pid)
        with self._lock:
            if worker.dead:
                return
            worker.dead = True
            closed = self._closed
            self.restarts += 0 if closed else 1
            if self._live.get(worker.index) is worker:
                del self._live[worker.index]
        if call_pid:  # the call's processes run as another user: not ours to reap
            _killpg(call_pid)
        if not closed:
            threading.Thread(target=self._start_one, args=(worker.index, True, worker),
                             name="reef-sandbox-restart", daemon=True).start()

    def _start_one(self, index: int, again: bool, old: _Worker | None = None) -> None:
        """Start the worker of slot ``index`` (after reaping ``old``); try again every
        ``RESTART_DELAY_S`` while the pool is open and it fails."""
        if old is not None:
            _reap(old)
            if old.call_dir:  # its call was killed before it could remove its directory
                shutil.rmtree(old.call_dir, ignore_errors=True)
        while True:
            with self._lock:
                if self._closed:
                    return
            worker, error = self._spawn(index)
            if worker is not None:
                with self._lock:
                    if self._closed:
                        _killpg(worker.pid)
                        _reap(worker)
                        return
                    self._live[index] = worker
                    self._idle.append(worker)
                    self.started += 1
                    self._lock.notify()
                return
            self.last_start_error = error
            log.error("sandbox worker %d did not start: %s", index, error)
            if not again:
                return
            time.sleep(RESTART_DELAY_S)

    def _spawn(self, index: int) -> tuple[_Worker | None, str]:
        config = {**self.worker_target,
                  "limits": vars(self.limits), "isolate_network": self.isolate_network,
                  "uid_range": None if self.uid_base is None else [self.uid_base, UID_COUNT],
                  "tmp": self._tmp or None}
        spawned = time.monotonic()
        try:
            popen = subprocess.Popen(
                [self.python, "-P", "-s", "-m", "reef_stream.consumers.reward.sandbox.worker",
                 json.dumps(config)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
                close_fds=True, cwd="/", env=worker_environment(self._import_path))
        except OSError as error:
            return None, f"{type(error).__name__}: {error}"
        worker = _Worker(popen, index, spawned)
        try:
            ready = worker.read_frame(spawned + self.start_timeout)
        except (_Deadline, EOFError, OSError, ValueError) as error:
            _killpg(worker.pid)
            _reap(worker)
            return None, (f"no ready frame within {self.start_timeout:g} s"
                          if isinstance(error, _Deadline)
                          else f"it exited before it was ready (status {popen.poll()})")
        if not ready.get("ready"):
            _killpg(worker.pid)
            _reap(worker)
            return None, str(ready.get("error"))
        self.start_latency.add(time.monotonic() - spawned)
        worker.network = self.network = str(ready.get("network"))
        self.filesystem = str(ready.get("filesystem"))
        self.cgroup = str(ready.get("cgroup"))
        self.seccomp = str(ready.get("seccomp"))
        if ready.get("uid") is not None:
            worker.uid = int(ready["uid"])
            with self._lock:
                self.uids.add(worker.uid)
        self.worker_torch = bool(ready.get("torch"))
        self.unreadable = str(ready.get("unreadable") or "")
        return worker, ""


def worker_environment(path: list[str]) -> dict[str, str]:
    """A worker's whole environment: ``ALLOWED_ENV`` from this process's (never a credential:
    no ``REEF_*``), a fixed ``PATH`` and ``PYTHONPATH`` = ``path``."""
    env = {name: os.environ[name] for name in ALLOWED_ENV if name in os.environ}
    env["PATH"] = SAFE_PATH
    env["PYTHONPATH"] = os.pathsep.join(path)
    return env


def import_path(*targets: str) -> list[str]:
    """Absolute directories a worker needs on ``sys.path`` (it starts with ``-P`` in ``/``,
    so never the caller's working directory): the one holding ``reef_stream``, then those
    holding the top-level packages of ``targets`` (``module:attribute``) as this process
    imported them, then this process's ``PYTHONPATH`` entries that are absolute."""
    import reef_stream

    found = [os.path.dirname(os.path.dirname(os.path.abspath(reef_stream.__file__)))]
    for target in targets:
        module = sys.modules.get(target.partition(":")[0].split(".")[0])
        for location in [getattr(module, "__file__", None),
                         *list(getattr(module, "__path__", None) or [])]:
            if location:
                location = os.path.abspath(location)
                if os.path.basename(location) == "__init__.py":
                    location = os.path.dirname(location)
                found.append(os.path.dirname(location))
    found += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if os.path.isabs(p)]
    return list(dict.fromkeys(found))


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _reap(worker: _Worker) -> None:
    try:
        worker.popen.wait(10)
    except subprocess.TimeoutExpired:
        log.warning("sandbox worker %d (pid %d) did not end after SIGKILL", worker.index,
                    worker.pid)
    for pipe in (worker.popen.stdin, worker.popen.stdout):
        try:
            pipe.close()
        except OSError:
            pass
