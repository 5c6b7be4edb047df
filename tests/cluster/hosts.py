"""Emulated hosts on one machine: network namespaces joined by a bridge, for tests and benches.

    with Hosts(["kafka", "redis", "trainer"]) as hosts:
        address = hosts.address("kafka")             # 10.213.X.1
        process = hosts.spawn("trainer", argv, log)  # runs under `ip netns exec`
        hosts.partition("trainer")                   # its link down, both ways
        hosts.heal("trainer")

What it makes (all names carry this process's pid, so a later run can tell what is stale):

- a namespace per host, ``reefh-<pid>-<n>-<host>``, with ``lo`` up and an ``eth0`` holding
  ``10.213.X.<i>/24`` (X picked so that no address or route of this machine is in it);
- a namespace ``reefh-<pid>-<n>-net`` holding the bridge ``br0``; each host's ``eth0`` is a
  veth whose peer is a port of that bridge;
- one veth from the root namespace into the bridge (``10.213.X.254``), so that the process
  that made the hosts (a test, a bench, the admin client that waits for a broker) reaches
  every host's address. Partitions never touch it.

Traffic goes only to those addresses. ``close`` (the context manager's exit, an ``atexit``
hook, and SIGTERM/SIGHUP turned into ``SystemExit``) SIGKILLs every process in the hosts'
namespaces (``ip netns pids``: what ``spawn`` started and anything started with ``wrap``),
deletes the namespaces and the root veth, and removes the temporary directory. ``sweep``
removes what a run killed with SIGKILL left behind (namespaces of pids that are gone).

Root is needed (``ip netns add``); where it is refused ``Hosts`` raises ``HostsUnavailable``
with the command and its error. One-way partitions need ``nft`` inside a namespace
(``apt-get install nftables``); without it ``partition_one_way`` raises the same.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

#: The /16 the hosts' /24 is picked from: private, and checked against this machine's own.
SUPERNET = "10.213"
#: Namespace names start with this, then the owner's pid.
PREFIX = "reefh"
#: The root namespace's address on every subnet (the controlling process).
CONTROL_HOST = 254
#: The port a broker listens on inside its host (its controller on the next one).
KAFKA_PORT = 9092


class HostsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2, no nft): says which
    command failed and why. In CI a failure, not a skip."""


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", *(("netns", "exec", ns, "ip") if ns else ()), *args]
    result = subprocess.run(argv, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise HostsUnavailable(f"`{' '.join(argv)}` failed ({result.returncode}): "
                               f"{result.stderr.strip()}")
    return result


def namespaces() -> list[str]:
    """This machine's network namespaces (``ip netns list``), names only."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def links() -> list[str]:
    """The root namespace's links (``ip -o link``), names only."""
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()]


def namespace_pids(ns: str) -> list[int]:
    """The processes whose network namespace is ``ns`` (``ip netns pids``)."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _kill_all(ns: str, timeout: float = 10.0) -> None:
    """SIGKILL every process in ``ns`` until none is left (new ones may be forked meanwhile)."""
    deadline = time.monotonic() + timeout
    while (pids := namespace_pids(ns)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # A killed process leaves the list once it is a zombie. Not reaped here: a child of
        # ours belongs to its Popen, which would read a status reaped behind its back as 0.
        time.sleep(0.05)


def _subnet_in_use(third: int) -> bool:
    net = ipaddress.ip_network(f"{SUPERNET}.{third}.0/24")
    out = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    out += subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True,
                          text=True).stdout
    for word in out.split():
        try:
            if ipaddress.ip_network(word, strict=False).overlaps(net):
                return True
        except ValueError:
            continue
    return False


def _owner_alive(name: str) -> bool:
    parts = name.split("-")
    try:
        os.kill(int(parts[1]), 0)
        return True
    except (IndexError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True


def sweep() -> list[str]:
    """Remove the namespaces (and their processes) of harnesses whose process is gone, and the
    root veths that led to them; returns the namespaces removed."""
    removed = []
    for ns in namespaces():
        if ns.startswith(PREFIX + "-") and not _owner_alive(ns):
            _kill_all(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            removed.append(ns)
    for link in links():
        match = re.fullmatch(r"rh(\d+)-\d+", link)
        if match and not _owner_alive(f"x-{match.group(1)}"):
            subprocess.run(["ip", "link", "del", link], capture_output=True)
    return removed


_live: list[Hosts] = []
_live_lock = threading.Lock()
_hooks_installed = False


def _close_all() -> None:
    for hosts in _live[:]:
        hosts.close()


def _on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _install_hooks() -> None:
    """atexit, and SIGTERM/SIGHUP as SystemExit (so ``with`` blocks unwind), once; a handler
    someone else installed is left alone."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_close_all)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _on_signal)


class Hosts:
    """N emulated hosts; see the module docstring. Use as a context manager (or call
    ``close``, which is idempotent). Methods block until done; not thread-safe but for
    ``close``."""

    _counter = 0

    def __init__(self, names: Sequence[str], workdir: Path | None = None) -> None:
        if len(set(names)) != len(names) or not names or len(names) > 200:
            raise ValueError(f"host names must be 1 to 200 distinct names, not {names!r}")
        Hosts._counter += 1
        self.names = list(names)
        self.tag = f"{PREFIX}-{os.getpid()}-{Hosts._counter}"
        self.bridge_ns = f"{self.tag}-net"
        self.control_link = f"rh{os.getpid()}-{Hosts._counter}"
        self._own_dir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="reef-hosts-")) if workdir is None \
            else Path(workdir)
        self.third = 0
        self._processes: dict[str, list[subprocess.Popen]] = {n: [] for n in names}
        self._made: list[str] = []       # namespaces made, in order
        self._control_made = False
        self._closed = False

    # ----------------------------------------------------------------- making

    def __enter__(self) -> Hosts:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Make the namespaces, the bridge and the links (see the module docstring)."""
        if os.geteuid() != 0:
            raise HostsUnavailable("emulated hosts need root: `ip netns add` makes network "
                                   "namespaces, which only root (CAP_SYS_ADMIN) may")
        if shutil.which("ip") is None:
            raise HostsUnavailable("`ip` (iproute2) is not installed: apt-get install iproute2")
        sweep()
        _install_hooks()
        with _live_lock:
            _live.append(self)
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _pick_subnet(self) -> int:
        candidates = list(range(1, 250))
        random.Random(os.getpid() * 31 + Hosts._counter).shuffle(candidates)
        for third in candidates:
            if not _subnet_in_use(third):
                return third
        raise HostsUnavailable(f"every {SUPERNET}.X.0/24 is in use on this machine")

    def _make(self) -> None:
        self.third = self._pick_subnet()
        self._add_ns(self.bridge_ns)
        _ip("link", "add", "br0", "type", "bridge", ns=self.bridge_ns)
        _ip("link", "set", "br0", "up", ns=self.bridge_ns)
        # The controlling process's way in: a veth from the root namespace into the bridge.
        peer = "ctl"   # named inside the bridge's namespace once moved there
        _ip("link", "add", self.control_link, "type", "veth", "peer", "name",
            self.control_link.replace("rh", "rp", 1), "netns", self.bridge_ns)
        self._control_made = True
        _ip("link", "set", self.control_link.replace("rh", "rp", 1), "name", peer, ns=self.bridge_ns)
        _ip("link", "set", peer, "master", "br0", "up", ns=self.bridge_ns)
        _ip("addr", "add", f"{SUPERNET}.{self.third}.{CONTROL_HOST}/24", "dev", self.control_link)
        _ip("link", "set", self.control_link, "up")
        for i, name in enumerate(self.names, start=1):
            ns = self.namespace(name)
            self._add_ns(ns)
            outer, inner = f"h{i}o", f"h{i}i"
            # Made inside the bridge namespace, so no name can clash with the root's links.
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner, ns=self.bridge_ns)
            _ip("link", "set", inner, "netns", ns, ns=self.bridge_ns)
            _ip("link", "set", outer, "master", "br0", "up", ns=self.bridge_ns)
            _ip("link", "set", inner, "name", "eth0", ns=ns)
            _ip("addr", "add", f"{self.address(name)}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)

    def _add_ns(self, ns: str) -> None:
        result = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
        if result.returncode != 0:
            raise HostsUnavailable(f"`ip netns add {ns}` failed: {result.stderr.strip()}")
        self._made.append(ns)
        _ip("link", "set", "lo", "up", ns=ns)

    # ----------------------------------------------------------------- naming

    def namespace(self, host: str) -> str:
        if host not in self._processes:
            raise KeyError(f"no host {host!r}; the hosts are {', '.join(self.names)}")
        return f"{self.tag}-{host}"

    def address(self, host: str) -> str:
        """The host's address on the bridge."""
        return f"{SUPERNET}.{self.third}.{self.names.index(host) + 1}"

    @property
    def control_address(self) -> str:
        """The root namespace's address on the bridge (the process that made the hosts)."""
        return f"{SUPERNET}.{self.third}.{CONTROL_HOST}"

    def wrap(self, host: str) -> list[str]:
        """The argv prefix that runs a command inside ``host`` (``ip netns exec``, which execs
        it: the pid is the command's own)."""
        return ["ip", "netns", "exec", self.namespace(host)]

    # ----------------------------------------------------------------- processes

    def spawn(self, host: str, argv: Sequence[str], log: Path | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``argv`` inside ``host`` in a session of its own; output to ``log`` (default:
        ``<workdir>/<host>.log``). Returns once it is inside the host (or has exited)."""
        log = log or self.workdir / f"{host}.log"
        with open(log, "ab") as out:
            process = subprocess.Popen([*self.wrap(host), *argv], stdout=out,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=env, start_new_session=True)
        self._processes[host].append(process)
        self._await_entry(host, process)
        return process

    def _await_entry(self, host: str, process: subprocess.Popen, timeout: float = 10.0) -> None:
        """Until ``process`` is inside ``host``'s namespace (``ip netns exec`` has joined it)
        or has exited, so that ``pids`` and ``kill_host`` see it once ``spawn`` returns."""
        target = os.stat(f"/var/run/netns/{self.namespace(host)}").st_ino
        deadline = time.monotonic() + timeout
        while process.poll() is None and time.monotonic() < deadline:
            try:
                if os.stat(f"/proc/{process.pid}/ns/net").st_ino == target:
                    return
            except OSError:
                pass
            time.sleep(0.01)

    def pids(self, host: str) -> list[int]:
        """Every process in ``host`` now, whoever started it."""
        return namespace_pids(self.namespace(host))

    def kill_host(self, host: str) -> int:
        """SIGKILL every process in ``host``, as a host that loses power; returns how many.
        Blocks until they are gone."""
        killed = len(self.pids(host))
        _kill_all(self.namespace(host))
        for process in self._processes[host]:
            try:
                process.wait(5)   # reaped by its Popen, so its returncode is -SIGKILL
            except subprocess.TimeoutExpired:
                pass
        return killed

    @staticmethod
    def pause(pid: int) -> None:
        """SIGSTOP ``pid`` (a long GC, a stopped container)."""
        os.kill(pid, signal.SIGSTOP)

    @staticmethod
    def resume(pid: int) -> None:
        os.kill(pid, signal.SIGCONT)

    # ----------------------------------------------------------------- the network

    def partition(self, host: str) -> None:
        """Cut ``host`` off from every other host, both ways: its port on the bridge goes down
        (its own ``eth0`` loses carrier). Its processes run on."""
        _ip("link", "set", self._port(host), "down", ns=self.bridge_ns)

    def heal(self, host: str) -> None:
        """Undo ``partition`` and ``partition_one_way`` of ``host``."""
        _ip("link", "set", self._port(host), "up", ns=self.bridge_ns)
        subprocess.run(["ip", "netns", "exec", self.namespace(host), "nft", "delete", "table",
                        "inet", "reefpart"], capture_output=True)

    def partition_one_way(self, host: str, peers: Iterable[str] | None = None,
                          direction: str = "out") -> None:
        """Drop ``host``'s packets to ``peers`` (``direction="out"``) or from them (``"in"``),
        with nftables inside the host's namespace; default peers: every other host and the
        control address. Needs ``nft``."""
        if shutil.which("nft") is None:
            raise HostsUnavailable("one-way partitions need nftables: apt-get install nftables")
        if direction not in ("in", "out"):
            raise ValueError(f"direction is 'in' or 'out', not {direction!r}")
        others = [self.address(p) for p in (peers if peers is not None else
                                            [n for n in self.names if n != host])]
        if peers is None:
            others.append(self.control_address)
        hook, field = ("output", "daddr") if direction == "out" else ("input", "saddr")
        script = (f"add table inet reefpart\n"
                  f"add chain inet reefpart {hook} {{ type filter hook {hook} priority 0; "
                  f"policy accept; }}\n"
                  f"add rule inet reefpart {hook} ip {field} {{ {', '.join(others)} }} drop\n")
        result = subprocess.run(["ip", "netns", "exec", self.namespace(host), "nft", "-f", "-"],
                                input=script, capture_output=True, text=True)
        if result.returncode != 0:
            raise HostsUnavailable(f"nft inside {self.namespace(host)} failed: "
                                   f"{result.stderr.strip()}")

    def _port(self, host: str) -> str:
        self.namespace(host)
        return f"h{self.names.index(host) + 1}o"

    # ----------------------------------------------------------------- tearing down

    def close(self) -> None:
        """Kill every process in the hosts, delete the namespaces, the root veth and the
        temporary directory. Idempotent; safe to call from any state of ``start``."""
        if self._closed:
            return
        self._closed = True
        for ns in reversed(self._made):
            _kill_all(ns)
        for processes in self._processes.values():
            for process in processes:
                try:
                    process.wait(5)
                except subprocess.TimeoutExpired:
                    pass
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if self._control_made:
            subprocess.run(["ip", "link", "del", self.control_link], capture_output=True)
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        with _live_lock:
            if self in _live:
                _live.remove(self)
