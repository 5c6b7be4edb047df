"""Where one sandboxed call's CPU goes: each step of a call timed alone, in a worker-like process.

    python bench/sandbox_call.py [--calls 300] [--before REV [--rounds N]]

As root (the sandbox's calls run as a user of their own only then). This process sets itself up
as a sandbox worker does (``reef_stream.consumers.reward.sandbox.worker``: a uid of its own,
its network namespace, its cgroup slot, the preloaded modules, the reward
``tests.recipes.sandbox_rewards:hostile``), then runs ``--calls`` calls of each kind below one
at a time, and prints per call: the wall time, this process's CPU (the worker's), its reaped
children's CPU (the calls' processes), and the whole machine's busy CPU from ``/proc/stat``
(kernel threads included: the teardown of a namespace is not always the exiting process's;
other jobs on the machine count too, so read it beside the load average printed with it):

1. ``fork``: fork, ``_exit`` at once, wait;
2. ``+ set-up``: the call's own steps before its sandbox (OOM score, process group, signals,
   stdin/stdout/stderr, closing the worker's descriptors);
3. ``+ tmp``: its mount and IPC namespaces and private tmp mounts;
4. ``+ limits, uid``: its rlimits and its user;
5. ``+ seccomp``: its filter;
6. ``run_call``: the whole call as the worker makes it, a trivial reward (its outputs, pipe,
   frames, the slot emptied).

The differences between lines are what each step costs, its teardown at exit included. With
``--before REV`` it runs as revision REV has it and as this tree has it, alternating
(``bench/trees.py``). Figures, never assertions.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import dataclasses
import importlib
import inspect
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from reef_stream.consumers.reward.sandbox import seccomp, worker  # noqa: E402
from reef_stream.consumers.reward.sandbox.categories import Limits  # noqa: E402
from reef_stream.consumers.reward.sandbox.cgroups import find, remove_stale  # noqa: E402
from trees import add_before, before_and_after  # noqa: E402

TARGET = "tests.recipes.sandbox_rewards:hostile"
LIMITS = Limits()


def _busy_jiffies() -> int:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # all but idle and iowait


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _status(name: str) -> str:
    with open("/proc/self/status") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith(name + ":")),
                    "?")


def _measure(label: str, calls: int, one) -> None:
    one()  # the first call warms what it touches
    tick = os.sysconf("SC_CLK_TCK")
    wall, own, children, busy = (time.perf_counter(), time.process_time(), _children_cpu(),
                                 _busy_jiffies())
    for _ in range(calls):
        one()
    wall = time.perf_counter() - wall
    own = time.process_time() - own
    children = _children_cpu() - children
    busy = (_busy_jiffies() - busy) / tick
    ms = 1000 / calls
    print(f"{label:18s} wall {wall * ms:6.2f} ms | CPU: worker {own * ms:5.2f} + call's "
          f"process {children * ms:5.2f} = {(own + children) * ms:5.2f} ms | machine busy "
          f"{busy * ms:6.2f} ms", flush=True)


def _private_tmp() -> None:
    """A call's tmp as the sandbox makes it (the same system calls, made here: the steps
    measure what the kernel's part costs, the same in both trees of ``--before``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(worker.CLONE_NEWNS | worker.CLONE_NEWIPC) != 0:
        raise OSError(ctypes.get_errno(), "unshare")
    libc.mount(b"none", b"/", None, worker.MS_REC | worker.MS_PRIVATE, None)
    for path in worker.PRIVATE_TMP:
        if os.path.isdir(path) and not os.path.islink(path):
            libc.mount(b"tmpfs", path.encode(), b"tmpfs", worker.MS_NOSUID | worker.MS_NODEV,
                       f"size={LIMITS.file_mb}m,mode=1777".encode())


def _limits(uid: int | None) -> None:
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    for which, soft in ((resource.RLIMIT_CPU, LIMITS.cpu_s),
                        (resource.RLIMIT_AS, mapped + LIMITS.memory_mb * 2**20),
                        (resource.RLIMIT_FSIZE, LIMITS.file_mb * 2**20),
                        (resource.RLIMIT_NOFILE, LIMITS.open_files),
                        (resource.RLIMIT_NPROC, LIMITS.processes), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(which, (soft, soft))
    if uid is not None:
        worker.become(uid)


def _forked(steps: int, uid: int | None, filtered: bool, outputs: tuple[int, int]):
    """One call's process that goes as far as ``steps`` of the set-up, then exits."""
    def one() -> None:
        pid = os.fork()
        if pid == 0:
            try:
                if steps >= 1:
                    with open("/proc/self/oom_score_adj", "w") as f:
                        f.write(str(worker.OOM_FIRST))
                    os.setpgid(0, 0)
                    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
                        signal.signal(number, signal.SIG_DFL)
                    null = os.open(os.devnull, os.O_RDONLY)
                    os.dup2(null, 0)
                    os.dup2(outputs[0], 1)
                    os.dup2(outputs[1], 2)
                    os.closerange(3, 1 << 16)
                if steps >= 2:
                    _private_tmp()
                if steps >= 3:
                    _limits(uid)
                if steps >= 4 and filtered:
                    seccomp.install()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
    return one


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--inner", help=argparse.SUPPRESS)
    add_before(parser)
    args = parser.parse_args()
    if args.before:
        return before_and_after(__file__, args.before, args.rounds)
    if os.geteuid() != 0:
        raise SystemExit("bench/sandbox_call.py runs as root, as the sandbox's workers do")
    if args.inner:
        return measure(args.calls, json.loads(args.inner))
    # What a pool's worker would import, and the generation as its Avro record: the measuring
    # process is a fresh Python that imports what a worker does, not this bench's imports.
    from reef_stream.consumers.reward.sandbox.reference import worker_target
    from reef_stream.core.serde import encode
    from tests.faults.records import generation

    value, headers = encode(dataclasses.replace(generation(1), metadata={"do": "score"}))
    config = {"target": worker_target(TARGET)["target"],
              "value": base64.b64encode(value).decode(),
              "headers": [[k, base64.b64encode(v or b"").decode()] for k, v in headers]}
    return subprocess.run([sys.executable, __file__, "--calls", str(args.calls),
                           "--inner", json.dumps(config)], cwd=ROOT).returncode


def measure(calls: int, config: dict) -> int:
    """The measuring process: set up as a worker, then each kind of call (the module
    docstring)."""
    from reef_stream.core.events import Generation
    from reef_stream.core.serde import decode

    g = decode(base64.b64decode(config["value"]),
               [(k, base64.b64decode(v)) for k, v in config["headers"]], Generation)
    uid, _lock = worker.claim_uid(63900, 50)
    network = worker.isolate_network()
    groups = find()
    remove_stale(groups)
    slot, cgroup = worker.make_slot(groups, LIMITS)
    ctypes.CDLL(None, use_errno=True).prctl(worker.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    for name in worker.PRELOADED:
        importlib.import_module(name)
    reward = worker.resolve(config["target"], [])
    filtered = seccomp.status() == "filtered"
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"bench/sandbox_call.py: reward {config['target']}, uid {uid}, network {network}, "
          f"cgroup {cgroup}, seccomp "
          f"{seccomp.status()}; this worker: RSS {_status('VmRSS')}, page tables "
          f"{_status('VmPTE')}, {len(sys.modules)} modules; load average {load}", flush=True)
    tmp = os.path.join("/tmp", f"reef-bench-call-{os.getpid()}")
    os.makedirs(tmp, 0o711, exist_ok=True)
    sink = os.open(os.devnull, os.O_WRONLY)
    outputs = (os.open(os.devnull, os.O_WRONLY), os.open(os.devnull, os.O_WRONLY))
    kinds = [("fork", _forked(0, uid, filtered, outputs)),
             ("+ set-up", _forked(1, uid, filtered, outputs)),
             ("+ tmp", _forked(2, uid, filtered, outputs)),
             ("+ limits, uid", _forked(3, uid, filtered, outputs)),
             ("+ seccomp", _forked(4, uid, filtered, outputs))]
    if "sandbox" in inspect.signature(worker.run_call).parameters:  # one Sandbox per worker
        sandbox = worker.prepare(LIMITS, uid, slot, filtered,
                                 worker._filesystem(LIMITS) == "private", tmp)
        arguments: tuple = (sandbox, sink)
    else:
        arguments = (LIMITS, uid, sink, tmp, slot, filtered)

    def call() -> None:
        answer = worker.run_call(reward, g, *arguments)
        assert "ok" in answer, answer

    kinds.append(("run_call", call))
    for label, one in kinds:
        _measure(label, calls, one)
    with open("/proc/loadavg") as f:
        print(f"load average at the end {' '.join(f.read().split()[:3])}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
