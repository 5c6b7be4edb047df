"""Reward code that attacks the sandbox (``tests.recipes.sandbox_attacks:attack``), for
tests/unit/test_sandbox_escape.py. What it does is named by ``metadata["do"]``:

- ``environ``: raises ``ValueError`` listing the names of its environment variables;
- ``stderr_link``: replaces its stderr file by a symlink to ``metadata["target"]``, exits 3;
- ``stderr_fifo``: replaces its stderr file by a FIFO, exits 3;
- ``write``: writes ``metadata["text"]`` into the files ``metadata["paths"]`` (``:``-separated);
  a file it could not write is skipped;
- ``read``: reward 1.0 if every file of ``metadata["paths"]`` holds ``metadata["text"]``, else 0;
- ``fill``: writes ``metadata["n"]`` files of ``metadata["mb"]`` MB as ``/tmp/<token>-<i>``
  until one fails; reward: the MB written;
- ``connect_unix``: connects to the unix socket ``metadata["path"]`` (raises if refused);
- ``daemon``: starts a ``setsid`` grandchild that runs ``sleep 600.<metadata["token"]>``,
  then scores (or, with ``metadata["then_sleep"]``, sleeps that many seconds first);
- ``killer``: starts a ``setsid`` grandchild that, once the call's own process is gone (it
  scores meanwhile), kills every process its user may signal, every 10 ms for
  ``metadata["seconds"]``;
- ``children``: forks ``metadata["n"]`` children that each touch ``metadata["mb"]`` MB and
  wait 1 s; reward 1.0 if every one of them exited 0, else 0;
- ``leave``: leaves what it can for the next call: ``REEF_LEFT`` in its environment (and
  ``putenv``), a file ``left`` in its home, ``/tmp``, ``/var/tmp`` and ``/dev/shm`` (``/dev/shm``'s
  of ``metadata["mb"]`` MB), and a ``setsid`` grandchild holding ``metadata["mb"]`` MB, then
  scores;
- ``look``: raises ``ValueError`` saying what of a ``leave`` it finds (``env``, ``files``),
  which other processes run as its user (``user_others``) and its ``/proc/self/cgroup`` lines
  for ``memory`` and ``pids`` (``cgroups``);
- ``suicide``: SIGKILLs its own process;
- ``fork_bomb``: forks children that sleep 600 s until a fork fails; reward: how many it
  forked;
- ``kernel``: tries what the call's seccomp filter denies (``unshare`` of a user namespace,
  ``clone`` into one, ``ptrace`` of its own child, ``keyctl``, ``bpf``) and raises
  ``ValueError`` with ``name=<errno name or "ok">`` for each and ``no_new_privs=<0|1>``;
- anything else: reward 1.0.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import socket
import sys
import time

from reef_stream.api.rewards import NamedReward, Reward
from reef_stream.core.events import Generation


def _daemon(body) -> None:
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            try:
                body()
            finally:
                os._exit(0)
        os._exit(0)


def _killer(seconds: float, spare: int) -> None:
    # Not the call that started it: killing that (same user) before it answered only made
    # the attack fail its own call, on a loaded machine.
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and _alive(spare):
        time.sleep(0.001)
    while time.monotonic() < deadline:
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
        time.sleep(0.01)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (not reaped yet) has answered: it is gone for the attack's purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _children(n: int, mb: int) -> bool:
    pids = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            try:
                block = bytearray(mb << 20)
                for i in range(0, len(block), 4096):
                    block[i] = 1
                time.sleep(1)
            except BaseException:  # noqa: BLE001 - the limit refused it: say so by status
                os._exit(1)
            os._exit(0)
        pids.append(pid)
    return all(os.waitpid(pid, 0)[1] == 0 for pid in pids)


LEFT = ("/tmp/left", "/var/tmp/left", "/dev/shm/left")


def _leave(mb: int) -> None:
    os.environ["REEF_LEFT"] = "1"
    os.putenv("REEF_LEFT_PUT", "1")
    for path in (os.path.join(os.environ["HOME"], "left"), *LEFT):
        try:
            with open(path, "wb") as f:
                f.write(b"x" * ((mb << 20) if path.startswith("/dev/shm") else 1))
        except OSError:
            pass

    def hold() -> None:
        block = bytearray(mb << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        time.sleep(600)

    _daemon(hold)
    time.sleep(0.2)  # the daemon has its memory before the call ends


def _look() -> str:
    me = os.getpid()
    found = [f"env={sorted(n for n in os.environ if n.startswith('REEF_LEFT'))}"]
    found.append(f"files={[p for p in (os.path.join(os.environ['HOME'], 'left'), *LEFT) if os.path.exists(p)]}")
    with open("/proc/self/cgroup") as f:
        lines = [line.strip() for line in f]
    uid = os.getuid()
    users = [int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) != me
             and _owner(e) == uid]
    found.append(f"user_others={sorted(users)}")
    found.append("cgroups=" + ";".join(line for line in lines
                                       if line.split(":")[1] in ("memory", "pids")))
    return " ".join(found)


def _owner(pid: str) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


def _kernel() -> str:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    found = []

    def tried(name: str, result: int) -> None:
        number = ctypes.get_errno()
        found.append(f"{name}={'ok' if result >= 0 else errno.errorcode.get(number, number)}")

    tried("unshare_user", libc.unshare(0x10000000))
    pid = libc.syscall(56, 0x10000000 | signal.SIGCHLD, 0, 0, 0, 0)  # clone(CLONE_NEWUSER)
    if pid == 0:
        os._exit(0)
    tried("clone_user", pid)
    if pid > 0:
        os.waitpid(pid, 0)
    child = os.fork()
    if child == 0:
        time.sleep(5)
        os._exit(0)
    tried("ptrace", libc.ptrace(16, child, 0, 0))  # PTRACE_ATTACH
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    tried("keyctl", libc.syscall(250, 0, -3, 0, 0, 0))  # KEYCTL_GET_KEYRING_ID, session
    tried("bpf", libc.syscall(321, 0, 0, 0))  # BPF_MAP_CREATE without attributes
    with open("/proc/self/status") as f:
        flags = dict(line.split(":", 1) for line in f if ":" in line)
    found.append(f"no_new_privs={flags.get('NoNewPrivs', '?').strip()}")
    return " ".join(found)


def _attack(generation: Generation) -> Reward:
    meta = generation.metadata
    what = meta.get("do", "")
    if what == "environ":
        raise ValueError("environ: " + ",".join(sorted(os.environ)))
    if what in ("stderr_link", "stderr_fifo"):
        path = os.readlink("/proc/self/fd/2")
        os.unlink(path)
        if what == "stderr_link":
            os.symlink(meta["target"], path)
        else:
            os.mkfifo(path)
        sys.exit(3)
    if what == "write":
        for path in meta["paths"].split(":"):
            try:
                with open(path, "w") as f:
                    f.write(meta["text"])
            except OSError:
                pass
    if what == "read":
        found = 0
        for path in meta["paths"].split(":"):
            try:
                with open(path) as f:
                    found += f.read() == meta["text"]
            except OSError:
                pass
        return Reward(reward=float(found == len(meta["paths"].split(":"))))
    if what == "fill":
        written = 0
        for i in range(int(meta["n"])):
            try:
                with open(f"/tmp/{meta['token']}-{i}", "wb") as f:
                    for _ in range(int(meta["mb"])):
                        f.write(b"x" * (1 << 20))
                        f.flush()
                        written += 1
            except OSError:
                break
        return Reward(reward=float(written))
    if what == "connect_unix":
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(meta["path"])
    if what == "daemon":
        _daemon(lambda: os.execv("/bin/sleep", ["sleep", f"600.{meta['token']}"]))
        time.sleep(float(meta.get("then_sleep", 0)))
    if what == "killer":
        call = os.getpid()
        _daemon(lambda: _killer(float(meta["seconds"]), call))
    if what == "children":
        return Reward(reward=float(_children(int(meta["n"]), int(meta["mb"]))))
    if what == "leave":
        _leave(int(meta["mb"]))
    if what == "look":
        raise ValueError(_look())
    if what == "kernel":
        raise ValueError(_kernel())
    if what == "fork_bomb":
        forked = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(600)
                    os._exit(0)
                forked += 1
        except OSError:
            return Reward(reward=float(forked))
    if what == "suicide":
        os.kill(os.getpid(), signal.SIGKILL)
    return Reward(reward=1.0)


attack = NamedReward("attack", _attack)
