"""A cgroup per sandboxed call: its memory and process limits count the call and everything it
starts together (an rlimit counts each process alone).

``find`` says, once per worker, where the calls' cgroups go: cgroup v1's ``memory`` and
``pids`` hierarchies under the worker's own groups, or cgroup v2 under the worker's group when
that group delegates both controllers to its children. ``CallGroup`` is one call's: made
before the fork, joined by the call's process (as root, before it drops its user), read for
OOM kills and removed once its processes are dead (``remove_stale`` removes those of a worker
killed during a call: at a worker's start and at the pool's close). Where neither is available (not root, no
writable hierarchy, v2 without delegation) the calls run without one: memory is then limited
per process only (RLIMIT_AS), and processes per user (RLIMIT_NPROC, the worker's own uid).
"""

from __future__ import annotations

import os
import time

__all__ = ["CallGroup", "Groups", "find", "remove_stale"]

ROOT = "/sys/fs/cgroup"


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


def remove_stale(groups: Groups) -> int:
    """Remove the calls' cgroups (``reef-call-<worker pid>-<n>``) whose worker is dead, left by
    a worker killed during a call, where they are empty; how many it removed."""
    removed = 0
    for parent in set(groups.parents.values()):
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            pid = name.split("-")[2] if name.startswith("reef-call-") else ""
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                try:
                    os.rmdir(os.path.join(parent, name))
                    removed += 1
                except OSError:
                    pass
    return removed


def _probe(groups: Groups) -> Groups:
    probe = CallGroup(groups, f"reef-probe-{os.getpid()}")
    try:
        probe.create(1 << 30, 16)
    except OSError as error:
        probe.remove(0)
        return Groups("", {}, f"cgroup {groups.version}: {type(error).__name__}: {error}")
    probe.remove(0)
    return groups


class CallGroup:
    """One call's cgroup (v1: one in each hierarchy). Not thread-safe; the worker's alone."""

    def __init__(self, groups: Groups, name: str) -> None:
        self.groups = groups
        self.dirs = list(dict.fromkeys(os.path.join(parent, name)
                                       for parent in groups.parents.values()))

    def create(self, memory_bytes: int, processes: int) -> None:
        """Make the group(s) with these limits (swap included where it is counted). Raises
        ``OSError``."""
        for directory in self.dirs:
            os.mkdir(directory, 0o700)
        memory, pids = self.groups.parents["memory"], self.groups.parents["pids"]
        name = os.path.basename(self.dirs[0])
        if self.groups.version == "v1":
            _write(os.path.join(memory, name, "memory.limit_in_bytes"), memory_bytes)
            swap = os.path.join(memory, name, "memory.memsw.limit_in_bytes")
            if os.path.exists(swap):
                _write(swap, memory_bytes)
        else:
            _write(os.path.join(memory, name, "memory.max"), memory_bytes)
            _write(os.path.join(memory, name, "memory.swap.max"), 0, missing_ok=True)
        _write(os.path.join(pids, name, "pids.max"), processes)

    def join(self) -> None:
        """Move the calling process into the group(s) (the call's process, as root)."""
        for directory in self.dirs:
            _write(os.path.join(directory, "cgroup.procs"), os.getpid())

    def oom_kills(self) -> int:
        """How many of the group's processes the OOM killer ended (0 when unknown)."""
        memory = os.path.join(self.groups.parents["memory"], os.path.basename(self.dirs[0]))
        name = "memory.oom_control" if self.groups.version == "v1" else "memory.events"
        try:
            with open(os.path.join(memory, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self, seconds: float = 1.0) -> bool:
        """Remove the group(s) once empty, trying for up to ``seconds``; whether it did."""
        deadline = time.monotonic() + seconds
        left = list(self.dirs)
        while left:
            for directory in list(left):
                try:
                    os.rmdir(directory)
                    left.remove(directory)
                except FileNotFoundError:
                    left.remove(directory)
                except OSError:
                    pass
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        return not left


def _write(path: str, value: int, missing_ok: bool = False) -> None:
    try:
        with open(path, "w") as f:
            f.write(str(value))
    except FileNotFoundError:
        if not missing_ok:
            raise
