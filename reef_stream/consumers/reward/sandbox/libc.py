"""The C library's functions the sandbox calls (``unshare``, ``mount``, ``prctl``), looked up
once, when the worker imports this module: a call's process calls them without building them
again (each page of the worker it writes is copied). Where the C library has no such function
(not Linux), its stand-in fails with ENOSYS, as the system call would, so that importing the
sandbox never fails."""

from __future__ import annotations

import ctypes
import errno
from typing import Any

__all__ = ["mount", "prctl", "unshare"]

_LIBC = ctypes.CDLL(None, use_errno=True)


def _function(name: str) -> Any:
    try:
        return getattr(_LIBC, name)
    except AttributeError:
        def missing(*_: object) -> int:
            ctypes.set_errno(errno.ENOSYS)
            return -1
        return missing


unshare, mount, prctl = _function("unshare"), _function("mount"), _function("prctl")
