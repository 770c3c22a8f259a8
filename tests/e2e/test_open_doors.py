"""The ledger's doors, against the real binary: the admin API and the inbox answer on their own
listener only; `/readyz` is answered from a background store check, so a flood of probes never
reaches the store; failed bearer tokens and sign-ins from one source are answered 429 with
`Retry-After` past the limit, while governed calls through the real gateway (from the same
address, with the right token) keep being decided; tokens shorter than 32 bytes stop the
start with a clear message.

Each test runs its own ledger: the limit counts per source, and every test here is the same
source (127.0.0.1).
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import time
import uuid

import httpx
import pytest

from tests.e2e.conftest import new_key
from tests.support.mcp_raw import RawMcp, result_text
from tests.support.stack import Envoy, Ledger, free_port, ledger_binary, wait_until

# docs/ledger.md, "Failed authentication": the limit, its window, the readiness interval.
MAX_FAILURES = 10
WINDOW_S = 60
READINESS_INTERVAL_S = 1.0


@pytest.fixture
def own_ledger(log_dir, data_root):
    ledger = Ledger(log_dir, data_root / f"doors-{uuid.uuid4().hex[:8]}", name="doors-ledger")
    ledger.start()
    yield ledger
    ledger.stop()


def metric(ledger: Ledger, name: str, labels: str = "") -> float:
    """One sample of the ledger's /metrics (0 when it has none yet)."""
    pattern = rf"^{re.escape(name)}{re.escape(labels)} (\S+)$"
    found = re.search(pattern, ledger.metrics(), re.M)
    return float(found.group(1)) if found else 0.0


def readiness_checks(ledger: Ledger) -> float:
    return sum(metric(ledger, "atmost_readiness_checks_total", f'{{result="{r}"}}') for r in ("ok", "error"))


def test_admin_api_and_inbox_answer_on_their_own_listener_only(own_ledger):
    led = own_ledger
    admin = {"authorization": f"Bearer {led.admin_token}"}
    with httpx.Client(timeout=10, verify=led.http_verify) as c:
        # The API listener: the filter's API and the health checks, no admin door.
        assert c.get(led.url + "/readyz").status_code == 200
        for path in ("/admin/v1/permits", "/admin/", "/admin/sign-in", "/admin"):
            r = c.get(led.url + path, headers=admin)
            assert r.status_code == 404 and r.json()["error"] == "admin_elsewhere", (path, r.text)
        r = c.post(led.url + "/admin/v1/permits", headers=admin, json={"label": "x", "expires": "1h"})
        assert r.status_code == 404 and r.json()["error"] == "admin_elsewhere"
        # The admin listener: the admin API and the inbox, over the same TLS; not the filter's API.
        assert c.get(led.admin_url + "/admin/v1/permits", headers=admin).status_code == 200
        assert c.get(led.admin_url + "/admin/sign-in").status_code == 200
        svc = {"authorization": f"Bearer {led.service_token}"}
        assert c.post(led.admin_url + "/v1/authorize", headers=svc, json={}).status_code == 404
    assert [p["label"] for p in led.cli_json("permit", "list")["permits"]] == []
    # The CLI at the API listener is told where to go.
    wrong = subprocess.run([str(ledger_binary()), "--ledger", led.url, "permit", "list"], capture_output=True,
                           text=True, timeout=30, env={**os.environ, **led.cli_env()})
    assert wrong.returncode == 1 and "admin_elsewhere" in wrong.stderr and "--admin-listen" in wrong.stderr


def test_a_flood_of_readyz_never_reaches_the_store(own_ledger):
    led = own_ledger
    checks_before = readiness_checks(led)
    started = time.monotonic()
    with httpx.Client(timeout=10, verify=led.http_verify) as c:
        codes = [c.get(led.url + "/readyz").status_code for _ in range(2000)]
    elapsed = time.monotonic() - started
    checks = readiness_checks(led) - checks_before
    assert set(codes) == {200}
    # The store was read by the background check only, once a second whatever the probes did:
    # 2000 probes, a few reads.
    assert checks <= elapsed / READINESS_INTERVAL_S + 2, (checks, elapsed)


def test_readiness_is_checked_in_the_background_each_second(own_ledger):
    led = own_ledger
    before = readiness_checks(led)
    wait_until(lambda: readiness_checks(led) >= before + 3, 20, "three background store checks")
    assert metric(led, "atmost_readiness_checks_total", '{result="error"}') == 0


def test_bad_tokens_past_the_limit_get_429_while_governed_calls_keep_being_decided(log_dir, own_ledger,
                                                                                    upstream_proxy, server):
    led = own_ledger
    envoy = Envoy(log_dir, upstream_proxy.port, [led.port], name="doors-envoy",
                  plugin_overrides={"ledger": {"service_token": led.service_token}})
    envoy.start()
    client = RawMcp(envoy.url)
    try:
        permit = led.create_permit("--max-calls", "pay_invoice=1000")
        authorize = {"permit_token": "atmp_x", "tool": "pay", "fingerprint": "0" * 64, "arguments": {}}

        def bad(i: int) -> httpx.Response:
            token = led.admin_token if i % 2 else f"wrong-{uuid.uuid4().hex}"
            with httpx.Client(timeout=10, verify=led.http_verify) as c:
                return c.post(led.url + "/v1/authorize", headers={"authorization": f"Bearer {token}"}, json=authorize)

        def governed(i: int) -> httpx.Response:
            return client.call("pay_invoice", {"invoice": f"INV-doors-{i}", "amount": 1}, permit["token"], new_key())

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            flood = [pool.submit(bad, i) for i in range(200)]
            calls = [governed(i) for i in range(40)]
            refused = [f.result() for f in flood]
        # Every governed call, from the same address as the flood, was decided and dispatched.
        assert all("executions=" in result_text(r) for r in calls), [r.text[:200] for r in calls]
        assert server.executions("pay_invoice") == 40
        codes = [r.status_code for r in refused]
        assert set(codes) == {401, 429} and codes.count(401) == MAX_FAILURES, sorted(set(codes))
        limited = [r for r in refused if r.status_code == 429]
        for r in limited:
            assert r.json()["error"] == "too_many_failures"
            assert 1 <= int(r.headers["retry-after"]) <= WINDOW_S
        assert metric(led, "atmost_auth_failures_limited_total", '{api="service"}') == len(limited)
        # The admin API's refusals count against the same source; the right admin token still passes.
        with httpx.Client(timeout=10, verify=led.http_verify) as c:
            r = c.get(led.admin_url + "/admin/v1/permits", headers={"authorization": "Bearer nope"})
            assert r.status_code == 429 and "retry-after" in r.headers
            r = c.get(led.admin_url + "/admin/v1/permits", headers={"authorization": f"Bearer {led.admin_token}"})
            assert r.status_code == 200
    finally:
        client.close()
        envoy.stop()


def test_failed_sign_ins_past_the_limit_get_429(own_ledger):
    led = own_ledger
    with httpx.Client(base_url=led.admin_url, timeout=10, verify=led.http_verify) as http:
        statuses = []
        for _ in range(MAX_FAILURES + 2):
            page = http.get("/admin/sign-in")
            csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page.text).group(1)
            r = http.post("/admin/sign-in", data={"csrf": csrf, "name": "Mallory", "token": "not-the-admin-token"})
            statuses.append(r.status_code)
        assert statuses == [401] * MAX_FAILURES + [429, 429]
        assert "Too many failed sign-ins" in r.text and 1 <= int(r.headers["retry-after"]) <= WINDOW_S
        # The right token signs in all the same.
        page = http.get("/admin/sign-in")
        csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page.text).group(1)
        r = http.post("/admin/sign-in", data={"csrf": csrf, "name": "Ana Ops", "token": led.admin_token})
        assert r.status_code == 303 and r.headers["location"] == "/admin/"
        assert http.get("/admin/").status_code == 200
    assert metric(led, "atmost_auth_failures_limited_total", '{api="inbox"}') == 2


@pytest.mark.parametrize("which", ["ATMOST_SERVICE_TOKEN", "ATMOST_ADMIN_TOKEN"])
def test_a_token_shorter_than_32_bytes_stops_the_start(tmp_path, which):
    tokens = {"ATMOST_SERVICE_TOKEN": "s" * 40, "ATMOST_ADMIN_TOKEN": "a" * 40}
    tokens[which] = "x" * 31
    flag = {"ATMOST_SERVICE_TOKEN": "--service-token", "ATMOST_ADMIN_TOKEN": "--admin-token"}[which]
    result = subprocess.run([str(ledger_binary()), "ledger", "--listen", f"127.0.0.1:{free_port()}",
                             "--admin-listen", f"127.0.0.1:{free_port()}", "--data-dir", str(tmp_path / "data")],
                            env={**tokens, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert (f"atmost: {flag} ({which}) is 31 bytes long; it must be at least 32 (make one with "
            "`openssl rand -hex 32`)") in result.stderr, result.stderr
    assert "x" * 31 not in result.stdout + result.stderr
    assert not (tmp_path / "data").exists(), "refused before the store is opened"
    # 32 bytes start.
    tokens[which] = "x" * 32
    port = free_port()
    proc = subprocess.Popen([str(ledger_binary()), "ledger", "--listen", f"127.0.0.1:{port}",
                             "--admin-listen", f"127.0.0.1:{free_port()}", "--data-dir", str(tmp_path / "data")],
                            env={**tokens, "PATH": "/usr/bin:/bin", "ATMOST_DRAIN_DELAY": "0s"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: proc.poll() is None and httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200,
                   20, "the ledger with 32-byte tokens")
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_one_address_for_both_listeners_stops_the_start(tmp_path):
    port = free_port()
    result = subprocess.run([str(ledger_binary()), "ledger", "--listen", f"127.0.0.1:{port}",
                             "--admin-listen", f"127.0.0.1:{port}", "--data-dir", str(tmp_path / "data")],
                            env={"ATMOST_SERVICE_TOKEN": "s" * 40, "ATMOST_ADMIN_TOKEN": "a" * 40,
                                 "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and "--admin-listen must differ from --listen" in result.stderr, result.stderr
