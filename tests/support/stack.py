"""The suites' view of the stack: scripts/atmost_stack.py (what `make run` starts) plus what only
the tests start, the TypeScript SDK server and client and the Go upstream.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from atmost_stack import (  # noqa: E402,F401  (re-exported: the suites import them from here)
    BODY_HOLD_FORMS,
    DEMO_SECRETS,
    ENVOY_CONFIG,
    EXAMPLE_SERVER,
    ENVOY_MCP_FILTER,
    EXTERNAL_PROVIDER_CONFIG,
    ROOT,
    SECRET_FIELDS,
    VENV_BIN,
    WASM,
    Envoy,
    EnvoyMcpFilter,
    ExampleServer,
    Ledger,
    Process,
    ProcessExited,
    Provider,
    LedgerTls,
    cleartext_ledger_cluster,
    default_ledger_tls,
    deployment,
    envoygateway_retry_policy,
    envoygateway_route_enable,
    envoygateway_wasm_filter,
    external_provider_config,
    free_port,
    http_get,
    http_post_json,
    ledger_binary,
    listener_hcm,
    sidecar_config,
    wait_until,
    wasmplugin_filter_config,
)
from local_ca import make_ledger_tls, spki_sha256  # noqa: E402,F401

TS_DIR = ROOT / "tests" / "ts"


class TsServer(Process):
    """The TypeScript SDK example server (tests/ts/server.mjs), stateless Streamable HTTP."""

    def __init__(self, log_dir: Path, json_response: bool, name: str = "mcp-server-ts"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = ["node", str(TS_DIR / "server.mjs"), "--port", str(self.port)]
        if json_response:
            argv.append("--json-response")
        super().__init__(name, argv, log_dir, cwd=TS_DIR)

    def start(self) -> None:
        super().start()
        self.wait_started(lambda: http_get(self.url + "/_example/state")[0] == 200, 30,
                          f"TypeScript MCP server on {self.url}")

    def executions(self, tool: str = "pay_invoice") -> int:
        return json.loads(http_get(self.url + "/_example/state")[1])["executions"].get(tool, 0)

    def reset(self) -> None:
        http_post_json(self.url + "/_example/reset", {})


GO_UPSTREAM_SRC = ROOT / "tests" / "support" / "go_upstream" / "main.go"
GO_BUILD_DIR = ROOT / "target" / "go"


def go_upstream_binary() -> Path:
    """Builds tests/support/go_upstream (standard library only, so offline) with the `go` from
    Debian's golang-go (`make go-tools`); caches stay under target/."""
    out = GO_BUILD_DIR / "go_upstream"
    env = {**os.environ, "GOCACHE": str(GO_BUILD_DIR / "cache"), "GOPATH": str(GO_BUILD_DIR / "path"),
           "GOPROXY": "off", "GOTOOLCHAIN": "local", "GO111MODULE": "on"}
    subprocess.run(["go", "build", "-o", str(out), str(GO_UPSTREAM_SRC)], check=True, env=env, cwd=ROOT,
                   timeout=300, capture_output=True)
    return out


class GoUpstream(Process):
    """tests/support/go_upstream: decodes bodies with Go's encoding/json and records every
    message it would execute."""

    def __init__(self, log_dir: Path, binary: Path, name: str = "go-upstream"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(name, [str(binary), "-port", str(self.port)], log_dir)

    def start(self) -> None:
        super().start()
        self.wait_started(lambda: http_get(self.url + "/_example/log")[0] == 200, 30, f"Go upstream on {self.url}")

    def log(self) -> dict:
        """`entries` (every message run) and `requests` (every POST to /mcp)."""
        return json.loads(http_get(self.url + "/_example/log")[1])

    def entries(self) -> list[dict]:
        return self.log()["entries"]

    def reset(self) -> None:
        http_post_json(self.url + "/_example/reset", {})


H2_UPSTREAM = ROOT / "tests" / "support" / "h2_upstream.mjs"


class H2Upstream(Process):
    """tests/support/h2_upstream.mjs: an MCP upstream over HTTP/2 without TLS (h2c) that records
    every tools/call it runs, resets the stream of each call to a tool in `reset`, and answers
    each call to a tool in `sse_trailers` with an SSE stream that ends with trailers."""

    def __init__(self, log_dir: Path, reset: tuple[str, ...] = (), name: str = "h2-upstream",
                 sse_trailers: tuple[str, ...] = ()):
        self.port = free_port()
        argv = ["node", str(H2_UPSTREAM), "--port", str(self.port)]
        for tool in reset:
            argv += ["--reset", tool]
        for tool in sse_trailers:
            argv += ["--sse-trailers", tool]
        self._log_from = 0
        super().__init__(name, argv, log_dir)

    def start(self) -> None:
        self._log_from = len(self.log_text())
        super().start()
        self.wait_started(lambda: f'{{"listening":{self.port}}}' in self.log_text(), 30,
                          f"HTTP/2 upstream on port {self.port}")

    def executions(self) -> list[dict]:
        """What it ran, in the recording upstream's form (n, nonce, tool, arguments, upstream_key,
        rpc_id: the JSON-RPC id of the call, as a string)."""
        lines = self.log_text()[self._log_from:].splitlines()
        ran = [json.loads(line)["execution"] for line in lines if line.startswith('{"execution"')]
        return [{**e, "rpc_id": None if e.get("id") is None else str(e["id"])} for e in ran]

    def sse_sent(self, rpc_id) -> list[str]:
        """Every SSE stream it sent in answer to the call with JSON-RPC id `rpc_id`, as sent."""
        lines = self.log_text()[self._log_from:].splitlines()
        sent = [json.loads(line)["sse_sent"] for line in lines if line.startswith('{"sse_sent"')]
        return [s["stream"] for s in sent if s["id"] == rpc_id]


H2_CLIENT = ROOT / "tests" / "support" / "h2_client.mjs"


def h2_post(url: str, body: bytes, headers: dict) -> dict:
    """One POST to `url` over HTTP/2 without TLS (tests/support/h2_client.mjs): the response's
    status, headers, body (UTF-8 text) and trailers (None when none came)."""
    request = json.dumps({"headers": headers, "body": body.decode()})
    result = subprocess.run(["node", str(H2_CLIENT), url], input=request, capture_output=True, text=True,
                            timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"HTTP/2 client failed ({result.returncode}): {result.stderr[-3000:]}")
    return json.loads(result.stdout)


def ts_script(script: str, *args: str) -> dict:
    """Runs a TypeScript SDK client of tests/ts/ with `args`; returns the JSON it prints."""
    argv = ["node", str(TS_DIR / script), *args]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=TS_DIR)
    if result.returncode != 0:
        raise RuntimeError(f"TypeScript client {script} failed ({result.returncode}): {result.stderr[-3000:]}")
    return json.loads(result.stdout)


def ts_client(url: str, token: str | None = None, key: str | None = None) -> dict:
    """Runs tests/ts/client.mjs (TypeScript SDK client) against `url`; returns its transcript."""
    return ts_script("client.mjs", url, token or "", *([key] if key else []))


def validate_envoy_config(path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`envoy --mode validate` on one config file (which loads the filter and runs its
    on_configure); `env` is added to Envoy's environment, e.g. the secrets a config names."""
    return subprocess.run([str(VENV_BIN / "envoy"), "--mode", "validate", "-c", str(path), "--use-dynamic-base-id"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, env={**os.environ, **(env or {})})
