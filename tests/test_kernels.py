"""The C++ kernel's build: a lock left by a build that was killed does not make every later start wait forever."""

from __future__ import annotations

import os
import time

from justapi.kernels import STALE_LOCK_S, _clear_stale_lock


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    lock = tmp_path / "lock"
    lock.write_text("")
    _clear_stale_lock(str(tmp_path))
    assert lock.exists()  # a build may be running
    old = time.time() - STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    _clear_stale_lock(str(tmp_path))
    assert not lock.exists()
    _clear_stale_lock(str(tmp_path))  # no lock: nothing to do
