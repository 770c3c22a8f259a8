"""The demo gateway's processes: the ledger, the example MCP server, Envoy with the filter.

`make run` (scripts/run.py) and `make bench` start them from here, and so do the end-to-end
and fault suites (tests/support/stack.py adds what only they need). Every address is
loopback; every wait is bounded.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from local_ca import LedgerTls, make_ledger_tls

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
ENVOY_CONFIG = ROOT / "envoy" / "atmost-sidecar.yaml"
# The same gateway in front of an MCP server outside the mesh, reached over TLS Envoy opens.
EXTERNAL_PROVIDER_CONFIG = ROOT / "envoy" / "atmost-external-provider.yaml"
# ATMOST_WASM: another build of the filter, e.g. to run these tests against an older release.
# The module is built with its own size-optimized profile (`make wasm`: `--profile wasm`).
WASM = Path(os.environ.get("ATMOST_WASM") or ROOT / "target" / "wasm32-wasip1" / "wasm" / "atmost_filter.wasm")
EXAMPLE_SERVER = ROOT / "examples" / "mcp_server.py"
# The shipped sidecar names its secrets by environment variable; these are the demo's values
# (the ones its header comment shows).
# Tokens of the test ledgers: the ledger refuses any shorter than 32 bytes.
TEST_SERVICE_TOKEN = "test-service-token-of-32-bytes-or-more"
TEST_ADMIN_TOKEN = "test-admin-token-of-32-bytes-or-more"
DEMO_SECRETS = {"ATMOST_SERVICE_TOKEN": "demo-service-token-not-for-production", "ATMOST_UPSTREAM_KEY_SECRET": "demo-upstream-key-secret"}
# (object in the plugin JSON, field): the secrets that may be given in place or as `<field>_env`.
SECRET_FIELDS = (("ledger", "service_token"), ("upstream_key", "secret"))
# ATMOST_DEPLOYMENT picks how the filter sits in Envoy: `envoyfilter` (default), the Wasm filter of
# envoy/atmost-sidecar.yaml as an EnvoyFilter delivers it (allow_on_headers_stop_iteration: true);
# `wasmplugin`, the same filter as istiod renders the shipped WasmPlugin (wasmplugin_filter_config);
# `envoygateway`, the filter and its routes as Envoy Gateway renders the shipped EnvoyExtensionPolicy
# and BackendTrafficPolicy (envoygateway_form).
DEPLOYMENTS = ("envoyfilter", "wasmplugin", "envoygateway")
# The forms whose filter holds only a POST's body (`request_hold: body`): their manifests cannot
# set allow_on_headers_stop_iteration.
BODY_HOLD_FORMS = ("wasmplugin", "envoygateway")
WASMPLUGIN_MANIFEST = ROOT / "envoy" / "istio" / "agent-wasmplugin" / "wasmplugin.yaml"
ENVOY_GATEWAY_DIR = ROOT / "envoy" / "gateway" / "mcp"
# What istiod itself puts into the VM's environment (pilot/pkg/model/extensions.go, buildVMConfig).
ISTIOD_PULL_POLICY_ENV = "ISTIO_META_WASM_IMAGE_PULL_POLICY"
ISTIOD_RESOURCE_VERSION_ENV = "ISTIO_META_WASM_PLUGIN_RESOURCE_VERSION"
ISTIOD_FAILURE_POLICIES = {"FAIL_CLOSE": "FAIL_CLOSED", "FAIL_OPEN": "FAIL_OPEN", "FAIL_RELOAD": "FAIL_RELOAD"}
# Envoy's own MCP filter as docs/envoy-mcp-filter.md has a team add it beside atmost.
ENVOY_MCP_FILTER = ROOT / "envoy" / "envoy-mcp-filter.yaml"
ENVOY_MCP_FILTER_PLACES = ("before", "after")


@dataclass
class EnvoyMcpFilter:
    """Envoy's MCP filter in the gateway's chain: `filters` (http_filters entries; None: those of
    envoy/envoy-mcp-filter.yaml) go right `before` or right `after` the atmost filter. In a
    `plain` gateway (no atmost) they go where atmost would be."""

    place: str
    filters: list[dict] | None = None

    def entries(self) -> list[dict]:
        if self.place not in ENVOY_MCP_FILTER_PLACES:
            raise ValueError(f"place must be one of {', '.join(ENVOY_MCP_FILTER_PLACES)} (got {self.place!r})")
        return self.filters if self.filters is not None else yaml.safe_load(ENVOY_MCP_FILTER.read_text())


def deployment() -> str:
    """ATMOST_DEPLOYMENT, checked: `envoyfilter` (default), `wasmplugin` or `envoygateway`."""
    value = os.environ.get("ATMOST_DEPLOYMENT") or "envoyfilter"
    if value not in DEPLOYMENTS:
        raise ValueError(f"ATMOST_DEPLOYMENT must be one of {', '.join(DEPLOYMENTS)} (got {value!r})")
    return value


def wasmplugin_filter_config(plugin_json: dict, wasm: Path, host_env_keys: list[str]) -> dict:
    """The Wasm filter's `config` as istiod renders it from the shipped WasmPlugin (Istio source
    pilot/pkg/model/extensions.go: name `<namespace>.<name>`, root_id from pluginName, the
    pluginConfig as a StringValue, vm_config with only runtime, code and environment_variables,
    failure_policy from failStrategy; istio-agent turns the OCI url into a local file). There is
    no field for allow_on_headers_stop_iteration nor vm_id, so neither is set. The plugin JSON
    takes `request_hold` from the manifest's pluginConfig unless it sets one; the rest is this
    stack's (its ledger cluster and secrets)."""
    manifest = yaml.safe_load(WASMPLUGIN_MANIFEST.read_text())
    spec, meta = manifest["spec"], manifest["metadata"]
    plugin_json = {"request_hold": spec["pluginConfig"]["request_hold"], **plugin_json}
    manifest_env = [e["name"] for e in spec.get("vmConfig", {}).get("env", []) if e.get("valueFrom") == "HOST"]
    env = {"key_values": {ISTIOD_PULL_POLICY_ENV: spec.get("imagePullPolicy", "IfNotPresent"),
                          ISTIOD_RESOURCE_VERSION_ENV: "1"}}
    keys = host_env_keys if host_env_keys else manifest_env
    if keys:
        env["host_env_keys"] = keys
    return {
        "name": f"{meta['namespace']}.{meta['name']}",
        "root_id": spec["pluginName"],
        "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": json.dumps(plugin_json)},
        "vm_config": {"runtime": "envoy.wasm.runtime.v8", "code": {"local": {"filename": str(wasm)}},
                      "environment_variables": env},
        "failure_policy": ISTIOD_FAILURE_POLICIES[spec.get("failStrategy", "FAIL_CLOSE")],
    }


# Envoy Gateway v1.9.0's rendering (internal/xds/translator/wasm.go and route.go).
ENVOY_GATEWAY_WASM_FILTER = "envoy.filters.http.wasm"
ENVOY_GATEWAY_RETRY_ON = "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes"
ENVOY_GATEWAY_RETRIABLE_STATUS = 503
ENVOY_GATEWAY_NUM_RETRIES = 2


def envoygateway_wasm_filter(policy: dict, index: int, code: dict, config: dict | None = None) -> dict:
    """Entry `index` of an EnvoyExtensionPolicy's `wasm` as Envoy Gateway renders it into the
    connection manager: named `envoy.filters.http.wasm/envoyextensionpolicy/<ns>/<name>/wasm/<i>`,
    `disabled` there (each route of the policy's target enables it, envoygateway_route_enable);
    `config.name` the entry's `name`, `root_id` its `rootID`, its `config` as a StringValue of
    JSON (`config`, when given, stands in for it), `fail_open` its `failOpen`; the VM's `vm_id` the
    filter's own name, V8, `environment_variables.host_env_keys` from `env.hostKeys`. `code` is
    the VM's code: Envoy Gateway's is `remote`, served by its Wasm cache."""
    meta, entry = policy["metadata"], policy["spec"]["wasm"][index]
    ir_name = f"envoyextensionpolicy/{meta['namespace']}/{meta['name']}/wasm/{index}"
    plugin_json = entry.get("config") if config is None else config
    vm_config = {"vm_id": ir_name, "runtime": "envoy.wasm.runtime.v8", "code": code}
    if entry.get("env", {}).get("hostKeys"):
        vm_config["environment_variables"] = {"host_env_keys": list(entry["env"]["hostKeys"])}
    wasm_config = {"name": entry.get("name", ir_name), "vm_config": vm_config,
                   "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue",
                                     "value": "" if plugin_json is None else json.dumps(plugin_json)},
                   "fail_open": bool(entry.get("failOpen", False))}
    if "rootID" in entry:
        wasm_config["root_id"] = entry["rootID"]
    return {"name": f"{ENVOY_GATEWAY_WASM_FILTER}/{ir_name}", "disabled": True,
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
                             "config": wasm_config}}


def envoygateway_route_enable(route: dict, filter_name: str) -> None:
    """Enables a filter Envoy Gateway left disabled in the connection manager on one route: an
    empty FilterConfig under the filter's name."""
    route.setdefault("typed_per_filter_config", {})[filter_name] = {
        "@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "config": {}}


def envoygateway_retry_policy(retry: dict) -> dict:
    """A BackendTrafficPolicy's `retry` as Envoy Gateway renders it (route.go, buildRetryPolicy);
    without a `retry`, Envoy Gateway sets no retry policy at all."""
    policy = {"retry_on": ENVOY_GATEWAY_RETRY_ON, "retriable_status_codes": [ENVOY_GATEWAY_RETRIABLE_STATUS],
              "num_retries": retry.get("numRetries", ENVOY_GATEWAY_NUM_RETRIES),
              "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts", "typed_config": {
                  "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}],
              "host_selection_retry_max_attempts": 5}
    if retry.get("retryOn", {}).get("triggers"):
        policy["retry_on"] = ",".join(retry["retryOn"]["triggers"])
    if retry.get("retryOn", {}).get("httpStatusCodes"):
        policy["retriable_status_codes"] = retry["retryOn"]["httpStatusCodes"]
    return policy


def envoygateway_form(hcm: dict, wasm_filter: dict, plugin_json: dict, wasm: Path, host_env_keys: list[str]) -> None:
    """The shipped gateway's filter and routes changed into what Envoy Gateway renders for the
    shipped objects (envoy/gateway/mcp/): the Wasm filter of the EnvoyExtensionPolicy, disabled in
    the connection manager and enabled on every route; each route's retry policy from the
    BackendTrafficPolicy; the router with `suppress_envoy_headers`. The plugin JSON takes
    `request_hold` from the policy's `config` unless it sets one; the rest is this stack's (its
    ledger cluster and secrets). The module is a local file here, where Envoy Gateway serves it
    from its Wasm cache (tests/e2e/test_envoy_gateway.py runs that part)."""
    policy = yaml.safe_load((ENVOY_GATEWAY_DIR / "envoyextensionpolicy.yaml").read_text())
    [entry] = policy["spec"]["wasm"]
    plugin_json = {"request_hold": entry["config"]["request_hold"], **plugin_json}
    if host_env_keys:
        entry["env"] = {"hostKeys": host_env_keys}
    rendered = envoygateway_wasm_filter(policy, 0, {"local": {"filename": str(wasm)}}, plugin_json)
    retry = yaml.safe_load((ENVOY_GATEWAY_DIR / "backendtrafficpolicy.yaml").read_text())["spec"].get("retry")
    hcm["http_filters"] = [rendered if f is wasm_filter else f for f in hcm["http_filters"]]
    for virtual_host in hcm["route_config"]["virtual_hosts"]:
        for route in virtual_host["routes"]:
            envoygateway_route_enable(route, rendered["name"])
            if retry is not None:
                route["route"]["retry_policy"] = envoygateway_retry_policy(retry)
    for f in hcm["http_filters"]:
        if f["name"] == "envoy.filters.http.router":
            f["typed_config"]["suppress_envoy_headers"] = True


_default_ledger_tls: LedgerTls | None = None


def default_ledger_tls() -> LedgerTls:
    """The CA and ledger certificate this process's ledgers serve with and its Envoys trust, made
    once in a directory of its own: a run beside `make run` never replaces that one's files."""
    global _default_ledger_tls
    if _default_ledger_tls is None:
        directory = Path(tempfile.mkdtemp(prefix="atmost-ledger-tls-"))
        atexit.register(shutil.rmtree, directory, True)
        _default_ledger_tls = make_ledger_tls(directory)
    return _default_ledger_tls


def resolve_ledger_tls(tls: LedgerTls | bool) -> LedgerTls | None:
    """`True`: default_ledger_tls(); `False`: plain HTTP; a LedgerTls: that one."""
    if tls is True:
        return default_ledger_tls()
    if tls is False:
        return None
    return tls


def ledger_binary() -> Path:
    """The `atmost` binary: ATMOST_BIN if set, else the freshest build in target/."""
    if os.environ.get("ATMOST_BIN"):
        return Path(os.environ["ATMOST_BIN"])
    builds = [ROOT / "target" / p / "atmost" for p in ("release", "debug")]
    existing = [b for b in builds if b.exists()]
    if not existing:
        raise RuntimeError("no atmost binary: run `make ledger` (cargo build -p atmost-ledger-server) first")
    return max(existing, key=lambda b: b.stat().st_mtime)


def _port_share() -> range:
    """The loopback ports this process hands out.

    They lie outside the kernel's ephemeral range: a listener cannot bind a port that any
    loopback connection uses as its source port, and while a suite runs, Envoys, clients and
    ledgers open connections all the time, so a port taken from the ephemeral range could be
    taken by a connect() between being handed out and being bound (the server then exits with
    EADDRINUSE). Outside that range only an explicit bind can take it. They start at 20000,
    above the fixed ports `make run` and the shipped configs use. Under pytest-xdist each worker
    hands out its own share, so two workers never hand out the same port."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    below, above = range(20000, low), range(high + 1, 65536)
    pool = below if len(below) >= len(above) else above
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    share = len(pool) // max(workers, 1)
    return pool[index * share:(index + 1) * share]


_PORT_SHARE = _port_share()
# Where the next search starts (apart for two processes that are not xdist workers of one run).
# It walks the share round, so a port comes back only after every other one was handed out.
_port_cursor = os.getpid() % max(len(_PORT_SHARE), 1)


def free_port() -> int:
    """A loopback port nothing is bound to now, outside the kernel's ephemeral range (see
    `_port_share`), and not one of the last ones this process handed out: a ledger's `--listen`
    and `--admin-listen`, asked for one after the other, are never the same port."""
    global _port_cursor
    for _ in range(len(_PORT_SHARE)):
        port = _PORT_SHARE[_port_cursor]
        _port_cursor = (_port_cursor + 1) % len(_PORT_SHARE)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"every loopback port of {_PORT_SHARE} is bound "
                       "(net.ipv4.ip_local_port_range leaves the ports outside it that this picks from)")


class ProcessExited(RuntimeError):
    """A process being waited for has exited: waiting longer cannot help."""


def wait_until(check, timeout: float, what: str, interval: float = 0.05):
    """Polls `check` until it returns a truthy value; raises after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except ProcessExited:
            raise
        except Exception as e:  # noqa: BLE001 - any other failure means "not yet"
            last_error = e
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last error: {last_error})")


def http_get(url: str, timeout: float = 2.0, context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def http_post_json(url: str, body: dict, timeout: float = 2.0, context: ssl.SSLContext | None = None) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=timeout, context=context) as r:
        return json.loads(r.read())


class Process:
    """A child process with its output in a log file, stopped for sure at the end."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict | None = None, cwd: Path = ROOT):
        self.name = name
        self.argv = argv
        self.log_path = log_dir / f"{name}.log"
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd, start_new_session=True
        )
        log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_started(self, ready, timeout: float, what: str) -> None:
        """Waits until `ready()` holds. A process that exits meanwhile ends the wait at once, with
        its log's tail in the error (a server that could not bind its port says so there)."""
        def check():
            if not self.alive():
                raise ProcessExited(f"{self.name} exited while waiting for {what} (log: {self.log_path}):\n"
                                    f"{self.log_text()[-3000:]}")
            return ready()
        wait_until(check, timeout, f"{what} (log: {self.log_path})")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=timeout)

    def kill9(self) -> None:
        self.stop(signal.SIGKILL)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


class Ledger(Process):
    def __init__(self, log_dir: Path, data_dir: Path, port: int | None = None,
                 service_token: str = TEST_SERVICE_TOKEN, admin_token: str = TEST_ADMIN_TOKEN,
                 extra_args: list[str] | None = None, name: str = "ledger",
                 tls: LedgerTls | bool = True, admin_port: int | None = None):
        """`tls`: serve TLS as the shipped sidecar expects (`True`: with default_ledger_tls(), a
        LedgerTls: with that one), or plain HTTP (`False`, the form behind Istio's mTLS). Every
        request made from here (readiness, metrics, the admin CLI) checks the certificate against
        the CA; `ssl_context` does the same for a test's own requests."""
        self.port = port or free_port()
        # The admin API and the inbox: a port of their own (`--admin-listen`).
        self.admin_port = admin_port or free_port()
        self.service_token = service_token
        self.admin_token = admin_token
        self.data_dir = data_dir
        self.tls = resolve_ledger_tls(tls)
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"
        self.admin_url = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.admin_port}"
        self.ssl_context = ssl.create_default_context(cafile=str(self.tls.ca)) if self.tls else None
        # httpx's `verify` for a test's own client of this ledger.
        self.http_verify: ssl.SSLContext | bool = self.ssl_context or True
        argv = [str(ledger_binary()), "ledger", "--listen", f"127.0.0.1:{self.port}",
                "--admin-listen", f"127.0.0.1:{self.admin_port}", "--data-dir", str(data_dir)]
        if self.tls:
            argv += ["--tls-cert-file", str(self.tls.cert), "--tls-key-file", str(self.tls.key)]
        argv += extra_args or []
        super().__init__(name, argv, log_dir, env={
            "ATMOST_SERVICE_TOKEN": service_token,
            "ATMOST_ADMIN_TOKEN": admin_token,
            # A local ledger has no health check to wait for: stop at once (a test that drains
            # passes --drain-delay, which wins over the environment).
            "ATMOST_DRAIN_DELAY": "0s",
            "RUST_LOG": os.environ.get("RUST_LOG", "info"),
        })

    def start(self) -> None:
        super().start()
        self.wait_started(self._ready, 20, f"ledger on {self.url}")

    def _ready(self) -> bool:
        return http_get(self.url + "/readyz", context=self.ssl_context)[0] == 200

    def cli_env(self) -> dict[str, str]:
        """What the admin CLI needs in its environment for this ledger: the admin token and,
        over TLS, the CA to trust."""
        env = {"ATMOST_ADMIN_TOKEN": self.admin_token}
        if self.tls:
            env["ATMOST_LEDGER_CA_FILE"] = str(self.tls.ca)
        return env

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """Runs the admin CLI against this ledger."""
        argv = [str(ledger_binary()), "--ledger", self.admin_url, *args]
        env = {**os.environ, **self.cli_env()}
        result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=30)
        if check and result.returncode != 0:
            raise RuntimeError(f"atmost {' '.join(args)} failed ({result.returncode}): {result.stderr}")
        return result

    def cli_json(self, *args: str):
        return json.loads(self.cli("--json", *args).stdout)

    def create_permit(self, *args: str, label: str = "test") -> dict:
        """Creates a permit; returns the CLI's JSON, which holds `id` and the one-time `token`."""
        return self.cli_json("permit", "create", "--label", label, "--expires", "1h", *args)

    def metrics(self) -> str:
        return http_get(self.url + "/metrics", context=self.ssl_context)[1].decode()

    def get(self, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
        return http_get(self.url + path, timeout=timeout, context=self.ssl_context)


class ExampleServer(Process):
    def __init__(self, log_dir: Path, port: int | None = None, json_response: bool = True, name: str = "mcp-server",
                 event_store: bool = False, stateless: bool = False, tls: tuple[Path, Path, Path] | None = None):
        """`tls` (certificate, key, CA that signed it): serve HTTPS (`--tls-cert`, `--tls-key`); the
        inspection requests below then check the server's certificate against that CA."""
        self.port = port or free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        argv = [str(VENV_BIN / "python"), str(EXAMPLE_SERVER), "--port", str(self.port)]
        if json_response:
            argv.append("--json-response")
        if event_store:
            argv.append("--event-store")
        if stateless:
            argv.append("--stateless")
        self.context = None
        if tls:
            cert, key, ca = tls
            argv += ["--tls-cert", str(cert), "--tls-key", str(key)]
            self.context = ssl.create_default_context(cafile=str(ca))
            # These requests go to 127.0.0.1, which a certificate for the provider's name does
            # not name; the chain is still checked. The gateway under test checks the name.
            self.context.check_hostname = False
        super().__init__(name, argv, log_dir)

    def start(self) -> None:
        super().start()
        self.wait_started(lambda: http_get(self.url + "/_example/state", context=self.context)[0] == 200,
                          30, f"example MCP server on {self.url}")

    def state(self) -> dict:
        return json.loads(http_get(self.url + "/_example/state", context=self.context)[1])

    def executions(self, tool: str = "pay_invoice") -> int:
        return self.state()["executions"].get(tool, 0)

    def reset(self) -> None:
        http_post_json(self.url + "/_example/reset", {}, context=self.context)

    def configure(self, **settings) -> None:
        http_post_json(self.url + "/_example/config", settings, context=self.context)


def sidecar_config(listen_port: int, admin_port: int, upstream_port: int, ledger_ports: list[int],
                   plugin_overrides: dict | None = None, wasm: Path = WASM, plain: bool = False,
                   secrets_from_env: bool = False, upstream_host: str = "127.0.0.1",
                   deployment_form: str | None = None, ledger_tls: LedgerTls | bool = True,
                   envoy_mcp_filter: EnvoyMcpFilter | None = None) -> dict:
    """The shipped sidecar config with this run's ports, the absolute wasm path and plugin overrides.

    `plain=True` is the same proxy without the atmost filter: the baseline an MCP client must not
    be able to tell apart from the gateway for well-behaved traffic.

    The shipped config takes its secrets from Envoy's environment (`service_token_env`,
    `upstream_key.secret_env`). By default they are written in place with DEMO_SECRETS, so the
    config runs without them in Envoy's environment; `secrets_from_env=True` keeps the shipped
    form, and Envoy then needs the variables (`Envoy(env=...)`). An override of a secret in
    either form replaces the other form.

    `upstream_host` may be a name (`UPSTREAM=mcp.internal:8000 make run`): the upstream cluster
    then resolves it (STRICT_DNS).

    `deployment_form` (default: ATMOST_DEPLOYMENT) `wasmplugin` renders the Wasm filter as istiod
    renders the shipped WasmPlugin (wasmplugin_filter_config), `envoygateway` as Envoy Gateway
    renders the shipped EnvoyExtensionPolicy (envoygateway_form); overrides apply to the plugin JSON.
    The connection manager then loses the shipped `headers_with_underscores_action`, which a
    WasmPlugin cannot set.

    `ledger_tls` (see gateway_config): the CA the ledger's certificate is checked against, or
    `False` for the cleartext form. `envoy_mcp_filter` adds Envoy's own MCP filter to the chain.
    """
    config = gateway_config(ENVOY_CONFIG, listen_port, admin_port, ledger_ports, plugin_overrides, wasm, plain,
                            secrets_from_env, deployment_form, ledger_tls, envoy_mcp_filter)
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == "mcp_upstream":
            address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
            address["socket_address"]["port_value"] = upstream_port
            address["socket_address"]["address"] = upstream_host
            if not is_ip(upstream_host):
                cluster["type"] = "STRICT_DNS"
    return config


@dataclass(frozen=True)
class Provider:
    """An MCP server outside the mesh as envoy/atmost-external-provider.yaml reaches it: `host` is
    the name it is known by (SNI, the certificate's DNS name, the Host it receives), `address`
    and `port` where to connect, `ca_file` the CA bundle its certificate must chain to."""

    host: str
    address: str
    port: int
    ca_file: Path


def external_provider_config(listen_port: int, admin_port: int, ledger_ports: list[int], provider: Provider,
                             plugin_overrides: dict | None = None, wasm: Path = WASM, plain: bool = False,
                             secrets_from_env: bool = False, deployment_form: str | None = None,
                             ledger_tls: LedgerTls | bool = True, envoy_mcp_filter: EnvoyMcpFilter | None = None) -> dict:
    """envoy/atmost-external-provider.yaml with this run's ports and filter (as sidecar_config does
    for the sidecar) and `provider` in the places the file's header names: the provider
    cluster's address, its TLS `sni`, expected DNS name and trusted CA, and the Host every
    route rewrites to."""
    config = gateway_config(EXTERNAL_PROVIDER_CONFIG, listen_port, admin_port, ledger_ports, plugin_overrides, wasm,
                            plain, secrets_from_env, deployment_form, ledger_tls, envoy_mcp_filter)
    [cluster] = [c for c in config["static_resources"]["clusters"] if c["name"] == "mcp_provider"]
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    address.update(address=provider.address, port_value=provider.port)
    if is_ip(provider.address):
        cluster["type"] = "STATIC"
        cluster.pop("dns_lookup_family", None)
    tls = cluster["transport_socket"]["typed_config"]
    tls["sni"] = provider.host
    validation = tls["common_tls_context"]["validation_context"]
    validation["trusted_ca"] = {"filename": str(provider.ca_file)}
    [san] = validation["match_typed_subject_alt_names"]
    san["matcher"] = {"exact": provider.host}
    for route in listener_hcm(config)["route_config"]["virtual_hosts"][0]["routes"]:
        route["route"]["host_rewrite_literal"] = provider.host
    return config


def is_ip(address: str) -> bool:
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True


def listener_hcm(config: dict) -> dict:
    """The HTTP connection manager of a shipped gateway config's one listener."""
    return config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def gateway_config(path: Path, listen_port: int, admin_port: int, ledger_ports: list[int],
                   plugin_overrides: dict | None, wasm: Path, plain: bool, secrets_from_env: bool,
                   deployment_form: str | None, ledger_tls: LedgerTls | bool = True,
                   envoy_mcp_filter: EnvoyMcpFilter | None = None) -> dict:
    """A shipped gateway config (its one listener, the atmost filter, the `atmost_ledger` cluster)
    with this run's listener, admin and ledger ports and the filter as sidecar_config describes;
    its MCP cluster is left to the caller.

    The ledger cluster keeps the shipped TLS (`sni`, the expected name, ALPN) with `trusted_ca`
    pointed at `ledger_tls`'s CA (`True`: default_ledger_tls()); `False` renders the cleartext
    form, the cluster without its transport socket (cleartext_ledger_cluster). `envoy_mcp_filter`
    puts Envoy's MCP filter before or after atmost (EnvoyMcpFilter)."""
    form = deployment_form or deployment()
    if form not in DEPLOYMENTS:
        raise ValueError(f"deployment_form must be one of {', '.join(DEPLOYMENTS)} (got {form!r})")
    config = yaml.safe_load(path.read_text())
    config["admin"]["address"]["socket_address"]["port_value"] = admin_port
    listener = config["static_resources"]["listeners"][0]
    listener["address"]["socket_address"]["port_value"] = listen_port
    hcm = listener_hcm(config)
    wasm_filter = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.wasm")
    if envoy_mcp_filter is not None:
        at = hcm["http_filters"].index(wasm_filter) + (envoy_mcp_filter.place == "after")
        hcm["http_filters"][at:at] = envoy_mcp_filter.entries()
    if plain:
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f is not wasm_filter]
    plugin = wasm_filter["typed_config"]["config"]
    plugin["vm_config"]["code"]["local"]["filename"] = str(wasm)
    plugin_json = json.loads(plugin["configuration"]["value"])
    if not secrets_from_env:
        for obj, field in SECRET_FIELDS:
            section = plugin_json.get(obj, {})
            if f"{field}_env" in section:
                section[field] = DEMO_SECRETS[section.pop(f"{field}_env")]
    for key, value in (plugin_overrides or {}).items():
        if isinstance(value, dict) and isinstance(plugin_json.get(key), dict):
            merged = {**plugin_json[key], **value}
            for obj, field in SECRET_FIELDS:
                if obj == key and field in value:
                    merged.pop(f"{field}_env", None)
                elif obj == key and f"{field}_env" in value:
                    merged.pop(field, None)
            plugin_json[key] = merged
        else:
            plugin_json[key] = value
    plugin["configuration"]["value"] = json.dumps(plugin_json)
    if form == "wasmplugin":
        host_env_keys = plugin["vm_config"].get("environment_variables", {}).get("host_env_keys", [])
        wasm_filter["typed_config"]["config"] = wasmplugin_filter_config(plugin_json, wasm, host_env_keys)
        # A WasmPlugin reaches no further than its filter: the connection manager stays the
        # mesh's, which leaves headers with `_` to Envoy's default (allowed). The filter's own
        # refusal of aliases is then what stands.
        options = hcm.get("common_http_protocol_options", {})
        options.pop("headers_with_underscores_action", None)
        if not options:
            hcm.pop("common_http_protocol_options", None)
    if form == "envoygateway" and not plain:
        # Envoy Gateway's connection manager refuses headers with `_` by default
        # (ClientTrafficPolicy `withUnderscoresAction`), as the shipped one does: kept.
        host_env_keys = plugin["vm_config"].get("environment_variables", {}).get("host_env_keys", [])
        envoygateway_form(hcm, wasm_filter, plugin_json, wasm, host_env_keys)
    tls = resolve_ledger_tls(ledger_tls)
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == "atmost_ledger":
            if tls is None:
                cleartext_ledger_cluster(cluster)
            else:
                validation = cluster["transport_socket"]["typed_config"]["common_tls_context"]["validation_context"]
                validation["trusted_ca"] = {"filename": str(tls.ca)}
            cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
                {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
                for p in ledger_ports
            ]
    return config


def cleartext_ledger_cluster(cluster: dict) -> None:
    """The shipped `atmost_ledger` cluster in its cleartext form: no transport socket, so h2c to
    a ledger without certificate (the form a mesh's mTLS protects)."""
    cluster.pop("transport_socket", None)


class Envoy(Process):
    def __init__(self, log_dir: Path, upstream_port: int, ledger_ports: list[int], plugin_overrides: dict | None = None,
                 concurrency: int = 2, name: str = "envoy", port: int | None = None, plain: bool = False,
                 wait_for_ledger: bool = True, secrets_from_env: bool = False, env: dict | None = None,
                 admin_port: int | None = None, upstream_host: str = "127.0.0.1",
                 deployment_form: str | None = None, provider: Provider | None = None,
                 ledger_tls: LedgerTls | bool = True, envoy_mcp_filter: EnvoyMcpFilter | None = None):
        """`secrets_from_env` keeps the shipped config's env-sourced secrets (see sidecar_config);
        `env` is added to Envoy's environment (where those secrets then come from). With
        `provider`, Envoy runs envoy/atmost-external-provider.yaml for that provider
        (external_provider_config; `upstream_port` and `upstream_host` are not used).
        `ledger_tls` as the ledgers serve it (Ledger's `tls`; `False`: the cleartext form).
        `envoy_mcp_filter`: Envoy's own MCP filter before or after atmost (EnvoyMcpFilter)."""
        self.port = port or free_port()
        self.admin_port = admin_port or free_port()
        self.concurrency = concurrency
        # Envoy reports ready before its first health check of a ledger has passed; on a busy
        # machine that check can time out, and with no healthy ledger every callout fails
        # (gateway_unavailable). A test that means to start without a ledger says so.
        self.ledger_hosts = [] if plain or not wait_for_ledger else [f"127.0.0.1:{p}" for p in ledger_ports]
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.admin_url = f"http://127.0.0.1:{self.admin_port}"
        self.deployment_form = deployment_form or deployment()
        if provider is None:
            config = sidecar_config(self.port, self.admin_port, upstream_port, ledger_ports, plugin_overrides,
                                    plain=plain, secrets_from_env=secrets_from_env, upstream_host=upstream_host,
                                    deployment_form=self.deployment_form, ledger_tls=ledger_tls,
                                    envoy_mcp_filter=envoy_mcp_filter)
        else:
            config = external_provider_config(self.port, self.admin_port, ledger_ports, provider, plugin_overrides,
                                              plain=plain, secrets_from_env=secrets_from_env,
                                              deployment_form=self.deployment_form, ledger_tls=ledger_tls,
                                              envoy_mcp_filter=envoy_mcp_filter)
        self.config_path = Path(tempfile.mkdtemp(prefix="atmost-envoy-")) / "envoy.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        argv = [str(VENV_BIN / "envoy"), "-c", str(self.config_path), "--concurrency", str(concurrency),
                "--use-dynamic-base-id", "-l", "info", "--component-log-level", "wasm:debug"]
        super().__init__(name, argv, log_dir, env=env)

    def start(self, wait_for_ledger: bool = True) -> None:
        super().start()
        self.wait_started(self._ready, 30, f"envoy on {self.url}")
        if self.ledger_hosts and wait_for_ledger:
            wait_until(self.ledgers_healthy, 30, f"every ledger healthy in {self.name}")

    def _ready(self) -> bool:
        return http_get(self.admin_url + "/ready")[0] == 200

    def ledgers_healthy(self) -> bool:
        clusters = http_get(self.admin_url + "/clusters")[1].decode()
        return all(f"atmost_ledger::{host}::health_flags::healthy" in clusters for host in self.ledger_hosts)

    def stats(self) -> dict[str, int]:
        text = http_get(self.admin_url + "/stats?usedonly")[1].decode()
        out: dict[str, int] = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().lstrip("-").isdigit():
                out[name] = int(value)
        return out

    def stat(self, name: str) -> int:
        return self.stats().get(name, 0)
