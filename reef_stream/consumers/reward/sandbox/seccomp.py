"""A seccomp filter for a sandboxed call's process: system calls that reward code has no use
for, and that reach other processes, create namespaces or widen the kernel's attack surface,
fail with EPERM.

``install`` sets ``no_new_privs`` (a setuid program the call runs gains nothing), then loads
the filter (a classic BPF program built here; no library). It is the last step of the call's
set-up, after the sandbox's own mounts and namespaces, and it is inherited by everything the
call starts. Denied (``DENIED``):

- other processes' memory: ``ptrace``, ``process_vm_readv``/``writev``, ``pidfd_getfd``,
  ``kcmp``;
- namespaces: ``unshare``, ``setns``, and ``clone`` with any ``CLONE_NEW*`` flag (a user
  namespace would make the call root of its own); ``clone3`` fails with ENOSYS, because its
  flags are in memory a filter cannot read, and the C library then falls back to ``clone``;
- mounts (``mount``, ``umount2``, ``pivot_root``, ``chroot``, the new mount API);
- kernel interfaces with a history of exploits and no use in a reward: ``bpf``,
  ``perf_event_open``, ``userfaultfd``, ``io_uring_*``, the key ring (``keyctl``,
  ``add_key``, ``request_key``), ``open_by_handle_at``;
- the machine's state: modules, ``kexec``, ``reboot``, swap, the clock, ``acct``,
  ``quotactl``, ``iopl``/``ioperm``;
- and any system call of another ABI (i386 ``int 0x80``, x32).

x86_64 only (``SUPPORTED``): elsewhere ``install`` raises ``OSError`` before changing
anything, and the worker says so at start (``status``).
"""

from __future__ import annotations

import ctypes
import errno
import platform

from reef_stream.consumers.reward.sandbox import libc

__all__ = ["DENIED", "SUPPORTED", "install", "status"]

SUPPORTED = ("x86_64",)
#: The denied system calls and their x86_64 numbers.
DENIED = {
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_getfd": 438,
    "kcmp": 312, "unshare": 272, "setns": 308, "mount": 165, "umount2": 166,
    "pivot_root": 155, "chroot": 161, "open_tree": 428, "move_mount": 429, "fsopen": 430,
    "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442, "bpf": 321,
    "perf_event_open": 298, "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "keyctl": 250, "add_key": 248, "request_key": 249,
    "open_by_handle_at": 304, "name_to_handle_at": 303, "init_module": 175,
    "finit_module": 313, "delete_module": 176, "kexec_load": 246, "kexec_file_load": 320,
    "reboot": 169, "swapon": 167, "swapoff": 168, "settimeofday": 164, "clock_settime": 227,
    "clock_adjtime": 305, "adjtimex": 159, "acct": 163, "quotactl": 179, "iopl": 172,
    "ioperm": 173, "lookup_dcookie": 212, "fanotify_init": 300, "vhangup": 153,
}
_CLONE, _CLONE3 = 56, 435
#: Every ``CLONE_NEW*`` flag: NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET.
_NAMESPACE_FLAGS = 0x80 | 0x20000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 \
    | 0x20000000 | 0x40000000
_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_BIT = 0x40000000
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
# classic BPF: ld [k] (word, absolute), jeq/jset #k, ret #k
_LD, _JEQ, _JSET, _RET = 0x20, 0x15, 0x45, 0x06
_NR, _ARCH, _ARG0 = 0, 4, 16  # offsets in struct seccomp_data (arg0's low word)


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                ("k", ctypes.c_uint32)]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


def _program() -> list[tuple[int, int, int, int]]:
    eperm, enosys = _RET_ERRNO | errno.EPERM, _RET_ERRNO | errno.ENOSYS
    code = [(_LD, 0, 0, _ARCH), (_JEQ, 1, 0, _AUDIT_ARCH_X86_64), (_RET, 0, 0, eperm),
            (_LD, 0, 0, _NR), (_JSET, 0, 1, _X32_BIT), (_RET, 0, 0, eperm)]
    for number in sorted(DENIED.values()):
        code += [(_JEQ, 0, 1, number), (_RET, 0, 0, eperm)]
    code += [(_JEQ, 0, 1, _CLONE3), (_RET, 0, 0, enosys),
             (_JEQ, 0, 3, _CLONE), (_LD, 0, 0, _ARG0), (_JSET, 0, 1, _NAMESPACE_FLAGS),
             (_RET, 0, 0, eperm),
             (_RET, 0, 0, _RET_ALLOW)]
    return code


_CODE = _program()
#: Built once, in the worker, with the machine's name: each call's process only loads it (two
#: ``prctl``), and writes as few of the worker's pages as it can (each one it writes is copied).
_FILTERS = (_Filter * len(_CODE))(*(_Filter(*row) for row in _CODE))
_PROGRAM = _Program(len(_CODE), _FILTERS)
_PROGRAM_ADDRESS = ctypes.c_void_p(ctypes.addressof(_PROGRAM))
_MACHINE = platform.machine()


def status() -> str:
    """``filtered`` where ``install`` can load the filter (this machine's architecture is
    supported), otherwise why not."""
    return "filtered" if _MACHINE in SUPPORTED else f"not filtered: no table for {_MACHINE}"


def install() -> None:
    """Set ``no_new_privs`` and load the filter into the calling process, for good. Raises
    ``OSError`` when the architecture is not supported or the kernel refuses."""
    if _MACHINE not in SUPPORTED:
        raise OSError(errno.ENOSYS, f"no seccomp table for {_MACHINE}")
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, _PROGRAM_ADDRESS, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")
