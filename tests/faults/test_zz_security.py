"""Security properties, end to end. This file runs last on purpose: its log scan reads
every log the fault suite wrote, and the logs of every end-to-end run since the fault suite
last ran (on a clean clone, all of `make test`'s; otherwise at least the newest run's).

- permit tokens and idempotency keys are stored only hashed;
- the admin and the filter credentials are separate, and must differ;
- the permit header never reaches the upstream; under the default config neither does the
  client's raw idempotency key;
- no permit token, idempotency key, receipt body or round capability appears in any log.

Constant-time comparison is a code property, not tested by timing: `ledger/src/token.rs`
(`token_matches`, `secrets_equal`) compares with `subtle::ConstantTimeEq`.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.faults.fault_stack import HISTORIES, SCENARIOS, SECRETS, new_key
from tests.support.mcp_raw import KEY_META
from tests.support.stack import ROOT, free_port, ledger_binary

TOKEN_RE = re.compile(r"atmp_pmt_[0-9a-f]{24}_[0-9a-f]{64}")
# Keys the end-to-end suites use (`key-<uuid4>`, the seed's task keys) and ours (`fk-<hex>`).
KEY_RES = [re.compile(r"key-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"),
           re.compile(r"\bfk-[0-9a-f]{32}\b"), re.compile(r"task-4417-pay")]
# Receipt bodies: the example server's and the recording upstream's tool results.
RECEIPT_RES = [re.compile(r"executions=\d+"), re.compile(r"nonce=[0-9a-f]{12}"), re.compile(r"paid invoice")]


@pytest.fixture(scope="module")
def sec(log_dir, data_root):
    from tests.faults.fault_stack import FaultStack
    s = FaultStack("security", log_dir, data_root).start()
    yield s
    s.stop()


def test_tokens_and_keys_are_hashed_at_rest(sec):
    p = sec.permit({"pay": 5})
    key_header, key_meta = new_key(), new_key()
    assert sec.call(p, "pay", {"invoice": "at-rest"}, key_header).outcome == "ok"
    from tests.support.history import Permit  # noqa: F401
    r = sec.history.call(sec.url, p, "pay", {"invoice": "at-rest-meta"}, None)
    assert r.outcome == "ok"
    import tests.support.mcp_raw as raw
    c = raw.RawMcp(sec.url)
    try:
        assert c.call("pay", {"invoice": "meta"}, p.token, key_meta, key_via="meta").status_code == 200
    finally:
        c.close()
    SECRETS["key"].add(key_meta)
    blobs = b"".join(f.read_bytes() for f in Path(sec.data_dir).iterdir() if f.is_file())
    for secret in (p.token, key_header, key_meta):
        assert secret.encode() not in blobs, f"{secret[:12]}… stored in clear"
    rows = sec.rows()
    assert hashlib.sha256(key_header.encode()).hexdigest() in {r["key_hash"] for r in rows}
    assert hashlib.sha256(p.token.encode()).hexdigest().encode() in blobs


def test_admin_and_service_credentials_are_separate(sec):
    led = sec.ledger

    def status(method, path, token, body=None):
        # One connection per request: the ledger may answer 401 before a POST's body has
        # arrived and then close the connection, so a reused one can fail under load.
        headers = {"content-type": "application/json"}
        if token is not None:
            headers["authorization"] = f"Bearer {token}"
        base = led.admin_url if path.startswith("/admin") else led.url
        with httpx.Client(timeout=5, verify=led.http_verify) as c:
            return c.request(method, base + path, headers=headers,
                             content=json.dumps(body) if body else None).status_code

    authorize = {"permit_token": "atmp_x", "tool": "pay", "fingerprint": "0" * 64, "arguments": {}}
    assert status("POST", "/v1/authorize", led.admin_token, authorize) == 401
    assert status("POST", "/v1/outcomes", led.admin_token, {"reports": []}) == 401
    assert status("POST", "/v1/authorize", None, authorize) == 401
    assert status("POST", "/v1/authorize", led.service_token, authorize) == 200
    assert status("GET", "/admin/v1/permits", led.service_token) == 401
    assert status("POST", "/admin/v1/permits", led.service_token, {"label": "x", "expires": "1h"}) == 401
    assert status("GET", "/admin/v1/attempts", None) == 401
    assert status("GET", "/admin/v1/permits", led.admin_token) == 200
    # The ledger refuses to run with one token for both.
    same_token = "same-token-for-both-of-32-bytes-or-more"
    same = subprocess.run([str(ledger_binary()), "ledger", "--listen", f"127.0.0.1:{free_port()}",
                           "--admin-listen", f"127.0.0.1:{free_port()}", "--data-dir", str(sec.data_dir) + "-same"],
                          env={"ATMOST_SERVICE_TOKEN": same_token, "ATMOST_ADMIN_TOKEN": same_token,
                               "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=20)
    assert same.returncode != 0 and "--admin-token must differ from --service-token" in same.stderr
    assert same_token not in same.stdout + same.stderr


def test_permit_header_never_reaches_the_upstream(sec):
    p = sec.permit()
    sec.call(p, "echo", {"text": "hi"})
    with httpx.Client(timeout=5) as c:
        for body in ({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}},
                     {"jsonrpc": "2.0", "method": "notifications/initialized"}):
            c.post(sec.url, json=body, headers={"atmost-permit": p.token, "accept": "application/json, text/event-stream"})
        c.get(sec.url, headers={"atmost-permit": p.token, "ATMOST-PERMIT": p.token})
    assert sec.upstream.requests
    for q in sec.upstream.requests:
        assert all(k != "atmost-permit" for k, _ in q["headers"]), q
        assert p.token not in json.dumps(q)


def test_upstream_sees_only_the_derived_key_from_the_header(sec):
    p = sec.permit()
    key = new_key()
    sec.call(p, "pay", {"invoice": "hdr"}, key)
    [e] = [e for e in sec.upstream.snapshot() if e["arguments"] == {"invoice": "hdr"}]
    assert key not in json.dumps(e)
    assert e["upstream_key"] and len(e["upstream_key"]) == 64


def test_upstream_never_sees_the_raw_key_sent_in_meta(sec):
    p = sec.permit()
    key = new_key()
    import tests.support.mcp_raw as raw
    c = raw.RawMcp(sec.url)
    try:
        r = c.call("pay", {"invoice": "meta-raw"}, p.token, key, key_via="meta")
    finally:
        c.close()
    SECRETS["key"].add(key)
    assert r.status_code == 200
    [e] = [e for e in sec.upstream.snapshot() if e["arguments"] == {"invoice": "meta-raw"}]
    assert KEY_META and key not in e["body"], "the raw key reached the upstream in params._meta"
    # In its place the body carries the same derived key as the header.
    assert json.loads(e["body"])["params"]["_meta"][KEY_META] == e["upstream_key"]


# Logs that are a stand-in tool's own record of the calls it ran (tests/support/h2_upstream.mjs
# writes its executions and the streams it sent there, and the suites read them back): they hold
# what a tool receives and answers by design (JSON-RPC ids, its receipts), not what the gateway
# or the ledger wrote.
TOOL_RECORDS = ("h2-upstream",)


def _end_to_end_runs(log_dir: Path) -> list[Path]:
    """The end-to-end runs' log directories made since the fault suite last ran: all three of
    `make test` (the full suite and the two deployment forms) on a clean clone. Without one
    since, the newest, so a second fault run in a row still reads one."""
    root = ROOT / ".run" / "test-logs"
    dirs = sorted((d for d in root.iterdir() if d.is_dir() and d.name != log_dir.name),
                  key=lambda d: d.stat().st_mtime) if root.exists() else []
    faults = [d for d in dirs if d.name.startswith("faults-")]
    runs = [d for d in dirs if not d.name.startswith("faults-")]
    since = faults[-1].stat().st_mtime if faults else 0.0
    return [d for d in runs if d.stat().st_mtime > since] or runs[-1:]


def _logs_to_scan(log_dir: Path) -> list[Path]:
    files = [f for f in log_dir.iterdir() if f.is_file()]
    for run in _end_to_end_runs(log_dir):
        # A run's logs, or its workers' directories of logs.
        files += [f for f in run.rglob("*") if f.is_file()]
    return [f for f in files if not f.name.startswith(TOOL_RECORDS)]


def test_no_token_key_or_receipt_body_in_any_log(log_dir):
    files = _logs_to_scan(log_dir)
    assert any(f.name.startswith("ledger") for f in files) and any(f.name.startswith("envoy") for f in files)
    exact = {s for kind in ("token", "key", "receipt") for s in SECRETS[kind] if len(s) >= 12}
    if len(HISTORIES) >= 10:  # the whole suite ran, not one file of it
        assert len(SECRETS["token"]) >= 5 and len(SECRETS["key"]) >= 20, {k: len(v) for k, v in SECRETS.items()}
    leaks = []
    for f in files:
        text = f.read_text(errors="replace")
        for s in exact:
            if s in text:
                leaks.append(f"{f.name}: {s[:16]}…")
        # A round's capability travels only in the ledger's answers and the filter's reports;
        # a log that shows either body shows it.
        if '"capability":"' in text or '"capability": "' in text:
            leaks.append(f"{f.name}: a round's capability")
        for rx in [TOKEN_RE, *KEY_RES, *RECEIPT_RES]:
            m = rx.search(text)
            if m:
                leaks.append(f"{f.name}: pattern {rx.pattern} → {m.group(0)[:24]}…")
    assert not leaks, "secrets in logs:\n" + "\n".join(sorted(set(leaks))[:30])


def test_every_history_was_checked(request):
    """A guard over the whole session: every fault scenario that ran (each test using the
    `fault_stack` fixture) had at least one of its histories checked, and the checker saw
    calls. Runs last. A session that selected no fault scenario (this file alone) has nothing
    to guard: that is a skip, which fails the run in CI (tests/conftest.py), where the whole
    suite always runs."""
    scenarios = [item.nodeid for item in request.session.items if "fault_stack" in item.fixturenames]
    if not scenarios:
        pytest.skip("no fault scenario was selected in this session: nothing to guard")
    counts = {}
    for nodeid in scenarios:
        histories = SCENARIOS.get(nodeid, [])
        counts[nodeid] = (sum(1 for h in histories if h.checks), len(histories),
                          sum(len(h.calls) for h in histories if h.checks))
    unchecked = [f"{nodeid}: {checked} of {built} histories checked" for nodeid, (checked, built, _) in counts.items()
                 if checked == 0]
    assert not unchecked, "fault scenarios whose histories the checker never ran:\n" + "\n".join(unchecked)
    assert all(calls > 0 for _, _, calls in counts.values()), counts
