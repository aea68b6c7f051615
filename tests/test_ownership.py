"""Swap directories belong to one live process: what a dead one left is reclaimed, a live one's never."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import child_script

import tierstore as ts
from tierstore import _ownership
from tierstore.tools.cli import main as cli_main

CHILD = child_script("owner_child.py")


def _start(path: str, steps: int) -> tuple[subprocess.Popen, str]:
    """A training process with its store under ``path``, once it has printed ``steps`` steps."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, CHILD, path], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stdout is not None
    directory = proc.stdout.readline().split()[1]
    for _ in range(steps):
        line = proc.stdout.readline()
        assert line.startswith("step"), line + proc.stderr.read()  # type: ignore[union-attr]
    return proc, directory


def _stop(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> int:
    proc.send_signal(sig)
    proc.communicate(timeout=60)
    return proc.returncode


def _swap_dirs(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if "tierstore" in n)


@pytest.mark.parametrize("steps", [0, 3])
def test_a_killed_process_leaves_space_that_the_next_store_reclaims(nvme_dir, steps):
    proc, directory = _start(nvme_dir, steps)
    _stop(proc)
    assert os.path.isdir(directory)  # SIGKILL: nothing ran in the dying process
    with pytest.warns(UserWarning, match=r"removed 1 directory left by processes that are gone, [\d.]+ MiB freed"):
        store = ts.TierStore(nvme_path=nvme_dir)
    assert not os.path.exists(directory)
    assert _swap_dirs(nvme_dir) == [os.path.basename(store.swap_directory)]
    store.close()
    assert _swap_dirs(nvme_dir) == []


@pytest.mark.parametrize("steps", [0, 3])
def test_sigterm_removes_the_swap_directory_and_still_kills(nvme_dir, steps):
    proc, directory = _start(nvme_dir, steps)
    assert _stop(proc, signal.SIGTERM) == -signal.SIGTERM
    assert _swap_dirs(nvme_dir) == []


def test_a_live_stores_directory_is_never_touched(nvme_dir):
    proc, directory = _start(nvme_dir, 1)
    try:
        with ts.TierStore(nvme_path=nvme_dir) as store:  # no warning: nothing to reclaim
            assert os.path.isdir(directory) and _ownership.reclaim_swap(nvme_dir) == []
            assert set(_swap_dirs(nvme_dir)) == {os.path.basename(directory), os.path.basename(store.swap_directory)}
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("step")  # still training
    finally:
        _stop(proc)
    assert [r.path for r in _ownership.reclaim_swap(nvme_dir)] == [directory]


def test_directories_without_a_lock_go_only_when_quiet(nvme_dir):
    old = os.path.join(nvme_dir, "tierstore-legacy1")  # as an older version left them
    os.mkdir(old)
    with open(os.path.join(old, "swap-0000.bin"), "wb") as f:
        f.write(b"x" * 8192)
    assert _ownership.reclaim_swap(nvme_dir) == []  # written a moment ago: it may have a live writer
    quiet = time.time() - _ownership.STALE_SECONDS - 5
    os.utime(os.path.join(old, "swap-0000.bin"), (quiet, quiet))
    os.utime(old, (quiet, quiet))
    assert [r.path for r in _ownership.reclaim_swap(nvme_dir)] == [old]
    other = os.path.join(nvme_dir, "not-ours")
    os.mkdir(other)
    os.utime(other, (quiet, quiet))
    assert _ownership.reclaim_swap(nvme_dir) == [] and os.path.isdir(other)


def test_gc_command_reports_what_it_freed(nvme_dir, capsys):
    proc, directory = _start(nvme_dir, 1)
    _stop(proc)
    assert cli_main(["gc", nvme_dir]) == 0
    assert "removed 1 directory" in capsys.readouterr().out and not os.path.exists(directory)
    assert cli_main(["gc", "--nvme-path", nvme_dir]) == 0  # as every command that touches the drive takes it
    assert "nothing to reclaim" in capsys.readouterr().out
    assert cli_main(["gc", nvme_dir, "--nvme-path", nvme_dir + "x"]) == 2
    assert "two paths given" in capsys.readouterr().err


def test_a_directory_that_goes_while_being_looked_at_is_not_reclaimed(nvme_dir):
    """Two stores starting together on one path (two ranks): one may see the other's directory under its
    hidden name, before its lock exists, and find it renamed a moment later; that is a live owner, not an error."""
    gone = os.path.join(nvme_dir, ".tierstore-new-abc")
    assert not _ownership.owner_gone(gone)
    stores = [ts.TierStore(nvme_path=nvme_dir) for _ in range(2)]
    try:
        assert len(_swap_dirs(nvme_dir)) == 2
    finally:
        for s in stores:
            s.close()


def _make_and_reclaim(base: str, n: int) -> int:
    """Make, reclaim and remove swap directories ``n`` times; the number of failures."""
    import shutil

    failures = 0
    for _ in range(n):
        try:
            _ownership.reclaim_swap(base)
            directory, fd = _ownership.make_swap_directory(base)
            failures += not os.path.isdir(directory)
            # Removed before its lock is let go, as a store does: once unlocked it is anyone's to reclaim.
            shutil.rmtree(directory)
            _ownership.unlock(directory, fd)
        except OSError:
            failures += 1
    return failures


def test_processes_making_and_reclaiming_directories_together_never_take_a_live_one(nvme_dir):
    """A directory being made gets its lock file already locked (made under a name of its own, locked, then
    linked in): another process reclaiming never finds it unlocked and removes it under its maker."""
    import multiprocessing

    # Spawned, not forked: a fork of this process while other threads hold locks (torch's, tqdm's monitor that
    # importing dynamo starts) can leave a child waiting on one forever, and the pool with it.
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        assert pool.starmap_async(_make_and_reclaim, [(nvme_dir, 300)] * 4).get(timeout=240) == [0, 0, 0, 0]
    assert os.listdir(nvme_dir) == []


def test_a_lock_file_left_half_made_is_reclaimed(tmp_path):
    """Killed between making a staging directory's lock file and linking it in: the file goes at the next save."""
    left = tmp_path / "c.tmp-abc.lock.new-xyz"
    left.write_text("{}")
    held = tmp_path / "c.tmp-def.lock.new-uvw"
    held.write_text("{}")
    fd = os.open(held, os.O_RDWR)
    import fcntl

    fcntl.flock(fd, fcntl.LOCK_EX)  # one its maker still holds
    try:
        assert _ownership.reclaim(str(tmp_path), ("c.tmp-",), beside=True) == []
        assert not left.exists() and held.exists()
    finally:
        os.close(fd)
