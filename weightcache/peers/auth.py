"""Peers prove a shared secret before any frame is decoded.

Note [peer authentication]
--------------------------
The peer port is TCP: a source address proves nothing (any local process of any uid, or
any host on the network, can connect from an address in the list). So each connection
starts with an HMAC-SHA256 challenge and response in both directions, in fixed-size raw
bytes, before the first msgpack frame:

1. the lender (the side that accepted) sends ``MAGIC`` and a fresh 32-byte nonce ``ns``;
2. the asker sends its own fresh nonce ``nc`` and HMAC(key, ASKER + ns + nc);
3. the lender checks it against every key it accepts (``hmac.compare_digest``), closes
   the connection if none matches, else sends HMAC(key, LENDER + nc + ns);
4. the asker checks that against every key it accepts.

Each side signs with its first key and accepts any key of its file (a rotation: docs/
deployment.md, "Peers"). The labels make a proof of one side useless as the other's
(no reflection); each side's fresh nonce makes an old proof useless (no replay). What it
does not give: secrecy or per-frame integrity of what follows (the control frames are
not encrypted; a lend's bytes are checked against this daemon's own fingerprint before
they are served, fill.py), nor any protection from a host that holds the key.

The key file (``[peers] secret_file``) must be owned by the daemon's uid and give no
access to others; each non-empty line is a key of at least MIN_KEY bytes (e.g. ``openssl
rand -hex 32``). It is read again when it changes (a Kubernetes Secret is updated in
place), at most once a second.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import secrets
import stat
import threading
import time

from ..errors import ConfigError

MAGIC = b"WCPEER1\n"
NONCE = 32
MAC = hashlib.sha256().digest_size
ASKER = b"weightcache peer asker\0"
LENDER = b"weightcache peer lender\0"
MIN_KEY = 32
MAX_KEYS = 4  # current, previous, and room for a rotation's overlap
MAX_FILE = 4096
log = logging.getLogger("weightcache.peers")

HANDSHAKE_TIMEOUT_S = 5.0
RECHECK_S = 1.0


class NotAuthenticated(Exception):
    """The other side did not prove the shared secret (or broke the handshake). ``strike``:
    it sent a proof that failed, or part of one, or none in time (not: closed at once)."""

    def __init__(self, message: str, strike: bool = True) -> None:
        super().__init__(message)
        self.strike = strike


def read_keys(path: str) -> tuple[bytes, ...]:
    """The keys in ``path`` (first: the one this daemon signs with), or ConfigError saying
    what is wrong with the file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise ConfigError(f"[peers] secret_file {path!r} cannot be opened: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"[peers] secret_file {path!r} is not a regular file")
        if st.st_uid != os.geteuid():
            raise ConfigError(f"[peers] secret_file {path!r} is owned by uid {st.st_uid}, not by the daemon's uid "
                              f"{os.geteuid()}: chown it (a Kubernetes Secret: run the daemon as the file's owner)")
        if st.st_mode & 0o027:
            raise ConfigError(f"[peers] secret_file {path!r} has mode {stat.S_IMODE(st.st_mode):04o}: others may read it or "
                              f"its group may write it; chmod 0600 (a Kubernetes Secret: defaultMode 0400)")
        data = os.read(fd, MAX_FILE + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_FILE:
        raise ConfigError(f"[peers] secret_file {path!r} is longer than {MAX_FILE} bytes: one key per line, at most {MAX_KEYS}")
    keys = tuple(line.strip() for line in data.splitlines() if line.strip())
    if not keys:
        raise ConfigError(f"[peers] secret_file {path!r} holds no key (one per line; e.g. `openssl rand -hex 32`)")
    if len(keys) > MAX_KEYS:
        raise ConfigError(f"[peers] secret_file {path!r} holds {len(keys)} keys; at most {MAX_KEYS}")
    short = [i + 1 for i, k in enumerate(keys) if len(k) < MIN_KEY]
    if short:
        raise ConfigError(f"[peers] secret_file {path!r}: the key on line(s) {short} is shorter than {MIN_KEY} bytes "
                          f"(e.g. `openssl rand -hex 32`)")
    return keys


class Secret:
    """The keys of ``[peers] secret_file``, read again when the file changes. A change
    that makes the file unusable keeps the keys last read (logged by the caller)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._keys = read_keys(path)
        self._stamp = self._file_stamp()
        self._checked = time.monotonic()
        self._lock = threading.Lock()
        self.error: str | None = None  # why the file's last change was not taken

    def _file_stamp(self) -> tuple[int, int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def keys(self) -> tuple[bytes, ...]:
        now = time.monotonic()
        if now - self._checked < RECHECK_S:
            return self._keys
        with self._lock:
            self._checked = now
            stamp = self._file_stamp()
            if stamp != self._stamp:
                self._stamp = stamp  # one try, and one line, per change of the file
                try:
                    self._keys, self.error = read_keys(self.path), None
                    log.info("peers: read the keys of %s again (%d key(s))", self.path, len(self._keys))
                except ConfigError as exc:
                    self.error = exc.message
                    log.warning("peers: %s; the keys read before are kept", exc.message)
        return self._keys


def _mac(key: bytes, label: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(key, label + a + b, hashlib.sha256).digest()


def _matches(keys: tuple[bytes, ...], label: bytes, a: bytes, b: bytes, got: bytes) -> bool:
    ok = False
    for k in keys:  # every key, whichever matched: the time taken says nothing of which
        ok |= hmac.compare_digest(_mac(k, label, a, b), got)
    return ok


async def challenge(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: Secret | None) -> None:
    """The accepting side's half (Note [peer authentication]); NotAuthenticated unless the
    other side proved a key. Reads exactly NONCE + MAC bytes: nothing is decoded before."""
    if secret is None:
        return
    ns = secrets.token_bytes(NONCE)
    writer.write(MAGIC + ns)
    try:
        async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
            await writer.drain()
            proof = await reader.readexactly(NONCE + MAC)
    except (asyncio.IncompleteReadError, TimeoutError, OSError) as exc:
        silent = isinstance(exc, asyncio.IncompleteReadError) and not exc.partial
        raise NotAuthenticated(f"no proof of the shared secret ({type(exc).__name__})", strike=not silent) from None
    keys = secret.keys()
    nc, mac = proof[:NONCE], proof[NONCE:]
    if not _matches(keys, ASKER, ns, nc, mac):
        raise NotAuthenticated("its proof does not match any key of [peers] secret_file")
    writer.write(_mac(keys[0], LENDER, nc, ns))
    await writer.drain()


async def prove(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: Secret | None) -> None:
    """The connecting side's half (Note [peer authentication]); NotAuthenticated unless the
    lender proved a key too."""
    if secret is None:
        return
    try:
        async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
            head = await reader.readexactly(len(MAGIC) + NONCE)
            if head[: len(MAGIC)] != MAGIC:
                raise NotAuthenticated("the peer did not start the handshake (no [peers] secret_file there, or not a "
                                       "weightcache peer port)")
            ns, nc = head[len(MAGIC):], secrets.token_bytes(NONCE)
            keys = secret.keys()
            writer.write(nc + _mac(keys[0], ASKER, ns, nc))
            await writer.drain()
            mac = await reader.readexactly(MAC)
    except (asyncio.IncompleteReadError, TimeoutError, OSError) as exc:
        raise NotAuthenticated(f"the handshake ended ({type(exc).__name__}): the peer does not accept this daemon's "
                               "key, or is not a weightcache peer port") from None
    if not _matches(keys, LENDER, nc, ns, mac):
        raise NotAuthenticated("the peer's proof does not match any key of [peers] secret_file")
