"""A peer's groups are those the kernel recorded when it connected (SO_PEERGROUPS): they
do not vanish when the connecting process exits before the accept, and none are cut off
when there are many. Access lists and "gid:N" quotas rest on them."""

from __future__ import annotations

import os
import socket
import time

from helpers import root_only

from weightcache.server.access import Peer

from ._util import OTHER, public_dir

pytestmark = root_only

GROUPS = [4242, 4343]  # supplementary groups of the peer (no group entry needed: setgroups takes any gid)
UID = OTHER


def _connect_then(path: str, hand_over: bool, groups: list[int]) -> None:
    """In a forked child: take ``GROUPS`` and another uid, connect, and (``hand_over``)
    leave the socket to a grandchild and exit at once, before the daemon accepts."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups(groups)
            os.setgid(UID)
            os.setuid(UID)
            c = socket.socket(socket.AF_UNIX)
            c.connect(path)
            if hand_over and os.fork() == 0:
                time.sleep(3)  # the grandchild keeps the connection open
            elif not hand_over:
                time.sleep(3)
        finally:
            os._exit(0)
    if hand_over:
        os.waitpid(pid, 0)


def _accepted_peer(hand_over: bool, groups: list[int] = GROUPS) -> Peer:
    path = str(public_dir("wcgroups-") / "s.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    os.chmod(path, 0o777)
    srv.listen(1)
    srv.settimeout(10)
    try:
        _connect_then(path, hand_over, groups)
        conn, _ = srv.accept()
        with conn:
            return Peer.of(conn)
    finally:
        srv.close()


def test_a_peer_that_exits_before_accept_keeps_its_groups():
    # Groups read from /proc/<pid> after accept are lost when the connecting process has
    # exited (its child holding the socket): a "gid:N" quota then no longer covered the
    # peer's models (fails open), and a recycled pid would lend it another process's groups.
    # The kernel keeps the groups of connect() time with the socket (SO_PEERGROUPS).
    peer = _accepted_peer(hand_over=True)
    assert peer.uid == UID
    assert set(GROUPS) <= peer.groups, peer


def test_a_live_peer_has_its_groups():
    peer = _accepted_peer(hand_over=False)
    assert peer.groups == frozenset({UID, *GROUPS}), peer


def test_a_peer_with_many_groups_has_them_all():
    many = list(range(5000, 5300))  # more than socket.getsockopt can take (256 groups)
    peer = _accepted_peer(hand_over=True, groups=many)
    assert set(many) <= peer.groups
