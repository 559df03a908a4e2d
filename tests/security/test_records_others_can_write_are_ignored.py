"""The supervisor's module record is held to the ownership rule the
daemon applies to paths it reads as root; names in it are modules a root supervisor
imports."""

from __future__ import annotations

import os

from helpers import NOBODY, root_only

from weightcache.engine import read_record

from ._util import public_dir

pytestmark = root_only


def test_a_record_someone_else_can_write_is_ignored(capsys):
    """read_record trusted whatever owned the file: a record in a directory another uid can
    write chose which modules a root supervisor imports."""
    mine = public_dir("wcrec-")
    (mine / "rec.txt").write_text("json\n")
    assert read_record(mine / "rec.txt") == ["json"]  # root's file in root's directory

    theirs = public_dir("wcrec-")
    os.chown(theirs, NOBODY, NOBODY)  # a tenant's directory: it can swap the file at will
    (theirs / "rec.txt").write_text("evil_module\n")
    assert read_record(theirs / "rec.txt") == []
    assert f"can be changed by uid {NOBODY}" in capsys.readouterr().err  # /tmp, whose entry is the tenant's

    (mine / "planted.txt").write_text("evil_module\n")
    os.chown(mine / "planted.txt", NOBODY, NOBODY)  # a file of someone else's
    assert read_record(mine / "planted.txt") == []
    os.chown(mine / "planted.txt", 0, 0)
    os.chmod(mine / "planted.txt", 0o666)  # or one anyone may write
    assert read_record(mine / "planted.txt") == []
    os.symlink(theirs / "rec.txt", mine / "link.txt")  # or a link to one
    assert read_record(mine / "link.txt") == []


def test_a_record_the_engine_writes_is_read_back_under_a_loose_umask():
    """Under umask 002 the engine wrote its record group-writable (0o666 & ~umask), and
    the next start ignored it as a record others could change."""
    from weightcache.engine import write_record

    mine = public_dir("wcrec-")
    old = os.umask(0o002)
    try:
        write_record(mine / "rec.txt", ["json", "email"])
    finally:
        os.umask(old)
    assert os.stat(mine / "rec.txt").st_mode & 0o777 == 0o644
    assert read_record(mine / "rec.txt") == ["json", "email"]
