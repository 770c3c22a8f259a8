"""Named admins against the real binary (docs/ledger.md, "Admins"): a tokens file of two admins
whose lines `atmost admin-token line` made, each accepted on the admin API under its own token
beside the shared `--admin-token`; the file rewritten without one of them, who is then refused
while the other still passes, within the ledger's look at the file about once a second; a
broken file, which leaves the last good admins in force, is logged with its line number and
sets `atmost_admin_tokens_reload_failing` to 1.

Only the ledger runs here: no Envoy, no Wasm module.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import uuid
from pathlib import Path

import httpx

from tests.support.stack import Ledger, ledger_binary, wait_until

ANA = "ana-e2e-admin-token-of-32-bytes-or-more"
BOB = "bob-e2e-admin-token-of-32-bytes-or-more"
# The ledger looks at the file about once a second: ten leave room for a loaded machine.
RELOAD_WAIT_S = 10
GAUGE = "atmost_admin_tokens_reload_failing"


def token_line(name: str, token: str) -> str:
    """The tokens file's line of `name`, as `atmost admin-token line` prints it."""
    result = subprocess.run([str(ledger_binary()), "admin-token", "line", name], input=token + "\n",
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout


def replace(path: Path, text: str) -> None:
    """Writes the file beside, then renames it over: no look at it sees it half written."""
    beside = path.with_name(path.name + ".new")
    beside.write_text(text)
    os.replace(beside, path)


def permits_status(ledger: Ledger, token: str) -> int:
    """The status of `GET /admin/v1/permits` (the admin API's list of permits) with `token`."""
    r = httpx.get(ledger.admin_url + "/admin/v1/permits", headers={"authorization": f"Bearer {token}"},
                  timeout=10, verify=ledger.http_verify)
    return r.status_code


def gauge(ledger: Ledger) -> float | None:
    found = re.search(rf"^{GAUGE} (\S+)$", ledger.metrics(), re.M)
    return float(found.group(1)) if found else None


def log_lines(ledger: Ledger, message: str) -> list[dict]:
    lines = []
    for raw in ledger.log_text().splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if line.get("message") == message:
            lines.append(line)
    return lines


def lost_call(ledger: Ledger, admin_token: str) -> str:
    """A permit made by the admin of `admin_token`, and one call under it that was sent and whose
    answer was lost (reported `uncertain`, as its filter would): the attempt's id."""
    with httpx.Client(timeout=10, verify=ledger.http_verify) as http:
        permit = http.post(ledger.admin_url + "/admin/v1/permits", json={"label": "named", "expires": "1h"},
                           headers={"authorization": f"Bearer {admin_token}"})
        assert permit.status_code == 201, permit.text
        service = {"authorization": f"Bearer {ledger.service_token}"}
        d = http.post(ledger.url + "/v1/authorize", headers=service,
                      json={"permit_token": permit.json()["token"], "tool": "pay", "idempotency_key": "k-1",
                            "fingerprint": "fp", "arguments": {}}).json()
        assert d["decision"] == "dispatch", d
        acks = http.post(ledger.url + "/v1/outcomes", headers=service,
                         json={"reports": [{"attempt_id": d["attempt_id"], "round": d["round"],
                                            "capability": d["capability"], "outcome": "uncertain",
                                            "reason": "upstream_reset"}]}).json()
        assert acks == {"acks": ["applied"]}, acks
        return d["attempt_id"]


def test_named_admins_are_read_again_when_their_file_changes(log_dir, data_root, tmp_path):
    lines = {"ana": token_line("ana", ANA), "bob": token_line("bob", BOB)}
    assert lines["ana"].split() == ["ana", hashlib.sha256(ANA.encode()).hexdigest()]
    assert ANA not in lines["ana"]
    tokens = tmp_path / "admin-tokens"
    replace(tokens, "# the ledger's admins\n\n" + lines["ana"] + lines["bob"])
    ledger = Ledger(log_dir, data_root / f"admins-{uuid.uuid4().hex[:8]}", name="named-admins-ledger",
                    tls=False, extra_args=["--admin-tokens-file", str(tokens)])
    ledger.start()
    try:
        # Both named admins (Bob's 200 is the control of his refusal below), and the shared
        # token as the admin `admin`; a token of nobody is refused.
        assert permits_status(ledger, ANA) == 200
        assert permits_status(ledger, BOB) == 200
        assert permits_status(ledger, ledger.admin_token) == 200
        assert permits_status(ledger, "nobody-e2e-admin-token-of-32-bytes-or-more") == 401
        assert gauge(ledger) == 0
        requests = [(line["admin"], line["path"]) for line in log_lines(ledger, "admin request")]
        assert requests == [("ana", "/admin/v1/permits"), ("bob", "/admin/v1/permits"),
                            ("admin", "/admin/v1/permits")]

        # Bob resolves a lost call through the admin API: the body's `by` is kept as he wrote
        # it, and the log names him beside it.
        attempt = lost_call(ledger, BOB)
        resolved = httpx.post(f"{ledger.admin_url}/admin/v1/attempts/{attempt}/resolve",
                              json={"executed": False, "by": "ticket-42", "note": "no charge"},
                              headers={"authorization": f"Bearer {BOB}"}, timeout=10, verify=ledger.http_verify)
        assert resolved.status_code == 200, resolved.text
        assert resolved.json()["attempt"]["resolution"]["by"] == "ticket-42"
        line = wait_until(lambda: log_lines(ledger, "attempt resolved"), RELOAD_WAIT_S, "the resolution logged")[0]
        assert (line["by"], line["admin"], line["via"]) == ("ticket-42", "bob", "api"), line

        # Bob removed: refused from the ledger's next look at the file on; Ana still passes.
        replace(tokens, lines["ana"])
        wait_until(lambda: permits_status(ledger, BOB) == 401, RELOAD_WAIT_S, "Bob refused once removed")
        assert permits_status(ledger, ANA) == 200
        assert permits_status(ledger, ledger.admin_token) == 200

        # A broken file: reported on the gauge and in the log with its line; Ana still passes,
        # Bob (whom it names again, on its bad line) still does not.
        replace(tokens, lines["ana"] + "bob not-a-sha256\n")
        wait_until(lambda: gauge(ledger) == 1, RELOAD_WAIT_S, f"{GAUGE} at 1 after a broken file")
        assert permits_status(ledger, ANA) == 200
        assert permits_status(ledger, BOB) == 401
        refused = log_lines(ledger, "admin tokens not reloaded: the previous admins stay in force")
        assert len(refused) == 1 and "line 2:" in refused[0]["error"], refused
        assert refused[0]["level"] == "ERROR"

        # A good file again: the gauge back at 0, Bob back.
        replace(tokens, lines["ana"] + lines["bob"])
        wait_until(lambda: gauge(ledger) == 0, RELOAD_WAIT_S, f"{GAUGE} back at 0")
        assert permits_status(ledger, BOB) == 200
        log = ledger.log_text()
        for secret in (ANA, BOB, ledger.admin_token):
            assert secret not in log
    finally:
        ledger.stop()
