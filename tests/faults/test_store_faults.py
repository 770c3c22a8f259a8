"""The embedded store's disk fails: full, read-only, or not a directory at all.

The ledger must fail closed (the filter denies `gateway_unavailable`, nothing is sent) and
recover when the disk does, with every completed receipt intact. A full or read-only disk
needs a filesystem of its own: a small tmpfs mounted for the test (the suite runs as root
in CI; where `mount` is not permitted those two scenarios are skipped and the
"data dir is a file" scenario still runs).
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.faults.fault_stack import new_key
from tests.faults.test_ledger_faults import LOAD_CODES, first_ok
from tests.support.stack import Process, http_get, wait_until

STORE_CODES = LOAD_CODES


def mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
                       capture_output=True, timeout=10)
    return r.returncode == 0


def umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=10)


def fill(path: Path, limit_bytes: int = 64 * 1024 * 1024) -> int:
    """Writes a filler file until the filesystem is full (bounded); returns bytes written."""
    written = 0
    chunk = b"\0" * 65536
    with open(path, "wb", buffering=0) as f:
        while written < limit_bytes:
            try:
                written += f.write(chunk)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                break
        # Fill the last partial blocks too.
        for size in (4096, 512, 1):
            while True:
                try:
                    written += f.write(b"\0" * size)
                except OSError:
                    break
    return written


def start_ledger_unready(s, within: float = 5.0) -> str:
    """Starts the ledger process without waiting for readiness; returns "exited" or "unready"."""
    Process.start(s.ledger)
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not s.ledger.alive():
            return "exited"
        try:
            if http_get(s.ledger.url + "/readyz", timeout=0.5)[0] == 200:
                return "ready"
        except OSError:
            pass
        time.sleep(0.1)
    return "unready"


@pytest.fixture
def tmpfs_dir(data_root):
    path = data_root / f"tmpfs-{time.monotonic_ns()}"
    if not mount_tmpfs(path, "3m"):
        pytest.skip("mount -t tmpfs is not permitted here")
    yield path
    umount(path)


def test_full_data_dir_fails_closed_and_recovers(fault_stack, tmpfs_dir):
    s = fault_stack("disk-full", data_dir=tmpfs_dir / "ledger")
    try:
        p = s.permit({"pay": 10})
        done_key, done_args = new_key(), {"invoice": "before-full", "amount": 1}
        assert s.call(p, "pay", done_args, done_key).outcome == "ok"
        filler = tmpfs_dir / "filler"
        assert fill(filler) > 0
        full_at = time.monotonic()
        answers = [s.call(p, "pay", {"invoice": f"full-{i}", "amount": 1}) for i in range(4)]
        s.history.expect_window("disk full", full_at, time.monotonic(), {"gateway_unavailable"})
        assert all((a.outcome, a.code) == ("denied", "gateway_unavailable") for a in answers), \
            [(a.outcome, a.code) for a in answers]
        assert s.upstream.count("pay") == 1
        # An outage, not a bug: logged as the store being unavailable, with the cause.
        log = s.ledger.log_text()
        assert '"message":"store unavailable"' in log and "disk is full" in log
        assert '"bug":true' not in log
        filler.unlink()
        assert first_ok(s, p, "pay", {"invoice": "after-full", "amount": 1}).outcome == "ok"
        s.probe_all()
        s.verify(allowed_codes=STORE_CODES)
        assert any(r.key == done_key and r.phase == "probe" and r.replayed for r in s.history.calls)
    finally:
        s.ledger.stop()


def test_read_only_data_dir_fails_closed_and_recovers(fault_stack, tmpfs_dir):
    s = fault_stack("disk-ro", data_dir=tmpfs_dir / "ledger")
    try:
        p = s.permit({"pay": 10})
        done_key, done_args = new_key(), {"invoice": "before-ro", "amount": 1}
        assert s.call(p, "pay", done_args, done_key).outcome == "ok"
        s.ledger.stop()
        r = subprocess.run(["mount", "-o", "remount,ro", str(tmpfs_dir)], capture_output=True, timeout=10)
        assert r.returncode == 0, r.stderr
        ro_at = time.monotonic()
        state = start_ledger_unready(s)
        assert state in ("exited", "unready"), "the ledger came up ready on a read-only store"
        answers = [s.call(p, "pay", {"invoice": f"ro-{i}", "amount": 1}) for i in range(3)]
        s.history.expect_window("read-only store", ro_at, time.monotonic(), {"gateway_unavailable"})
        assert s.upstream.count("pay") == 1
        s.ledger.stop()
        r = subprocess.run(["mount", "-o", "remount,rw", str(tmpfs_dir)], capture_output=True, timeout=10)
        assert r.returncode == 0, r.stderr
        s.ledger.start()
        assert first_ok(s, p, "pay", {"invoice": "after-ro", "amount": 1}).outcome == "ok"
        s.probe_all()
        s.verify(allowed_codes=STORE_CODES)
        assert any(r.key == done_key and r.phase == "probe" and r.replayed for r in s.history.calls)
        assert all(a.code == "gateway_unavailable" for a in answers)
    finally:
        s.ledger.stop()


def test_data_dir_that_is_a_file_fails_closed(fault_stack, data_root):
    """Runs everywhere (no mount needed): the store cannot open, the ledger does not serve."""
    bogus = data_root / f"not-a-dir-{time.monotonic_ns()}"
    bogus.write_text("this is a file, not a directory\n")
    s = fault_stack("data-dir-file", start_ledger=False, data_dir=bogus)
    state = start_ledger_unready(s)
    assert state in ("exited", "unready"), state
    p_token = "atmp_pmt_000000000000000000000000_" + "0" * 64
    from tests.faults.history import Permit
    fake = Permit(id="pmt_000000000000000000000000", token=p_token, caps={})
    s.permits.append(fake)
    answers = [s.call(fake, "pay", {"invoice": f"nodir-{i}", "amount": 1}) for i in range(3)]
    assert all((a.outcome, a.code) == ("denied", "gateway_unavailable") for a in answers), answers
    assert s.upstream.count() == 0
    log = s.ledger.log_text()
    assert str(bogus.name) in log or "data" in log.lower(), log[-2000:]
    s.ledger.stop()
    wait_until(lambda: not s.ledger.alive(), 5, "the ledger to stop")
