"""How a sandboxed reward call can end without a reward, and the limits it runs under.

A call in the sandbox ends in one of three ways:

- a ``Reward`` (the function returned one);
- ``RaisedInSandbox``: the reward function raised, as it could in-thread (it is retried like
  any raising call, and its dead letter names the exception's type, never a sandbox category);
- ``SandboxFailure`` with a ``category`` (``CATEGORIES``): the sandbox ended the call or the
  call ended the process. Its dead letter's ``error_type`` is ``sandbox.<category>``.

===================  =============================================================  ========
category             when                                                           retried
===================  =============================================================  ========
timeout              no result within the wall-clock timeout (the call's process      in the
                     group was killed), or the CPU-seconds limit ran out (SIGXCPU)    slow lane
memory               the address-space limit refused an allocation (MemoryError)      no
crashed              the call's process died of a signal (SIGSEGV, SIGABRT, ...)      no
exit                 the call's process exited (``sys.exit``, ``os._exit``) with      no
                     no result
output_invalid       the result was not a finite ``Reward`` (or not one at all)        no
sandbox_unavailable  no sandbox worker could be had, or one died outside a call       yes
===================  =============================================================  ========

A failure that the same generation would meet again (memory, crashed, exit, output_invalid,
the CPU limit) is never retried: calling again would give the same answer.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

__all__ = ["CATEGORIES", "CRASHED", "EXIT", "MEMORY", "OUTPUT_INVALID", "SANDBOX_UNAVAILABLE",
           "TIMEOUT", "Limits", "RaisedInSandbox", "SandboxFailure", "signal_name"]

TIMEOUT = "timeout"
MEMORY = "memory"
CRASHED = "crashed"
EXIT = "exit"
OUTPUT_INVALID = "output_invalid"
SANDBOX_UNAVAILABLE = "sandbox_unavailable"
CATEGORIES = (TIMEOUT, MEMORY, CRASHED, EXIT, OUTPUT_INVALID, SANDBOX_UNAVAILABLE)


class SandboxFailure(Exception):
    """A sandboxed call that ended without a reward, for a reason of the sandbox's (see the
    module docstring). ``category``: one of ``CATEGORIES``; ``wall``: a wall-clock timeout
    (the only timeout worth another try, in the slow lane); ``retryable``: whether another
    try may do better."""

    def __init__(self, category: str, detail: str, *, wall: bool = False) -> None:
        if category not in CATEGORIES:
            raise ValueError(f"unknown sandbox failure category {category!r}")
        super().__init__(f"{category}: {detail}")
        self.category, self.detail, self.wall = category, detail, wall

    @property
    def error_type(self) -> str:
        """The dead letter's ``error_type``: ``sandbox.<category>``."""
        return f"sandbox.{self.category}"

    @property
    def retryable(self) -> bool:
        return self.category == SANDBOX_UNAVAILABLE or (self.category == TIMEOUT and self.wall)


class RaisedInSandbox(Exception):
    """The reward function raised inside the sandbox: ``error_type`` is its exception's class
    name, the message its message, ``transient`` whether it said the failure may pass
    (``reef_stream.api.rewards.is_transient``); the exception object never crosses the pipe."""

    def __init__(self, error_type: str, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.error_type, self.transient = error_type, transient


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed call (``setrlimit`` in the call's process, before the
    reward function runs; inherited by anything it forks).

    ``cpu_s``: CPU seconds (RLIMIT_CPU; SIGXCPU, then SIGKILL a second later). ``memory_mb``:
    address space beyond what the worker had mapped at the fork (RLIMIT_AS; the worker's own
    imports are not counted against the reward), and, where the call has a cgroup
    (``reef_stream.consumers.reward.sandbox.cgroups``), the memory of all its processes and
    its tmp files together (past it the OOM killer: ``memory``). ``file_mb``: the largest
    file it may write (RLIMIT_FSIZE; writing more fails with EFBIG) and the size of each of
    its private tmp mounts. ``open_files``: RLIMIT_NOFILE.
    ``processes``: RLIMIT_NPROC, counted per user: a worker started as root runs each call
    as an unprivileged user of its own (``SandboxPool``'s ``uid_base``), so the count is the
    call's; otherwise it is added to the processes the user already runs; and the cgroup's
    ``pids.max``.
    """

    cpu_s: int = 10
    memory_mb: int = 1024
    file_mb: int = 64
    open_files: int = 256
    processes: int = 64

    def problems(self) -> list[str]:
        return [f"sandbox limit {name} must be at least 1, not {value}"
                for name, value in vars(self).items() if not (isinstance(value, int) and value >= 1)]


def signal_name(number: int) -> str:
    """``SIGSEGV`` for 11; ``signal 99`` for a number with no name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
