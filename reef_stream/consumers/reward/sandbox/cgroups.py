"""A cgroup per sandbox worker, its *slot*: the memory and process limits of a call count the
call and everything it starts together (an rlimit counts each process alone).

``find`` says, once per worker, where the slots go: cgroup v1's ``memory`` and ``pids``
hierarchies under the worker's own groups, or cgroup v2 under the worker's group when that
group delegates both controllers to its children. ``SlotGroup`` is one worker's
(``reef-call-<worker pid>-slot``): made at the worker's start and joined by the worker itself,
once, so that every call's process, forked by the worker, is born in it. Moving a process into
a cgroup (a write to ``cgroup.procs``) waits for the kernel's cgroup lock, about 10-20 ms
whenever none was moved just before, and a call's process once joined a group of its own that
way; being born in the group costs nothing. Between two calls the worker kills every process
left in the group but itself (``others``), so a call finds it holding only the worker; before
each call it sets the memory limit to the worker's own charge plus the call's ``memory_mb``
(``limit_memory``), and reads the OOM kills as a difference (``oom_kills``). The worker cannot
remove its own group: ``remove_stale`` removes those of dead workers, at a worker's start and
at the pool's close. Where neither is available (not root, no writable hierarchy, v2 without
delegation) the calls run without one: memory is then limited per process only (RLIMIT_AS),
and processes per user (RLIMIT_NPROC, the worker's own uid).
"""

from __future__ import annotations

import os
import time

__all__ = ["SLOT_PROCESSES", "Groups", "SlotGroup", "find", "remove_stale"]

ROOT = "/sys/fs/cgroup"
#: Processes of a slot beyond its call's ``processes``: the worker itself and the one it forks
#: to kill a user's processes (``worker.kill_user``).
SLOT_PROCESSES = 2
#: How far the worker's own charge to its slot may move before the call's limit is set again.
SLACK_BYTES = 1 << 20


class Groups:
    """Where the calls' cgroups are made: ``version`` (``v1``, ``v2`` or ``""``), ``parents``
    (controller -> directory; v2: one directory for both), ``why`` (when ``version`` is
    ``""``)."""

    def __init__(self, version: str, parents: dict[str, str], why: str = "") -> None:
        self.version, self.parents, self.why = version, parents, why

    @property
    def state(self) -> str:
        """What the worker's ready frame says: ``v1``, ``v2`` or ``none (<why>)``."""
        return self.version or f"none ({self.why})"


def _own() -> dict[str, str]:
    """This process's cgroup paths: controller (``""`` for v2) -> path."""
    found = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                found[name] = path
    return found


def find() -> Groups:
    """Where this process's calls' cgroups can go (see the module docstring). Never raises."""
    try:
        own = _own()
        v1 = {c: os.path.join(ROOT, c) + own[c] for c in ("memory", "pids")
              if c in own and os.path.isfile(os.path.join(ROOT, c, "cgroup.procs"))}
        if len(v1) == 2:
            return _probe(Groups("v1", v1))
        if "" in own and os.path.isfile(os.path.join(ROOT, "cgroup.controllers")):
            parent = ROOT + own[""]
            with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                delegated = f.read().split()
            if {"memory", "pids"} <= set(delegated):
                return _probe(Groups("v2", {"memory": parent, "pids": parent}))
            return Groups("", {}, f"cgroup v2: {parent} does not delegate memory and pids")
        return Groups("", {}, "no cgroup v1 memory and pids hierarchies, no cgroup v2")
    except OSError as error:
        return Groups("", {}, f"{type(error).__name__}: {error}")


def remove_stale(groups: Groups, seconds: float = 0.0) -> int:
    """Remove the slots (``reef-call-<worker pid>-slot``) whose worker is dead, where they are
    empty, trying each for up to ``seconds`` (a killed worker's processes may still be
    leaving); how many it removed."""
    removed = 0
    for parent in set(groups.parents.values()):
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            pid = name.split("-")[2] if name.startswith("reef-call-") else ""
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                removed += _rmdir(os.path.join(parent, name), seconds)
    return removed


def _probe(groups: Groups) -> Groups:
    probe = SlotGroup(groups, f"reef-probe-{os.getpid()}")
    try:
        probe.create(1 << 30, 16)
    except OSError as error:
        probe.remove(0)
        return Groups("", {}, f"cgroup {groups.version}: {type(error).__name__}: {error}")
    probe.remove(0)
    return groups


class SlotGroup:
    """One worker's cgroup (v1: one in each hierarchy); see the module docstring. Not
    thread-safe; the worker's alone."""

    def __init__(self, groups: Groups, name: str) -> None:
        self.groups = groups
        self.dirs = list(dict.fromkeys(os.path.join(parent, name)
                                       for parent in groups.parents.values()))
        name = os.path.basename(self.dirs[0])
        self.memory = os.path.join(groups.parents.get("memory", ""), name)
        self._limit = self._held = -1

    def create(self, memory_bytes: int, processes: int) -> None:
        """Make the group(s) with these limits (swap included where it is counted). Raises
        ``OSError``."""
        for directory in self.dirs:
            os.mkdir(directory, 0o700)
        self.limit_memory(memory_bytes)
        pids = os.path.join(self.groups.parents["pids"], os.path.basename(self.dirs[0]))
        _write(os.path.join(pids, "pids.max"), processes)

    def limit_memory(self, memory_bytes: int) -> None:
        """Set the memory limit (v1: and memory + swap to the same, in the order the kernel
        accepts; v2: no swap). Raises ``OSError``."""
        if self.groups.version == "v1":
            limit = os.path.join(self.memory, "memory.limit_in_bytes")
            swap = os.path.join(self.memory, "memory.memsw.limit_in_bytes")
            order = [swap, limit] if 0 <= self._limit < memory_bytes else [limit, swap]
            for path in order:  # memory + swap may never be below memory alone
                _write(path, memory_bytes, missing_ok=path == swap)
        else:
            _write(os.path.join(self.memory, "memory.max"), memory_bytes)
            _write(os.path.join(self.memory, "memory.swap.max"), 0, missing_ok=True)
        self._limit = memory_bytes

    def fit(self, call_bytes: int) -> None:
        """Before a call (the group holding only the worker): set the limit to what the group
        holds now plus ``call_bytes``, so the call gets ``call_bytes`` whatever the worker's
        own charge; the limit is written again only when that charge moved by more than
        ``SLACK_BYTES``. Raises ``OSError``."""
        held = self.charged()
        if self._held < 0 or abs(held - self._held) > SLACK_BYTES:
            self.limit_memory(held + call_bytes)
            self._held = held

    def charged(self) -> int:
        """Bytes charged to the group now (v1 ``memory.usage_in_bytes``, v2
        ``memory.current``). Raises ``OSError``."""
        name = "memory.usage_in_bytes" if self.groups.version == "v1" else "memory.current"
        with open(os.path.join(self.memory, name)) as f:
            return int(f.read())

    def join(self) -> None:
        """Move the calling process into the group(s) (the worker, once, as root)."""
        for directory in self.dirs:
            _write(os.path.join(directory, "cgroup.procs"), os.getpid())

    def others(self) -> list[int]:
        """The processes in the group other than the caller. Raises ``OSError`` when the
        group cannot be read."""
        found = set()
        for directory in self.dirs:
            with open(os.path.join(directory, "cgroup.procs")) as f:
                found.update(int(line) for line in f if line.strip())
        found.discard(os.getpid())
        return sorted(found)

    def oom_kills(self) -> int:
        """How many of the group's processes the OOM killer ended so far (0 when unknown)."""
        name = "memory.oom_control" if self.groups.version == "v1" else "memory.events"
        try:
            with open(os.path.join(self.memory, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self, seconds: float = 1.0) -> bool:
        """Remove the group(s) once empty, trying for up to ``seconds``; whether it did."""
        removed = [_rmdir(directory, seconds) for directory in self.dirs]  # each, even past one
        return all(removed)


def _rmdir(directory: str, seconds: float) -> bool:
    """Remove the empty cgroup ``directory`` (gone already counts), trying for up to
    ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            os.rmdir(directory)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
        time.sleep(0.005)


def _write(path: str, value: int, missing_ok: bool = False) -> None:
    try:
        with open(path, "w") as f:
            f.write(str(value))
    except FileNotFoundError:
        if not missing_ok:
            raise
