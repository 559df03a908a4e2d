"""What a peer worker may still do once a lender's UCX has compromised it (lend_worker.py,
Note [a worker is confined]).

Note [a worker is confined]
---------------------------
A worker runs code a peer can reach: UCX serving or reading over TCP. Were that code
compromised, the worker's own address space is all it should hold (the Notes in
lend_worker.py), and the worker must not outlive its kill nor undo what stops it from
writing a piece the daemon already hashed. So, before its NIXL agent starts, each worker
installs a seccomp filter (no new privileges first, as seccomp requires of an
unprivileged process) under which it cannot:

- start a process: fork, vfork, execve, execveat, and clone without CLONE_THREAD fail
  with EPERM (threads still start; clone3, whose flags a filter cannot read, fails with
  ENOSYS, and glibc then creates the thread with clone). A worker's kill therefore ends
  all of it, not only its session (``kill_group``);
- write through a side door: process_vm_writev, ptrace, pidfd_getfd (another
  process's fds: the lend worker stays open to its uid for cross-memory reads), and
  io_uring (whose registered buffers keep write access to pages made read-only after
  they were registered) fail with EPERM.

Calls of another ABI (i386 through int 0x80, x32) kill the process: a filter checks the
numbers of one ABI only. And the fill worker seals (``mseal``, Linux 6.10) each range it
makes read-only, so that it cannot make it writable again, nor unmap and map it anew:
the daemon hashes those pages while the read goes on. It cannot unmap them at the end
either; the daemon kills it before it seals the memfd (FillWorker.read), which ends the
mapping. A write through ``/proc/self/mem`` is refused by the kernel for a read-only
shared mapping. Where the kernel has no mseal, the worker says so at its start and the
daemon logs it: its pages are then read-only but not sealed.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

PR_SET_NO_NEW_PRIVS = 38
SECCOMP_SET_MODE_FILTER = 1
CLONE_THREAD = 0x00010000
X32_BIT = 0x40000000

_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_RET_KILL_PROCESS = 0x80000000
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_JSET = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET = 0x06  # BPF_RET | BPF_K
_NR, _ARCH, _ARG0_LOW = 0, 4, 16  # offsets in struct seccomp_data (little-endian: args[0]'s low word)


class _Abi:
    def __init__(self, audit_arch: int, seccomp: int, mseal: int, clone: int, clone3: int, denied: dict[str, int],
                 x32: bool) -> None:
        self.audit_arch, self.seccomp, self.mseal, self.clone, self.clone3 = audit_arch, seccomp, mseal, clone, clone3
        self.denied, self.x32 = denied, x32


_ABIS = {
    "x86_64": _Abi(0xC000003E, seccomp=317, mseal=462, clone=56, clone3=435, x32=True, denied={
        "fork": 57, "vfork": 58, "execve": 59, "execveat": 322, "ptrace": 101, "process_vm_writev": 311,
        "pidfd_getfd": 438, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427}),
    "aarch64": _Abi(0xC00000B7, seccomp=277, mseal=462, clone=220, clone3=435, x32=False, denied={
        "execve": 221, "execveat": 281, "ptrace": 117, "process_vm_writev": 271,
        "pidfd_getfd": 438, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427}),
}
ABI = _ABIS.get(platform.machine())

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Insn))]


Insn = tuple[int, "str | int", "str | int", int]  # code, jump if true, jump if false (to a label), k


def _program(abi: _Abi) -> list[Insn | str]:
    """The filter: instructions, and the labels (strings) their jumps name."""
    p: list[Insn | str] = [
        (_LD_W_ABS, 0, 0, _ARCH),
        (_JEQ, 0, "kill", abi.audit_arch),
        (_LD_W_ABS, 0, 0, _NR),
    ]
    if abi.x32:
        p.append((_JGE, "kill", 0, X32_BIT))
    p += [(_JEQ, "deny", 0, nr) for nr in abi.denied.values()]
    p += [(_JEQ, "nosys", 0, abi.clone3), (_JEQ, "clone", 0, abi.clone), (_RET, 0, 0, _RET_ALLOW),
          "clone", (_LD_W_ABS, 0, 0, _ARG0_LOW), (_JSET, "allow", "deny", CLONE_THREAD),
          "deny", (_RET, 0, 0, _RET_ERRNO | errno.EPERM),
          "nosys", (_RET, 0, 0, _RET_ERRNO | errno.ENOSYS),
          "allow", (_RET, 0, 0, _RET_ALLOW),
          "kill", (_RET, 0, 0, _RET_KILL_PROCESS)]
    return p


def _assemble(prog: list[Insn | str]) -> list[tuple[int, int, int, int]]:
    """Jumps to labels made relative (BPF jumps forward only, by at most 255)."""
    labels: dict[str, int] = {}
    insns: list[Insn] = []
    for x in prog:
        if isinstance(x, str):
            labels[x] = len(insns)
        else:
            insns.append(x)

    def to(i: int, j: str | int) -> int:
        if isinstance(j, int):
            return j
        off = labels[j] - i - 1
        assert 0 <= off < 256, (j, off)
        return off

    return [(code, to(i, jt), to(i, jf), k) for i, (code, jt, jf, k) in enumerate(insns)]


def confine() -> str | None:
    """Install the worker's seccomp filter (Note [a worker is confined]) for this thread
    and every thread it starts after; call before any other thread starts. Returns None,
    or why it could not (the worker then refuses to start)."""
    if ABI is None:
        return f"no seccomp filter for {platform.machine()}"
    code = _assemble(_program(ABI))
    insns = (_Insn * len(code))(*(_Insn(c, jt, jf, k) for c, jt, jf, k in code))
    prog = _Prog(len(code), insns)
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}"
    if _libc.syscall(ctypes.c_long(ABI.seccomp), ctypes.c_long(SECCOMP_SET_MODE_FILTER), ctypes.c_long(0),
                     ctypes.byref(prog)) != 0:
        return f"seccomp: {os.strerror(ctypes.get_errno())}"
    return None


def seal(addr: int, size: int) -> bool:
    """mseal ``size`` bytes at ``addr`` (page-aligned): their protections and mapping can
    no longer change in this process. False where the kernel has no mseal (ENOSYS)."""
    if ABI is None:
        return False
    if _libc.syscall(ctypes.c_long(ABI.mseal), ctypes.c_ulong(addr), ctypes.c_size_t(size), ctypes.c_ulong(0)) == 0:
        return True
    e = ctypes.get_errno()
    if e == errno.ENOSYS:
        return False
    raise OSError(e, f"mseal: {os.strerror(e)}")


def can_seal() -> bool:
    """Whether this kernel has mseal: a zero-length call (a no-op) answers."""
    if ABI is None:
        return False
    return _libc.syscall(ctypes.c_long(ABI.mseal), ctypes.c_ulong(0), ctypes.c_size_t(0), ctypes.c_ulong(0)) == 0
