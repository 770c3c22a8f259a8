"""`make run`: the ledger, an MCP server, and Envoy with atmost on 127.0.0.1:10000/mcp.

UPSTREAM=host:port fronts another MCP server instead of the example one. Ctrl-C stops all.
Demo credentials come from ATMOST_SERVICE_TOKEN / ATMOST_ADMIN_TOKEN /
ATMOST_UPSTREAM_KEY_SECRET when set. Envoy runs the shipped configuration's form: the filter
reads the service token and the upstream key secret from Envoy's environment, and reaches the
ledger over TLS with a CA and certificate made afresh in .run/tls/ (scripts/local_ca.py).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from atmost_stack import DEMO_SECRETS, ROOT, Envoy, ExampleServer, Ledger, Process, ledger_binary  # noqa: E402
from local_ca import make_ledger_tls  # noqa: E402

LISTEN_PORT = 10000
ADMIN_PORT = 9901
LEDGER_PORT = 8081
LEDGER_ADMIN_PORT = 8082
EXAMPLE_PORT = 8000


def upstream_address() -> tuple[str, int] | None:
    value = os.environ.get("UPSTREAM", "").strip()
    if not value:
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        sys.exit(f"UPSTREAM must be host:port, got {value!r}")
    return host, int(port)


def main() -> int:
    run_dir = ROOT / ".run"
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    service_token = os.environ.get("ATMOST_SERVICE_TOKEN", DEMO_SECRETS["ATMOST_SERVICE_TOKEN"])
    admin_token = os.environ.get("ATMOST_ADMIN_TOKEN", "demo-admin-token-not-for-production")
    started: list[Process] = []

    def stop_all(*_):
        for p in reversed(started):
            p.stop()
        sys.exit(0)

    signal.signal(signal.SIGINT, stop_all)
    signal.signal(signal.SIGTERM, stop_all)

    try:
        # Where envoy/atmost-sidecar.yaml's `trusted_ca` looks (relative to the repository root).
        tls = make_ledger_tls(run_dir / "tls")
        ledger = Ledger(log_dir, run_dir / "ledger-data", port=LEDGER_PORT, admin_port=LEDGER_ADMIN_PORT,
                        service_token=service_token, admin_token=admin_token, tls=tls)
        ledger.start()
        started.append(ledger)

        upstream = upstream_address()
        if upstream is None:
            server = ExampleServer(log_dir, port=EXAMPLE_PORT, json_response=False)
            server.start()
            started.append(server)
            upstream = ("127.0.0.1", EXAMPLE_PORT)

        upstream_secret = os.environ.get("ATMOST_UPSTREAM_KEY_SECRET", DEMO_SECRETS["ATMOST_UPSTREAM_KEY_SECRET"])
        envoy = Envoy(log_dir, upstream[1], [LEDGER_PORT], port=LISTEN_PORT, admin_port=ADMIN_PORT,
                      upstream_host=upstream[0], secrets_from_env=True, ledger_tls=tls,
                      env={"ATMOST_SERVICE_TOKEN": service_token, "ATMOST_UPSTREAM_KEY_SECRET": upstream_secret})
        envoy.start()
        started.append(envoy)

        permit = ledger.create_permit("--max-calls", "pay_invoice=3", "--budget", "10000",
                                      "--cost", "pay_invoice=/amount", label="demo")
    except Exception as e:  # noqa: BLE001 - report and clean up whatever did start
        print(f"make run failed: {e}\nlogs: {log_dir}", file=sys.stderr)
        for p in reversed(started):
            p.stop()
        return 1

    token = permit["token"]
    cli = ledger_binary()
    if cli.is_relative_to(ROOT):
        cli = cli.relative_to(ROOT)
    ca = tls.ca.relative_to(ROOT) if tls.ca.is_relative_to(ROOT) else tls.ca
    print(f"""
atmost is running.
  MCP endpoint : http://127.0.0.1:{LISTEN_PORT}/mcp   (upstream {upstream[0]}:{upstream[1]})
  ledger       : {ledger.url}   (TLS, certificate from the local CA {ca}: the filter's API, /metrics)
  ledger admin : {ledger.admin_url}   (admin API and inbox; admin token: {admin_token})
  inbox        : {ledger.admin_url}/admin/   (sign in with the admin token; uncertain calls to check;
                 a browser warns about the local CA until you trust {ca} or accept it once)
  Envoy admin  : http://127.0.0.1:{ADMIN_PORT}
  logs         : {log_dir}

Demo permit {permit['id']} (pay_invoice: at most 3 calls, budget 10000, cost = amount).
Its token is shown once:

  {token}

Try it:
  curl -s http://127.0.0.1:{LISTEN_PORT}/mcp \\
    -H 'content-type: application/json' -H 'accept: application/json, text/event-stream' \\
    -H 'mcp-protocol-version: 2026-07-28' -H 'mcp-method: tools/call' -H 'mcp-name: pay_invoice' \\
    -H 'atmost-permit: {token}' -H 'idempotency-key: "task-4417-pay"' \\
    -d '{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"pay_invoice","arguments":{{"invoice":"INV-4417","amount":250}},"_meta":{{"io.modelcontextprotocol/protocolVersion":"2026-07-28","io.modelcontextprotocol/clientCapabilities":{{}}}}}}}}'

Run it twice: the second answer is the first receipt, marked replayed.

The admin CLI against this ledger (permits, attempts, reconciliation: docs/ledger.md):
  export ATMOST_LEDGER_URL={ledger.admin_url} ATMOST_LEDGER_CA_FILE={ca} ATMOST_ADMIN_TOKEN={admin_token}
  {cli} permit list
  {cli} permit create --label my-agent --expires 1h --max-calls pay_invoice=1

Ctrl-C stops everything.
""", flush=True)
    while all(p.alive() for p in started):
        time.sleep(0.5)
    dead = [p.name for p in started if not p.alive()]
    print(f"stopped: {', '.join(dead)} exited (logs in {log_dir})", file=sys.stderr)
    for p in reversed(started):
        p.stop()
    return 1


if __name__ == "__main__":
    sys.exit(main())
