"""A sandbox worker process: ``python -m reef_stream.consumers.reward.sandbox.worker CONFIG_JSON``.

Started by ``SandboxPool`` (``subprocess``, a fresh Python in a session of its own, never a
fork of the reward worker and its Kafka clients). At start it:

1. keeps its stdout for the protocol and points fd 1 at stderr (a stray print of an import
   cannot corrupt a frame);
2. leaves the network: ``unshare(CLONE_NEWNET)`` (a namespace with only a loopback that is
   down), or, unprivileged, ``CLONE_NEWUSER | CLONE_NEWNET``; when neither is allowed it says
   why in its ready frame (``network``) and the pool logs it and reports it in the metrics;
3. makes its *slot*, a cgroup with the call's memory and process limits, and moves itself
   into it (``make_slot``; ``cgroups``), so that every call's process is born in it; becomes a
   child subreaper (orphans of a call are reparented to it and reaped);
4. imports the reward function (``target``: ``module:attribute`` naming a reward function, or
   a class to call with the fields ``build``, or a ``Recipe``, whose ``reward`` it takes after
   the ``overrides``; the pool names the smallest of these it can:
   ``reef_stream.consumers.reward.sandbox.reference``);
5. writes its ready frame (with ``torch``: whether torch was imported, and ``modules``: how
   many modules were), then serves calls one at a time until its stdin closes.

What every call runs under is settled once, at the start (``Sandbox``, ``prepare``): the
calls' environment (``HOME``, ``TMPDIR``, ... at their private /tmp) is set in the worker
itself, and the C library's functions, the seccomp program and the tmp mounts' options are
built there, so that a call's process does only what must be done per call (each page of
the worker it writes is copied).

Each call: the request frame carries the generation as its Avro record (value and headers,
base64 in JSON); the worker decodes it, makes the call's stdout and stderr as anonymous
files in memory (``memfd``: no name the call could replace; it later reads only these
descriptors, bounded), works out its rlimits and forks the call's process, which makes a
process group of its own, points stdin at /dev/null and stdout and stderr at those files,
gets private tmp mounts (``_private_tmp``; where the worker found them refused at its start,
a directory of its own instead, which the worker makes and removes) and works in its /tmp,
sets the ``Limits``, drops to the call's user (as root: a uid of ``uid_range`` the worker
holds for its life, ``claim_uid``; never another pool's), loads the seccomp filter
(``seccomp``: no ``ptrace``, no new namespaces, no mounts, ...), runs the reward function (a
coroutine on a fresh event loop) and writes its result as JSON to a pipe. The worker writes
a frame with the call's pid (the pool kills that process group on a wall-clock timeout),
waits for the call's process, kills what is left of its process group and every other
process of its slot (``_empty_slot``: a ``setsid`` daemon too; without a slot, every process
of its uid: ``kill_user``), reaps, and answers with one frame: ``{"ok": {"reward",
"components"}}``, ``{"raised": {"type", "message", "transient"}}``, or ``{"failure":
{"category", "detail"}}`` (``reef_stream.consumers.reward.sandbox.categories``).

Frames: a 4-byte big-endian length, then that many bytes of JSON. Never pickle.
"""

from __future__ import annotations

import asyncio
import base64
import ctypes
import fcntl
import importlib
import inspect
import json
import math
import numbers
import os
import resource
import select
import shutil
import signal
import stat
import struct
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from reef_stream.api.rewards import is_transient
from reef_stream.consumers.reward.sandbox import libc, seccomp
from reef_stream.consumers.reward.sandbox.categories import (
    CRASHED, EXIT, MEMORY, OUTPUT_INVALID, SANDBOX_UNAVAILABLE, TIMEOUT, Limits, signal_name,
)
from reef_stream.consumers.reward.sandbox.cgroups import (
    SLOT_PROCESSES, Groups, SlotGroup, find, remove_stale,
)

__all__ = ["Sandbox", "claim_uid", "kill_user", "prepare", "read_frame", "run_call",
           "write_frame"]

CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 1 << 14, 1 << 18
#: The directories each call gets a private, size-limited tmpfs on (the first is its working
#: directory, ``HOME`` and ``TMPDIR``); ``/run`` hides the host's unix sockets.
PRIVATE_TMP = ("/tmp", "/var/tmp", "/dev/shm", "/run")
CLONE_NEWUSER = 0x10000000
PR_SET_CHILD_SUBREAPER = 36
#: Where workers lock the user ids they run calls as (one file per uid, root's alone).
UID_LOCKS = "/run/reef-sandbox/uids"
#: The largest result a call may write.
MAX_RESULT_BYTES = 1 << 20
#: Standard modules imported lazily by common calls (``socket.create_connection`` needs
#: ``encodings.idna``) or by the programs a code reward runs, imported by the worker before
#: its calls: a call run as another user may not be able to read the Python installation
#: (``SandboxPool`` says so at start-up), and a worker imports only the reward's module, not
#: the recipe and torch, which would bring most of the standard library in.
PRELOADED = ("encodings.idna", "encodings.punycode", "json", "asyncio", "tempfile", "ctypes",
             "subprocess", "math", "cmath", "random", "re", "string", "fractions", "decimal",
             "statistics", "collections", "heapq", "bisect", "itertools", "functools",
             "operator", "copy", "typing", "dataclasses", "datetime", "calendar", "textwrap",
             "difflib", "unicodedata", "pprint", "queue")
#: How much of a call's stderr goes into the reason of its failure.
STDERR_TAIL = 1500
#: A call's processes' ``oom_score_adj``: the OOM killer of the worker's slot chooses them first.
OOM_FIRST = 1000
_MEMORY_RESULT = b'{"memory": true}'


@dataclass(frozen=True)
class Sandbox:
    """What every call of a worker runs under, settled once at the worker's start
    (``prepare``), so that each call's process does only what must be done per call.

    ``private``: each call gets private tmp mounts (``_private_tmp``: a tmpfs with
    ``mount_options`` on each of ``mounts``) and works in ``PRIVATE_TMP[0]``, whose
    environment (``HOME``, ``TMPDIR``, ...) the worker set in its own, once; otherwise each call
    works in a directory of its own under ``tmp`` (the worker's), its environment set by its
    process. ``filtered``: each call loads the seccomp filter. ``slot``: the worker's cgroup,
    or None."""

    limits: Limits
    uid: int | None
    slot: SlotGroup | None = None
    filtered: bool = False
    private: bool = False
    tmp: str | None = None
    mounts: tuple[bytes, ...] = ()
    mount_options: bytes = b""


def prepare(limits: Limits, uid: int | None, slot: SlotGroup | None, filtered: bool,
            private: bool, tmp: str | None) -> Sandbox:
    """This worker's ``Sandbox``; with ``private``, also sets the calls' environment in this
    process (after the reward's module was imported: it imported in the worker's own)."""
    mounts, options = _tmp_mounts(limits)
    if private:
        _enter_workdir(PRIVATE_TMP[0])
    return Sandbox(limits, uid, slot, filtered, private, tmp, mounts, options)


def _enter_workdir(workdir: str) -> None:
    """``workdir`` as the calls' ``HOME``, ``TMPDIR``, ``TMP``, ``TEMP`` and
    ``tempfile.tempdir``, with ``REEF_SANDBOXED_CALL=1``."""
    os.environ.update(HOME=workdir, TMPDIR=workdir, TMP=workdir, TEMP=workdir,
                      REEF_SANDBOXED_CALL="1")
    tempfile.tempdir = workdir


def become(uid: int) -> None:
    """Drop every group and become ``uid`` (group ``uid`` too), for good: the one way a forked
    child of the root worker leaves root. Raises ``OSError`` when it cannot."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def write_frame(fd: int, payload: dict) -> None:
    data = json.dumps(payload).encode()
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(fd, data):]


def read_frame(fd: int) -> dict | None:
    """The next frame on a blocking ``fd``; None at its end."""
    head = _read_exactly(fd, 4)
    if head is None:
        return None
    body = _read_exactly(fd, struct.unpack(">I", head)[0])
    if body is None:
        return None
    return json.loads(body)


def _read_exactly(fd: int, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# --------------------------------------------------------------------------- start-up

def isolate_network() -> str:
    """``isolated`` when this process now has a network namespace of its own; otherwise why
    not."""
    if libc.unshare(CLONE_NEWNET) == 0:
        return "isolated"
    first = os.strerror(ctypes.get_errno())
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        try:  # stay the same user inside (files keep their owner)
            with open("/proc/self/setgroups", "w") as f:
                f.write("deny")
            with open("/proc/self/uid_map", "w") as f:
                f.write(f"{uid} {uid} 1")
            with open("/proc/self/gid_map", "w") as f:
                f.write(f"{gid} {gid} 1")
        except OSError as error:
            return f"isolated (user namespace without an id map: {error})"
        return "isolated"
    return (f"not isolated: unshare(CLONE_NEWNET) failed ({first}) and so did "
            f"unshare(CLONE_NEWUSER|CLONE_NEWNET) ({os.strerror(ctypes.get_errno())})")


def resolve(target: str, overrides: list[str], build: dict | None = None) -> Any:
    """The reward function ``target`` names: ``module:attribute`` (default attribute
    ``recipe``; dotted for a class's attribute), a ``Recipe`` (its ``reward``, after
    ``overrides``) or a reward function; with ``build``, a class called with these fields
    (``reef_stream.consumers.reward.sandbox.reference``)."""
    module_name, _, attribute = target.partition(":")
    module = importlib.import_module(module_name)
    if attribute:
        value = module
        for part in attribute.split("."):
            value = getattr(value, part)
    else:
        value = getattr(module, "recipe", None) or getattr(module, "RECIPE")
    if build is not None:
        value = value(**build)
    if hasattr(value, "processor") and hasattr(value, "reward"):  # a Recipe
        if overrides:
            from reef_stream.api.recipe import apply_overrides
            value = apply_overrides(value, overrides)
        value = value.reward
    if value is None or not callable(value):
        raise SystemExit(f"sandbox worker: {target} has no reward function")
    return value


def claim_uid(first: int, count: int) -> tuple[int, int]:
    """The lowest user id of ``first .. first + count - 1`` that no other worker on this machine
    holds, with whatever still runs as it killed: ``(uid, fd)``, where ``fd`` holds its lock
    (``UID_LOCKS``/<uid>, flock'd until this process dies). Raises ``OSError`` when every one
    is held or the lock directory is not root's alone."""
    os.makedirs(UID_LOCKS, mode=0o700, exist_ok=True)
    for directory in (os.path.dirname(UID_LOCKS), UID_LOCKS):
        info = os.lstat(directory)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
            raise OSError(f"{directory} must be a directory of root's that only root writes")
    for uid in range(first, first + count):
        fd = os.open(os.path.join(UID_LOCKS, str(uid)),
                     os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        kill_user(uid)
        return uid, fd
    raise OSError(f"every sandbox user id of {first}..{first + count - 1} is held")


def kill_user(uid: int, seconds: float = 1.0, reap: bool = True) -> bool:
    """SIGKILL every process of ``uid`` (``kill(-1)`` from a child that became ``uid``), again
    until ``/proc`` shows none or ``seconds`` passed; with ``reap``, reaps this process's
    children between tries (a subreaper's orphans). Blocks; True when none was left. As root
    only.

    ``kill(-1)``'s own answer cannot say when none is left: it fails with ESRCH only when no
    other process exists at all (it counts the processes it may not signal too), so waiting
    for that costs the whole ``seconds`` (measured: about 1 s per call)."""
    deadline = time.monotonic() + seconds
    while _user_processes(uid):
        pid = os.fork()
        if pid == 0:
            try:
                become(uid)
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                os._exit(0)
            except BaseException:  # noqa: BLE001 - said by the status
                os._exit(2)
            os._exit(0)
        status = os.waitpid(pid, 0)[1]
        if reap:
            _reap()
        if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
            return False
        if time.monotonic() > deadline:
            return not _user_processes(uid)
        time.sleep(0.002)
    return True


# --------------------------------------------------------------------------- one call

def _tmp_mounts(limits: Limits) -> tuple[tuple[bytes, ...], bytes]:
    """The directories of ``PRIVATE_TMP`` that exist here (a symbolic link is not one), and
    the options of the tmpfs of ``limits.file_mb`` MB each gets."""
    paths = tuple(path.encode() for path in PRIVATE_TMP
                  if os.path.isdir(path) and not os.path.islink(path))
    return paths, f"size={limits.file_mb}m,mode=1777".encode()


def _private_tmp(mounts: tuple[bytes, ...], options: bytes) -> bool:
    """In the call's process, as root: a mount namespace (and an IPC namespace) of its own,
    every mount private, and a fresh tmpfs with ``options`` (nosuid, nodev) on each of
    ``mounts`` (``_tmp_mounts``): nothing written there is shared with another call or
    outlives this one, and a unix socket there on the host is out of reach. False when the
    namespace is refused; raises ``OSError`` when a mount fails after it was granted."""
    if libc.unshare(CLONE_NEWNS | CLONE_NEWIPC) != 0 and libc.unshare(CLONE_NEWNS) != 0:
        return False
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
    for path in mounts:
        if libc.mount(b"tmpfs", path, b"tmpfs", MS_NOSUID | MS_NODEV, options) != 0:
            raise OSError(ctypes.get_errno(), f"mount tmpfs on {path.decode()}")
    return True


def _filesystem(limits: Limits) -> str:
    """``private`` when a call's process gets its own tmp mounts (``_private_tmp``, tried in
    a child); otherwise why not."""
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if _private_tmp(*_tmp_mounts(limits)) else 1)
        except BaseException:  # noqa: BLE001 - said by the status
            os._exit(2)
    status = os.waitpid(pid, 0)[1]
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return "private"
    return ("not private: unshare(CLONE_NEWNS) was refused" if os.WIFEXITED(status)
            and os.WEXITSTATUS(status) == 1 else "not private: a tmpfs mount failed")

def _user_processes(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += 1
            except OSError:
                pass
    return count


def _rlimits(limits: Limits, uid: int | None) -> tuple[tuple[int, int, int], ...]:
    """The call's limits as ``(resource, soft, hard)``, soft and hard alike but for the CPU
    (the reward cannot raise them again), worked out in the worker just before the fork: the
    address space is counted from what the worker has mapped then, which the call's process
    starts with."""
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    processes = limits.processes if uid is not None else limits.processes + \
        _user_processes(os.getuid())
    return tuple((which, soft, soft if hard is None else hard) for which, soft, hard in (
        (resource.RLIMIT_CPU, limits.cpu_s, limits.cpu_s + 1),
        (resource.RLIMIT_AS, mapped + limits.memory_mb * 2**20, None),
        (resource.RLIMIT_FSIZE, limits.file_mb * 2**20, None),
        (resource.RLIMIT_NOFILE, limits.open_files, None),
        (resource.RLIMIT_NPROC, processes, None),
        (resource.RLIMIT_CORE, 0, None)))


def _child(reward: Any, generation: Any, sandbox: Sandbox, workdir: str, result_fd: int,
           outputs: tuple[int, int], rlimits: tuple[tuple[int, int, int], ...]) -> None:
    """The call's process (after the fork, born in the worker's slot): ``outputs`` are its
    stdout and stderr, opened by the worker; ``workdir`` its directory where its tmp is not
    private; with ``sandbox.filtered``, the seccomp filter is the last step of its set-up.
    Never returns."""
    me = os.getpid()
    memory_result = _MEMORY_RESULT
    uid = sandbox.uid
    try:
        # the OOM killer's first choice (os.open and os.write: as few pages written as can be)
        adjust = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
        os.write(adjust, b"%d" % OOM_FIRST)
        os.close(adjust)
        os.setpgid(0, 0)
        for number in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(number, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(outputs[0], 1)
        os.dup2(outputs[1], 2)
        os.closerange(3, result_fd)
        os.closerange(result_fd + 1, 1 << 16)
        if sandbox.private:  # its environment is the worker's, set once (``prepare``)
            if not _private_tmp(sandbox.mounts, sandbox.mount_options):
                raise OSError("the call's mount namespace was refused")
            os.chdir(PRIVATE_TMP[0])
        else:
            os.makedirs(workdir, 0o700, exist_ok=True)
            if uid is not None:
                os.chown(workdir, uid, uid)
            os.chdir(workdir)
            _enter_workdir(workdir)
        for which, soft, hard in rlimits:
            resource.setrlimit(which, (soft, hard))
        if uid is not None:
            become(uid)
        if sandbox.filtered:
            seccomp.install()
    except BaseException as error:  # noqa: BLE001 - the sandbox could not be set up
        _write_all(result_fd, json.dumps({"setup": f"{type(error).__name__}: {error}"}).encode())
        os._exit(0)
    try:
        result = reward(generation)
        if inspect.isawaitable(result):
            result = asyncio.run(_awaited(result))
        payload = _result_payload(result)
    except MemoryError:
        if os.getpid() == me:
            _write_all(result_fd, memory_result)
        os._exit(0)
    except SystemExit as error:
        code = error.code
        os._exit(0 if os.getpid() != me else (code if isinstance(code, int) else 1))
    except BaseException as error:  # noqa: BLE001 - the function's failure is the outcome
        if os.getpid() != me:  # a process the reward forked: never answers
            os._exit(0)
        try:
            payload = json.dumps({"raised": {"type": type(error).__name__,
                                             "message": str(error)[:2000],
                                             "transient": is_transient(error)}}).encode()
        except MemoryError:
            payload = memory_result
    if os.getpid() == me:
        try:
            _write_all(result_fd, payload)
        except OSError:
            pass
    os._exit(0)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _result_payload(result: Any) -> bytes:
    reward = getattr(result, "reward", None)
    components = getattr(result, "components", None)
    if type(result).__name__ != "Reward" or not isinstance(reward, numbers.Real) \
            or isinstance(reward, bool):
        return json.dumps({"invalid": f"expected a Reward with a number, got "
                                      f"{type(result).__name__}"}).encode()
    try:
        parts = {str(k): float(v) for k, v in dict(components or {}).items()}
    except (TypeError, ValueError) as error:
        return json.dumps({"invalid": f"components: {error}"}).encode()
    return json.dumps({"ok": {"reward": float(reward), "components": parts}}).encode()


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def _collect(read_fd: int, pid: int) -> tuple[bytes, int, float, bool]:
    """The call's result bytes (at most ``MAX_RESULT_BYTES``), its wait status, the CPU
    seconds it used, and whether it wrote more than that. Returns once the call's process
    ended."""
    os.set_blocking(read_fd, False)
    chunks, size, eof, status, usage = [], 0, False, None, None

    def drain() -> bool:
        nonlocal size
        while True:
            try:
                chunk = os.read(read_fd, 65536)
            except BlockingIOError:
                return False
            if not chunk:
                return True
            size += len(chunk)
            if size <= MAX_RESULT_BYTES:
                chunks.append(chunk)

    while status is None:
        if eof:
            _, status, usage = os.wait4(pid, 0)
            break
        ready, _, _ = select.select([read_fd], [], [], 0.05)
        if ready:
            eof = drain()
        done, waited, used = os.wait4(pid, os.WNOHANG)
        if done:
            status, usage = waited, used
    drain()
    cpu = usage.ru_utime + usage.ru_stime
    return b"".join(chunks), status, cpu, size > MAX_RESULT_BYTES


def _clean_group(pid: int) -> None:
    """Kill what is left of the call's process group and reap it (orphans come to this
    subreaper), for up to a second."""
    deadline = time.monotonic() + 1.0
    while True:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        except PermissionError:
            pass
        _reap()
        try:
            os.killpg(pid, 0)
        except (ProcessLookupError, PermissionError):
            return
        if time.monotonic() > deadline:
            return
        time.sleep(0.002)


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _open_output(name: str) -> int:
    """A new anonymous file (``memfd``) for one of the call's outputs: in memory (charged to
    the call's slot and limited by its RLIMIT_FSIZE), in no directory, so no name the call
    could replace, and gone when the worker closes it."""
    return os.memfd_create(name, os.MFD_CLOEXEC)


def _tail(fd: int) -> str:
    """At most the last ``STDERR_TAIL`` bytes of the regular file open on ``fd`` (the
    worker's own descriptor: whatever the call did, it reads this file)."""
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return ""
        return os.pread(fd, STDERR_TAIL, max(0, info.st_size - STDERR_TAIL)) \
            .decode(errors="replace").strip()
    except OSError:
        return ""


def run_call(reward: Any, generation: Any, sandbox: Sandbox, out_fd: int) -> dict:
    """One call in a forked process (see the module docstring), born in the worker's slot
    where it has one (memory and processes limited per call: ``cgroups``), which holds only
    the worker again when this returns, under the seccomp filter where the sandbox has it;
    the answer frame."""
    limits, slot, uid = sandbox.limits, sandbox.slot, sandbox.uid
    oom_before = 0
    if slot is not None:
        try:
            oom_before = slot.oom_kills()
            slot.fit(limits.memory_mb << 20)
        except OSError as error:
            return {"failure": {"category": SANDBOX_UNAVAILABLE,
                                "detail": f"the call's memory limit could not be set: {error}"}}
    # where its tmp is not private, a directory of the worker's that the call cannot change,
    # in which it makes its own (work)
    own = "" if sandbox.private else tempfile.mkdtemp(prefix="call-", dir=sandbox.tmp)
    outputs: tuple[int, ...] = ()
    try:
        if own:
            os.chmod(own, 0o711)
        workdir = os.path.join(own, "work") if own else ""
        outputs = (_open_output("stdout"), _open_output("stderr"))
        rlimits = _rlimits(limits, uid)
        read_fd, write_fd = os.pipe()
        try:
            pid = os.fork()
        except OSError as error:
            os.close(read_fd)
            os.close(write_fd)
            return {"failure": {"category": SANDBOX_UNAVAILABLE,
                                "detail": f"the call's process could not be forked: {error}"}}
        if pid == 0:
            try:
                os.close(read_fd)
                _child(reward, generation, sandbox, workdir, write_fd, outputs, rlimits)
            finally:
                os._exit(70)
        os.close(write_fd)
        try:  # as the child does: its group exists before anyone is told to kill it
            os.setpgid(pid, pid)
        except OSError:
            pass
        write_frame(out_fd, {"pid": pid, "dir": own})
        try:
            data, status, cpu, too_big = _collect(read_fd, pid)
            _clean_group(pid)
            emptied = slot is not None and _empty_slot(slot)  # a setsid daemon too
            if uid is not None and not emptied:  # without a slot: what runs as its user
                kill_user(uid)
        finally:
            os.close(read_fd)
        oom = slot.oom_kills() - oom_before if slot is not None else 0
        return _answer(data, status, cpu, too_big, _tail(outputs[1]), limits, oom)
    finally:
        for fd in outputs:
            os.close(fd)
        if own:
            shutil.rmtree(own, ignore_errors=True)


def _empty_slot(slot: SlotGroup, seconds: float = 1.0) -> bool:
    """SIGKILL every process in ``slot`` but this one and reap them (orphans come to this
    subreaper), again until none is left or ``seconds`` passed; whether none is (False too
    when the group cannot be read). Forks nothing: a call that filled its ``pids.max``
    cannot stop it."""
    deadline = time.monotonic() + seconds
    try:
        while others := slot.others():
            for pid in others:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            _reap()
            if time.monotonic() > deadline:
                return not slot.others()
            time.sleep(0.001)
    except (OSError, ValueError):
        return False
    return True


def make_slot(groups: Groups, limits: Limits) -> tuple[SlotGroup | None, str]:
    """This worker's slot, joined (``cgroups``), and the cgroup state for the ready frame:
    ``(slot, groups.state)``, or ``(None, "none (<why>)")`` when there is no cgroup or the slot
    could not be made or joined.

    The OOM killer of the slot should end a call's process, never the worker: each call's
    process sets its ``oom_score_adj`` to ``OOM_FIRST`` (raising it needs no privilege), and
    the worker lowers its own to -1000 (never chosen) where it may (CAP_SYS_RESOURCE). Where
    it may not, a call that lowers its processes' back to 0 and runs programs smaller than
    the worker can have the worker chosen: the worker dies, the pool replaces it, and that
    call ends ``sandbox_unavailable``."""
    if not groups.version:
        return None, groups.state
    slot = SlotGroup(groups, f"reef-call-{os.getpid()}-slot")
    try:
        slot.create(limits.memory_mb << 20, limits.processes + SLOT_PROCESSES)
        slot.join()
    except OSError as error:
        slot.remove(0)
        return None, (f"none (the worker's cgroup {groups.version} could not be made or "
                      f"joined: {error})")
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("-1000")
    except PermissionError:  # no CAP_SYS_RESOURCE: the calls' OOM_FIRST alone
        pass
    return slot, groups.state


def _answer(data: bytes, status: int, cpu: float, too_big: bool, stderr: str,
            limits: Limits, oom: int = 0) -> dict:
    said = f"; its stderr ends: {stderr[-STDERR_TAIL:]}" if stderr else ""

    def failure(category: str, detail: str) -> dict:
        return {"failure": {"category": category, "detail": detail}}

    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        if number == signal.SIGXCPU or (number == signal.SIGKILL and cpu >= limits.cpu_s):
            return failure(TIMEOUT, f"the CPU limit of {limits.cpu_s} s ran out "
                                    f"({signal_name(number)}){said}")
        if number == signal.SIGKILL and oom:
            return failure(MEMORY, f"the call's processes together passed the memory limit "
                                   f"of {limits.memory_mb} MB (its cgroup's OOM killer){said}")
        return failure(CRASHED, f"the call's process was killed by {signal_name(number)}{said}")
    if too_big:
        return failure(OUTPUT_INVALID, f"the result was larger than {MAX_RESULT_BYTES} bytes")
    if not data:
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1
        if code:
            return failure(EXIT, f"the call's process exited with status {code} and no "
                                 f"result{said}")
        return failure(OUTPUT_INVALID, f"the call's process exited with no result{said}")
    try:
        result = json.loads(data)
        if not isinstance(result, dict):
            raise ValueError(f"a JSON {type(result).__name__}")
    except ValueError as error:
        return failure(OUTPUT_INVALID, f"the result is not one JSON object: {error}")
    if result.get("memory"):
        return failure(MEMORY, f"an allocation failed under the memory limit of "
                               f"{limits.memory_mb} MB (MemoryError){said}")
    if "setup" in result:
        return failure(CRASHED, f"the call's sandbox could not be set up: {result['setup']}")
    if "invalid" in result:
        return failure(OUTPUT_INVALID, str(result["invalid"]))
    if "raised" in result:
        return {"raised": result["raised"]}
    ok = result.get("ok")
    if not isinstance(ok, dict) or not isinstance(ok.get("reward"), float) \
            or not math.isfinite(ok["reward"]):
        return failure(OUTPUT_INVALID, f"not a finite reward: {data[:200]!r}")
    return {"ok": ok}


def _unreadable(uid: int | None) -> str:
    """The Python installation's directory when the calls' user cannot read it, or ""."""
    if uid is None:
        return ""
    stdlib = os.path.dirname(os.__file__)
    pid = os.fork()
    if pid == 0:
        try:
            become(uid)
            os.listdir(stdlib)
        except OSError:
            os._exit(1)
        os._exit(0)
    return "" if os.waitpid(pid, 0)[1] == 0 else stdlib


def main() -> None:
    config = json.loads(sys.argv[1])
    out_fd = os.dup(1)
    os.dup2(2, 1)
    limits = Limits(**config["limits"])
    uid = config.get("uid")
    if config.get("uid_range"):
        try:
            uid, _lock = claim_uid(*config["uid_range"])
        except OSError as error:
            write_frame(out_fd, {"ready": False, "error": f"no sandbox user id: {error}"})
            return
    network = isolate_network() if config.get("isolate_network", True) else "not isolated: off"
    groups = find()
    remove_stale(groups)
    slot, cgroup = make_slot(groups, limits)
    filtering = seccomp.status()
    filesystem = _filesystem(limits)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    from reef_stream.core.events import Generation
    from reef_stream.core.serde import decode
    for name in PRELOADED:  # the calls' user may not be able to read the installation
        importlib.import_module(name)
    try:
        reward = resolve(config["target"], config.get("overrides", []), config.get("build"))
    except BaseException as error:  # noqa: BLE001 - said in the ready frame
        write_frame(out_fd, {"ready": False, "error": f"{type(error).__name__}: {error}"})
        return
    sandbox = prepare(limits, uid, slot, filtering == "filtered", filesystem == "private",
                      config.get("tmp"))
    write_frame(out_fd, {"ready": True, "network": network, "pid": os.getpid(), "uid": uid,
                         "unreadable": _unreadable(uid), "filesystem": filesystem,
                         "cgroup": cgroup, "seccomp": filtering,
                         "torch": "torch" in sys.modules,
                         "modules": len(sys.modules)})
    while (request := read_frame(0)) is not None:
        _reap()
        try:
            headers = [(k, base64.b64decode(v)) for k, v in request["headers"]]
            generation = decode(base64.b64decode(request["value"]), headers, Generation)
        except Exception as error:  # noqa: BLE001 - answered as the call's failure
            write_frame(out_fd, {"pid": 0})
            write_frame(out_fd, {"failure": {"category": OUTPUT_INVALID,
                                             "detail": f"the generation did not decode in the "
                                                       f"sandbox: {error}"}})
            continue
        write_frame(out_fd, run_call(reward, generation, sandbox, out_fd))


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:  # the pool closed (or killed the reward worker): nothing to say
        os._exit(0)
