"""The embedded store's disk fails: full, read-only, or not a directory at all.

The ledger must fail closed (the filter denies `gateway_unavailable`, nothing is sent),
report the store unavailable with its cause (an outage, not a bug), and recover when the
disk does, with every completed receipt intact.

The faults are injected without mounting anything where the test runs, so the scenarios
run on any Linux machine and never skip:

- full: the running ledger's file-size limit (`RLIMIT_FSIZE`, soft) is lowered to 0, so
  every write to its files fails (`EFBIG`) as on a disk with no room left, and raised back
  to let it write again. The ledger is started ignoring `SIGXFSZ` (the signal such a write
  raises; otherwise it would kill the ledger instead of failing the write) and logs through
  a pipe, which the limit does not cover.
- read-only: the ledger is started in a private mount namespace (an unprivileged user
  namespace, `unshare --user --map-root-user --mount`, or a plain mount namespace when
  user namespaces are refused and the test runs as root) where its data dir is a
  read-only bind mount of itself, with every capability dropped (`setpriv`), so the
  ledger cannot remount it. Nothing changes outside that namespace.
"""

from __future__ import annotations

import functools
import re
import resource
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.faults.fault_stack import new_key
from tests.faults.test_ledger_faults import LOAD_CODES, first_ok
from tests.support.stack import Ledger, Process, http_get, wait_until

STORE_CODES = LOAD_CODES


def metric(ledger: Ledger, name: str, **labels: str) -> float:
    """The sum of one counter's samples whose labels include `labels` (0 when absent)."""
    total = 0.0
    for line in ledger.metrics().splitlines():
        m = re.match(rf"^{re.escape(name)}(?:{{(.*)}})? (\S+)$", line)
        if not m:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def ignored_signals(pid: int) -> int:
    """The SigIgn mask of a process (bit n-1 set: signal n ignored)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^SigIgn:\s*([0-9a-f]+)$", status, re.M).group(1), 16)


def start_logging_through_a_pipe(ledger: Ledger) -> None:
    """Starts the ledger as `Ledger.start` does, but ignoring SIGXFSZ and with its output
    through a pipe copied into its log file: a file-size limit then fails the store's writes
    and leaves its log alone."""
    proc = subprocess.Popen(ledger.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ledger.env,
                            cwd=ledger.cwd, start_new_session=True,
                            # Python ignores SIGXFSZ; keeping that for the child (the default
                            # restores it) is what turns the limit into write errors.
                            restore_signals=False)

    def copy() -> None:
        with open(ledger.log_path, "ab") as log:
            for chunk in iter(lambda: proc.stdout.read1(65536), b""):
                log.write(chunk)
                log.flush()

    threading.Thread(target=copy, daemon=True, name="ledger-log").start()
    ledger.proc = proc
    wait_until(ledger._ready, 20, f"ledger on {ledger.url} (log: {ledger.log_path})")


def set_file_size_limit(pid: int, limit: int) -> None:
    _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit, hard))


@functools.cache
def mount_namespace_flags() -> tuple[str, ...]:
    """`unshare` flags that give a process a mount namespace of its own here."""
    tried = []
    for flags in (("--user", "--map-root-user", "--mount"), ("--mount",)):
        r = subprocess.run(["unshare", *flags, "true"], capture_output=True, text=True, timeout=10)
        if r.returncode == 0:
            return flags
        tried.append(f"unshare {' '.join(flags)}: {r.stderr.strip()}")
    pytest.fail("no private mount namespace for the read-only store: unprivileged user namespaces are "
                "refused here and the test does not run as root (" + "; ".join(tried) + ")")


def read_only_argv(data_dir: Path, argv: list[str]) -> list[str]:
    """`argv` run where `data_dir` is a read-only bind mount of itself, with no capability left."""
    for tool in ("unshare", "setpriv"):
        assert shutil.which(tool), f"{tool} (util-linux) is needed for the read-only store"
    script = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'
    return ["unshare", *mount_namespace_flags(), "sh", "-c", script, "sh", str(data_dir),
            "setpriv", "--bounding-set=-all", "--inh-caps=-all", "--", *argv]


def start_ledger_unready(s, within: float = 5.0) -> str:
    """Starts the ledger process without waiting for readiness; returns "exited", "unready"
    or "ready"."""
    Process.start(s.ledger)
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not s.ledger.alive():
            return "exited"
        try:
            if s.ledger.get("/readyz", timeout=0.5)[0] == 200:
                return "ready"
        except OSError:
            pass
        time.sleep(0.1)
    return "unready"


def test_full_data_dir_fails_closed_and_recovers(fault_stack):
    s = fault_stack("disk-full", start_ledger=False)
    try:
        start_logging_through_a_pipe(s.ledger)
        wait_until(s.envoy.ledgers_healthy, 30, "the ledger healthy in Envoy")
        s.warm()
        pid = s.ledger.proc.pid
        assert ignored_signals(pid) & (1 << (signal.SIGXFSZ - 1)), "the ledger must ignore SIGXFSZ"
        p = s.permit({"pay": 10})
        done_key, done_args = new_key(), {"invoice": "before-full", "amount": 1}
        assert s.call(p, "pay", done_args, done_key).outcome == "ok"
        failures_before = metric(s.ledger, "atmost_store_errors_total", op="authorize")
        log_before = len(s.ledger.log_text())

        set_file_size_limit(pid, 0)
        full_at = time.monotonic()
        answers = [s.call(p, "pay", {"invoice": f"full-{i}", "amount": 1}) for i in range(4)]
        s.history.expect_window("disk full", full_at, time.monotonic(), {"gateway_unavailable"})
        assert all((a.outcome, a.code) == ("denied", "gateway_unavailable") for a in answers), \
            [(a.outcome, a.code) for a in answers]
        assert s.upstream.count("pay") == 1
        # The fault landed in the store: every denied call was an authorize the store could
        # not write, and the ledger lived through it.
        assert s.ledger.alive(), s.ledger.log_text()[-2000:]
        assert metric(s.ledger, "atmost_store_errors_total", op="authorize") - failures_before == len(answers)
        # An outage, not a bug: logged as the store being unavailable, with the cause.
        log = s.ledger.log_text()[log_before:]
        unavailable = [line for line in log.splitlines() if '"message":"store unavailable"' in line]
        assert any('"op":"authorize"' in line and ("disk I/O error" in line or "disk is full" in line)
                   for line in unavailable), log[-3000:]
        assert '"bug":true' not in s.ledger.log_text()

        set_file_size_limit(pid, resource.RLIM_INFINITY)
        assert first_ok(s, p, "pay", {"invoice": "after-full", "amount": 1}).outcome == "ok"
        s.probe_all()
        s.verify(allowed_codes=STORE_CODES)
        assert any(r.key == done_key and r.phase == "probe" and r.replayed for r in s.history.calls)
    finally:
        s.ledger.stop()


def test_read_only_data_dir_fails_closed_and_recovers(fault_stack):
    s = fault_stack("disk-ro")
    try:
        p = s.permit({"pay": 10})
        done_key, done_args = new_key(), {"invoice": "before-ro", "amount": 1}
        assert s.call(p, "pay", done_args, done_key).outcome == "ok"
        s.ledger.stop()
        writable_argv = s.ledger.argv
        s.ledger.argv = read_only_argv(s.data_dir, writable_argv)
        log_before = len(s.ledger.log_text())
        ro_at = time.monotonic()
        state = start_ledger_unready(s)
        assert state == "exited", f"the ledger is {state} on a read-only store"
        answers = [s.call(p, "pay", {"invoice": f"ro-{i}", "amount": 1}) for i in range(3)]
        s.history.expect_window("read-only store", ro_at, time.monotonic(), {"gateway_unavailable"})
        assert all(a.code == "gateway_unavailable" for a in answers)
        assert s.upstream.count("pay") == 1
        # The fault landed: the ledger refused the store it could not write, and said why.
        log = s.ledger.log_text()[log_before:]
        assert s.ledger.proc.returncode == 1, log[-3000:]
        assert f"atmost: store unavailable: the database file {s.data_dir / 'atmost.sqlite3'} is read-only" in log, \
            log[-3000:]
        s.ledger.argv = writable_argv
        s.ledger.start()
        assert first_ok(s, p, "pay", {"invoice": "after-ro", "amount": 1}).outcome == "ok"
        s.probe_all()
        s.verify(allowed_codes=STORE_CODES)
        assert any(r.key == done_key and r.phase == "probe" and r.replayed for r in s.history.calls)
    finally:
        s.ledger.stop()


def test_data_dir_that_is_a_file_fails_closed(fault_stack, data_root):
    """The store cannot open, the ledger does not serve."""
    bogus = data_root / f"not-a-dir-{time.monotonic_ns()}"
    bogus.write_text("this is a file, not a directory\n")
    s = fault_stack("data-dir-file", start_ledger=False, data_dir=bogus)
    state = start_ledger_unready(s)
    assert state == "exited", state
    p_token = "atmp_pmt_000000000000000000000000_" + "0" * 64
    from tests.support.history import Permit
    fake = Permit(id="pmt_000000000000000000000000", token=p_token, caps={})
    s.permits.append(fake)
    answers = [s.call(fake, "pay", {"invoice": f"nodir-{i}", "amount": 1}) for i in range(3)]
    assert all((a.outcome, a.code) == ("denied", "gateway_unavailable") for a in answers), answers
    assert s.upstream.count() == 0
    log = s.ledger.log_text()
    assert s.ledger.proc.returncode == 1, log[-2000:]
    assert f"atmost: store unavailable: cannot create data dir {bogus}" in log, log[-2000:]
