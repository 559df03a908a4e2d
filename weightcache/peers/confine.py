"""What a peer worker may still do once a lender's UCX has compromised it (lend_worker.py,
Note [a worker is confined]).

Note [a worker is confined]
---------------------------
A worker runs code a peer can reach: UCX serving or reading over TCP. Were that code
compromised, the worker's own address space is all it should hold (the Notes in
lend_worker.py), and it must not outlive its kill, reach other processes, nor change a
piece the daemon already hashed. So, before its NIXL agent starts (while it is the
process's only thread: every later thread inherits all of this), each worker:

- takes no new privileges, and, where it runs as root (65534 could not run the
  interpreter), gives up every capability but CAP_IPC_LOCK: no ``/proc/self/map_files``
  (which reopens a mapping's file writable), no module, no mount; CAP_IPC_LOCK lets RDMA
  registrations pin the lent or landing memory past RLIMIT_MEMLOCK (its only other use,
  SysV shared memory, the filter refuses);
- enters a Landlock domain (Linux 5.13) that handles every file-writing right and grants
  none, but opening the RDMA devices under ``/dev/infiniband`` for writing (UCX's
  InfiniBand and RoCE transports need them; WRITABLE_DEVICES): no file written, created,
  truncated or removed, ``/proc/sys`` included; and,
  whatever the rights, no ptrace access to a process outside the domain, so no
  ``/proc/PID/mem`` write and no ``/proc/PID/fd`` open into another process of its uid
  (the lend worker stays dumpable for cross-memory reads; a root worker would reach the
  daemon); from ABI 6, no signal and no abstract Unix socket outside it either. Since
  UCX's shared-memory transports would create files in /dev/shm, the workers run with
  ``UCX_TLS=^mm`` unless the operator sets UCX_TLS;
- installs a seccomp filter (``_DENIED`` lists each call and why) under which it starts
  no process and enters no namespace (fork, vfork, execve, execveat, unshare, setns, and
  clone without CLONE_THREAD: threads still start; clone3, whose flags a filter cannot
  read, fails with ENOSYS, and glibc then uses clone), so killing it ends all of it;
  writes no other process nor the arena around its read-only mapping (process_vm_writev
  but into itself, ptrace, pidfd_getfd, process_madvise, madvise(MADV_REMOVE), mremap,
  remap_file_pages, userfaultfd, io_uring); touches no SysV IPC object or keyring of its
  uid; changes no file's mode, owner, xattrs or times (which Landlock does not cover);
  and makes no Unix socket (Landlock does not stop a connect to a path socket, the
  daemon's own among them). Calls of another ABI (i386, x32) kill it.

Its output goes through a pipe the daemon relays to its log, bounded, never to the
daemon's own stdout or stderr (a log file there could be written or truncated).

Reads between two daemons of one host. UCX reads a neighbour's memory there with CMA
(``process_vm_readv`` of the lend worker). It offers CMA only where a process_vm_writev of
8 bytes into itself succeeds at start, so the filter lets that call through for the
worker's own pid: it keeps page protections (no FOLL_FORCE), so it writes nothing a
plain store could not, a read-only or sealed range included. And it reads a peer by CMA
only where a ``process_vm_readv`` probe of that peer is not refused, which Landlock does:
a domain has ptrace access only within itself and the domains nested in it, and the fill
worker's is not the lend worker's. So, with Landlock, a fill between two daemons of one
host goes over TCP on loopback (docs/benchmarks.md, "What the confinement costs"); the
filter's presence itself costs it nothing measured.

The fill worker also seals (``mseal``, Linux 6.10) each range it makes read-only, so that
it cannot make it writable again, nor unmap and map it anew, while the daemon hashes it.
It cannot unmap it at the end either; the daemon kills it before it seals the memfd
(FillWorker.read), which ends the mapping. A write through ``/proc/self/mem`` is refused
by the kernel for a read-only shared mapping. Without seccomp the worker does not start;
without Landlock or mseal it starts, and the daemon's log and ``status`` say what is
missing.
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


_ARG2_LOW = 32
MADV_REMOVE = 9
AF_UNIX = 1

# What the filter refuses (EPERM), by what it would let code in the worker do:
_DENIED = {
    # start a process that outlives the worker's kill (clone without CLONE_THREAD below)
    "start": ["fork", "vfork", "execve", "execveat", "unshare", "setns"],
    # write another process (process_vm_writev: any but its own, below), or the arena
    # around its read-only, sealed mapping: process_madvise, mremap (a writable alias of
    # the arena's pages made before a range is sealed outlives the seal: an old_size of
    # 0, or a growing remap),
    # remap_file_pages (a writable page pointed at a sealed file page), io_uring
    # (registered buffers keep write access), userfaultfd (UFFDIO_COPY into the file)
    "write": ["ptrace", "pidfd_getfd", "process_madvise", "mremap", "remap_file_pages",
              "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register"],
    # SysV IPC objects of its uid (root's, for a root worker), and kernel keyrings
    "ipc": ["shmget", "shmat", "shmctl", "shmdt", "semget", "semop", "semctl", "semtimedop", "msgget", "msgsnd",
            "msgrcv", "msgctl", "add_key", "request_key", "keyctl"],
    # file metadata, which Landlock does not cover: modes (setuid bits), owners, xattrs, times
    "metadata": ["chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat", "setxattr",
                 "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr", "setxattrat",
                 "removexattrat", "utime", "utimes", "utimensat", "futimesat"],
}
_NUMBERS = {
    "x86_64": {"fork": 57, "vfork": 58, "execve": 59, "execveat": 322, "unshare": 272, "setns": 308,
               "ptrace": 101, "pidfd_getfd": 438, "process_madvise": 440, "mremap": 25,
               "remap_file_pages": 216, "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
               "io_uring_register": 427, "shmget": 29, "shmat": 30, "shmctl": 31, "shmdt": 67, "semget": 64,
               "semop": 65, "semctl": 66, "semtimedop": 220, "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71,
               "add_key": 248, "request_key": 249, "keyctl": 250, "chmod": 90, "fchmod": 91, "fchmodat": 268,
               "fchmodat2": 452, "chown": 92, "fchown": 93, "lchown": 94, "fchownat": 260, "setxattr": 188,
               "lsetxattr": 189, "fsetxattr": 190, "removexattr": 197, "lremovexattr": 198, "fremovexattr": 199,
               "setxattrat": 463, "removexattrat": 466, "utime": 132, "utimes": 235, "utimensat": 280,
               "futimesat": 261},
    # aarch64 has no fork, vfork, chmod, chown, lchown, utime, utimes, futimesat (the *at forms serve).
    "aarch64": {"execve": 221, "execveat": 281, "unshare": 97, "setns": 268, "ptrace": 117,
                "pidfd_getfd": 438, "process_madvise": 440, "mremap": 216, "remap_file_pages": 234,
                "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
                "shmget": 194, "shmat": 196, "shmctl": 195, "shmdt": 197, "semget": 190, "semop": 193, "semctl": 191,
                "semtimedop": 192, "msgget": 186, "msgsnd": 189, "msgrcv": 188, "msgctl": 187, "add_key": 217,
                "request_key": 218, "keyctl": 219, "fchmod": 52, "fchmodat": 53, "fchmodat2": 452, "fchown": 55,
                "fchownat": 54, "setxattr": 5, "lsetxattr": 6, "fsetxattr": 7, "removexattr": 14,
                "lremovexattr": 15, "fremovexattr": 16, "setxattrat": 463, "removexattrat": 466, "utimensat": 88},
}


class _Abi:
    def __init__(self, machine: str, audit_arch: int, seccomp: int, mseal: int, clone: int, clone3: int, madvise: int,
                 socket: int, socketpair: int, process_vm_writev: int, x32: bool) -> None:
        self.audit_arch, self.seccomp, self.mseal, self.clone, self.clone3 = audit_arch, seccomp, mseal, clone, clone3
        self.madvise, self.socket, self.socketpair, self.x32 = madvise, socket, socketpair, x32
        self.process_vm_writev = process_vm_writev
        nr = _NUMBERS[machine]
        self.denied = {name: nr[name] for names in _DENIED.values() for name in names if name in nr}


_ABIS = {
    "x86_64": _Abi("x86_64", 0xC000003E, seccomp=317, mseal=462, clone=56, clone3=435, madvise=28, socket=41,
                   socketpair=53, process_vm_writev=311, x32=True),
    "aarch64": _Abi("aarch64", 0xC00000B7, seccomp=277, mseal=462, clone=220, clone3=435, madvise=233, socket=198,
                    socketpair=199, process_vm_writev=271, x32=False),
}
ABI = _ABIS.get(platform.machine())

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Insn))]


Insn = tuple[int, "str | int", "str | int", int]  # code, jump if true, jump if false (to a label), k


def _program(abi: _Abi, pid: int) -> list[Insn | str]:
    """The filter of process ``pid``: instructions, and the labels (strings) their jumps name."""
    p: list[Insn | str] = [
        (_LD_W_ABS, 0, 0, _ARCH),
        (_JEQ, 0, "kill", abi.audit_arch),
        (_LD_W_ABS, 0, 0, _NR),
    ]
    if abi.x32:
        p.append((_JGE, "kill", 0, X32_BIT))
    p += [(_JEQ, "deny", 0, nr) for nr in abi.denied.values()]
    p += [(_JEQ, "nosys", 0, abi.clone3), (_JEQ, "clone", 0, abi.clone), (_JEQ, "madvise", 0, abi.madvise),
          (_JEQ, "unix", 0, abi.socket), (_JEQ, "unix", 0, abi.socketpair),
          (_JEQ, "vm_writev", 0, abi.process_vm_writev), (_RET, 0, 0, _RET_ALLOW),
          "clone", (_LD_W_ABS, 0, 0, _ARG0_LOW), (_JSET, "allow", "deny", CLONE_THREAD),
          # MADV_REMOVE punches a hole in a shared mapping's file, read-only and sealed or not.
          "madvise", (_LD_W_ABS, 0, 0, _ARG2_LOW), (_JEQ, "deny", "allow", MADV_REMOVE),
          # No new Unix socket: Landlock does not stop a connect to a path socket (the
          # daemon's own, D-Bus, a container runtime's). The worker's socket to the daemon
          # is inherited.
          "unix", (_LD_W_ABS, 0, 0, _ARG0_LOW), (_JEQ, "deny", "allow", AF_UNIX),
          # Into its own memory only (the kernel reads the pid as an int: the low word is all
          # of it). UCX's CMA transport writes 8 bytes of its own at start and, refused,
          # leaves CMA out, and same-host reads go over TCP (Note [a worker is confined]).
          "vm_writev", (_LD_W_ABS, 0, 0, _ARG0_LOW), (_JEQ, "allow", "deny", pid),
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


class Unconfined(Exception):
    """The worker's seccomp filter could not be installed: it must not start."""


def confine() -> list[str]:
    """Confine this process (Note [a worker is confined]): no new privileges, no
    capabilities where it runs as root, the Landlock domain where the kernel has one,
    then the seccomp filter, for this thread and every thread it starts after; call
    before any other thread starts. Returns the guards in place; raises Unconfined where
    the filter cannot be installed."""
    if ABI is None:
        raise Unconfined(f"no seccomp filter for {platform.machine()}")
    code = _assemble(_program(ABI, os.getpid()))
    insns = (_Insn * len(code))(*(_Insn(c, jt, jf, k) for c, jt, jf, k in code))
    prog = _Prog(len(code), insns)
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise Unconfined(f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}")
    guards = []
    if os.geteuid() == 0:
        _drop_capabilities()
        guards.append("no capabilities but ipc_lock")
    abi = _landlock()
    if abi:
        guards.append(f"landlock {abi}")
    if _libc.syscall(ctypes.c_long(ABI.seccomp), ctypes.c_long(SECCOMP_SET_MODE_FILTER), ctypes.c_long(0),
                     ctypes.byref(prog)) != 0:
        raise Unconfined(f"seccomp: {os.strerror(ctypes.get_errno())}")
    return ["seccomp", *guards]


# Landlock (landlock.h): the file system rights a write takes, by the ABI that added them.
# Reads and execution stay allowed: NIXL loads its plugins once the worker is confined.
_LANDLOCK_CREATE_RULESET, _LANDLOCK_RESTRICT_SELF, _LANDLOCK_VERSION = 444, 446, 1
_FS_WRITE = {1: (1 << 1) | (1 << 4) | (1 << 5) | (1 << 6) | (1 << 7) | (1 << 8) | (1 << 9) | (1 << 10) | (1 << 11)
             | (1 << 12),  # WRITE_FILE, REMOVE_*, MAKE_*
             2: 1 << 13,  # REFER
             3: 1 << 14}  # TRUNCATE
_SCOPE = 1 | 2  # ABI 6: no abstract Unix socket and no signal outside the domain
_LANDLOCK_ADD_RULE, _RULE_PATH_BENEATH, _WRITE_FILE = 445, 1, 1 << 1
# Device files a worker opens read-write to move bytes: the RDMA verbs and connection
# manager devices UCX's InfiniBand/RoCE transports open. The only right granted beneath
# them is opening a file for writing (no file made, removed or renamed there); without it,
# UCX leaves those transports out and reads over TCP.
WRITABLE_DEVICES = ("/dev/infiniband",)


class _Ruleset(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1  # landlock.h's struct landlock_path_beneath_attr is packed
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _landlock() -> int:
    """Enter a Landlock domain: no file written (but the devices of WRITABLE_DEVICES),
    created or removed, and, whatever the rights, no ptrace access (so no /proc/PID/mem,
    /proc/PID/fd) to a process outside it, nor (ABI 6) a signal. Returns the ABI, or 0
    where the kernel has no Landlock."""
    abi = _libc.syscall(ctypes.c_long(_LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0),
                        ctypes.c_uint32(_LANDLOCK_VERSION))
    if abi < 1:
        return 0
    fs = sum(bits for since, bits in _FS_WRITE.items() if abi >= since)
    attr = _Ruleset(fs, 0, _SCOPE if abi >= 6 else 0)
    size = ctypes.sizeof(_Ruleset) if abi >= 6 else 8  # only the fields this ABI knows
    fd = _libc.syscall(ctypes.c_long(_LANDLOCK_CREATE_RULESET), ctypes.byref(attr), ctypes.c_size_t(size),
                       ctypes.c_uint32(0))
    if fd < 0:
        raise Unconfined(f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}")
    try:
        for path in WRITABLE_DEVICES:
            try:
                parent = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:  # not on this host
                continue
            try:
                rule = _PathBeneath(_WRITE_FILE, parent)
                if _libc.syscall(ctypes.c_long(_LANDLOCK_ADD_RULE), ctypes.c_int(fd), ctypes.c_int(_RULE_PATH_BENEATH),
                                 ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
                    raise Unconfined(f"landlock_add_rule {path}: {os.strerror(ctypes.get_errno())}")
            finally:
                os.close(parent)
        if _libc.syscall(ctypes.c_long(_LANDLOCK_RESTRICT_SELF), ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
            raise Unconfined(f"landlock_restrict_self: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)
    return int(abi)


_PR_CAPBSET_DROP, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
CAP_IPC_LOCK = 14  # kept: RDMA registrations pin memory past RLIMIT_MEMLOCK with it


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_capabilities() -> None:
    """A worker that runs as root (where 65534 cannot run the interpreter) keeps uid 0 but
    no capability but CAP_IPC_LOCK: no /proc/self/map_files (CAP_SYS_ADMIN), no module, no
    mount."""
    for cap in range(64):
        if cap == CAP_IPC_LOCK:
            continue
        if _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            if ctypes.get_errno() == errno.EINVAL:  # past the last capability this kernel knows
                break
            raise Unconfined(f"prctl(PR_CAPBSET_DROP, {cap}): {os.strerror(ctypes.get_errno())}")
    _libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    kept = (_CapData * 2)(_CapData(1 << CAP_IPC_LOCK, 1 << CAP_IPC_LOCK, 0))
    if _libc.capset(ctypes.byref(_CapHeader(0x20080522, 0)), kept) != 0:  # _LINUX_CAPABILITY_VERSION_3
        raise Unconfined(f"capset: {os.strerror(ctypes.get_errno())}")


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
