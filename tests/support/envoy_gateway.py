"""The Envoy configuration Envoy Gateway renders for the objects under envoy/gateway/, built from
those objects as `kubectl kustomize` renders them, so that a change in the manifests changes the
configuration the tests run.

What follows Envoy Gateway v1.9.0 (the release whose CRD schemas tests/files/schemas/ keeps), by
its source:
- the Wasm filter (internal/xds/translator/wasm.go; envoygateway_wasm_filter in
  scripts/atmost_stack.py, which the `envoygateway` deployment form of the suites uses too): one
  HTTP filter per Wasm entry of an EnvoyExtensionPolicy, disabled in the connection manager and
  enabled on each route of the policy's target; here its code is `remote`, as Envoy Gateway gives
  it: fetched over HTTP through the cluster `wasm_cluster` from Envoy Gateway's Wasm cache, checked
  against the SHA-256 of the module (not of the image), ten retries from 1 s to 30 s;
- routes (internal/xds/translator/route.go): a route per HTTPRoute match named
  `httproute/<ns>/<name>/rule/<i>/match/<j>/<host>`, its cluster `httproute/<ns>/<name>/rule/<i>`,
  `timeout` from the rule's `timeouts.request` (and `idle_timeout` after it), a `retry_policy` only
  where a BackendTrafficPolicy sets `retry` (envoygateway_retry_policy), a PathPrefix other
  than `/` as `path_separated_prefix`, a method as a `:method` header match, routes with a method
  ahead of routes without;
- the listener and connection manager (internal/xds/translator/listener.go and its test data
  testdata/out/xds-ir/wasm.listeners.yaml): `per_connection_buffer_limit_bytes` from a
  ClientTrafficPolicy's `connection.bufferLimit` (32768 without one),
  `headers_with_underscores_action` from its `headers.withUnderscoresAction` (REJECT_REQUEST without
  one), `use_remote_address`, path normalization, the router with `suppress_envoy_headers`;
- an EnvoyPatchPolicy's `add` with an empty path (internal/xds/translator/jsonpatch.go): the value
  is a whole resource, added as it is.

What stands in for the cluster: the listener on a loopback port; the route clusters STATIC on the
test's upstream; `wasm_cluster` plain HTTP to a loopback server that serves the module taken out of
the OCI image `make oci` built, as Envoy Gateway's cache serves what it pulled (Envoy Gateway's own
is HTTPS with a client certificate from the control plane; that channel is its business, the
module and its checksum are ours); the ledger cluster of the EnvoyPatchPolicy kept whole except
its endpoints (loopback ports) and the CA file it trusts (the test's CA; `sni` and the expected
name stay the manifest's). Route configuration is inline where Envoy Gateway sends it by RDS.

The objects themselves (render_gateway): every kustomization under envoy/gateway/ rendered from a
copy of envoy/ with the operator's inputs in place, the digests the caller gives (stand-ins in
tests/files/test_envoy_gateway_manifests.py, what `make oci` built in tests/e2e/test_envoy_gateway.py).
"""

from __future__ import annotations

import copy
import gzip
import hashlib
import io
import json
import re
import shutil
import tarfile
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.support.manifests import kustomize, set_digests
from tests.support.stack import ROOT, envoygateway_retry_policy, envoygateway_route_enable, envoygateway_wasm_filter

WASM_CLUSTER = "wasm_cluster"
ROUTER = {"name": "envoy.filters.http.router",
          "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
                           "suppress_envoy_headers": True}}
# Envoy Gateway's defaults where no policy says otherwise.
DEFAULT_BUFFER_LIMIT = 32768
UNDERSCORES = {"RejectRequest": "REJECT_REQUEST", "DropHeader": "DROP_HEADER", "Allow": "ALLOW"}
WASM_FETCH_TIMEOUT = "10s"
PATCH_CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
QUANTITY_RE = re.compile(r"^([1-9][0-9]*)([EPTGMK]i|[EPTGMk])?$")
QUANTITY_UNITS = {None: 1, "k": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12, "P": 10 ** 15, "E": 10 ** 18,
                  "Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40, "Pi": 2 ** 50, "Ei": 2 ** 60}


def quantity_bytes(value) -> int:
    """A Kubernetes quantity as Envoy Gateway reads a buffer limit (`2Mi`, `32768`)."""
    match = QUANTITY_RE.fullmatch(str(value))
    if not match:
        raise ValueError(f"not a buffer limit quantity: {value!r}")
    return int(match.group(1)) * QUANTITY_UNITS[match.group(2)]


def duration_seconds(value: str) -> int:
    """A Gateway API duration (`120s`, `2m`, `1h30m`, `0s`) in whole seconds."""
    parts = re.findall(r"(\d+)(ms|s|m|h)", value)
    if not parts or "".join(n + u for n, u in parts) != value:
        raise ValueError(f"not a Gateway API duration: {value!r}")
    return int(sum(int(n) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[u] for n, u in parts))


def of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o.get("kind") == kind]


def targets(policy: dict, kind: str, name: str, namespace: str) -> bool:
    """Whether a policy (same namespace as its target, as Envoy Gateway requires) names the object."""
    spec = policy["spec"]
    refs = spec.get("targetRefs", []) + ([spec["targetRef"]] if "targetRef" in spec else [])
    return policy["metadata"]["namespace"] == namespace and any(
        r.get("kind") == kind and r.get("name") == name for r in refs)


def wasm_from_oci_layout(layout: Path, manifest_digest: str) -> bytes:
    """plugin.wasm out of the image `manifest_digest` of an OCI layout, as Envoy Gateway's image
    fetcher takes it (internal/wasm/imagefetcher.go: the last layer, tar+gzip, the file
    `plugin.wasm`), after checking the manifest has the digest the policy pins."""
    algorithm, hex_digest = manifest_digest.split(":")
    blob = layout / "blobs" / algorithm / hex_digest
    manifest_bytes = blob.read_bytes()
    if hashlib.sha256(manifest_bytes).hexdigest() != hex_digest:
        raise ValueError(f"the manifest blob {blob} does not have the digest {manifest_digest}")
    manifest = json.loads(manifest_bytes)
    layer = manifest["layers"][-1]
    if not layer["mediaType"].endswith("tar+gzip"):
        raise ValueError(f"the image's last layer is {layer['mediaType']}, not tar+gzip")
    data = (layout / "blobs" / Path(*layer["digest"].split(":"))).read_bytes()
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(data))) as tar:
        member = tar.extractfile("plugin.wasm")
        if member is None:
            raise ValueError("no plugin.wasm in the image's last layer")
        return member.read()


class WasmServer:
    """A loopback HTTP server serving one module at /<sha256>.wasm, as Envoy Gateway's Wasm cache
    serves the modules it pulled; counts the requests it answered."""

    def __init__(self, module: bytes):
        self.module = module
        self.sha256 = hashlib.sha256(module).hexdigest()
        self.path = f"/{self.sha256}.wasm"
        self.fetches = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path != server.path:
                    self.send_response(404)
                    self.send_header("content-length", "0")
                    self.end_headers()
                    return
                server.fetches += 1
                self.send_response(200)
                self.send_header("content-type", "application/wasm")
                self.send_header("content-length", str(len(server.module)))
                self.end_headers()
                self.wfile.write(server.module)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}{self.path}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def remote_code(self) -> dict:
        """The VM's code as Envoy Gateway gives it: fetched over HTTP through `wasm_cluster`, checked
        against the module's SHA-256, ten retries from 1 s to 30 s."""
        return {"remote": {"http_uri": {"uri": self.url, "cluster": WASM_CLUSTER, "timeout": WASM_FETCH_TIMEOUT},
                           "sha256": self.sha256,
                           "retry_policy": {"num_retries": 10,
                                            "retry_back_off": {"base_interval": "1s", "max_interval": "30s"}}}}

    def start(self) -> "WasmServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def static_cluster(name: str, port: int, **extra) -> dict:
    return {"name": name, "type": "STATIC", "connect_timeout": "10s",
            "per_connection_buffer_limit_bytes": DEFAULT_BUFFER_LIMIT,
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]},
            **extra}


def route_match(match: dict) -> dict:
    path = match.get("path", {"type": "PathPrefix", "value": "/"})
    if path["type"] == "PathPrefix":
        out = {"prefix": "/"} if path["value"] == "/" else {"path_separated_prefix": path["value"].rstrip("/")}
    elif path["type"] == "Exact":
        out = {"path": path["value"]}
    else:
        raise ValueError(f"path match {path['type']} is not rendered here")
    headers = []
    if "method" in match:
        headers.append({"name": ":method", "string_match": {"exact": match["method"]}})
    headers += [{"name": h["name"], "string_match": {"exact": h["value"]}} for h in match.get("headers", [])]
    if headers:
        out["headers"] = headers
    return out


def render(objects: list[dict], *, listen_port: int, admin_port: int, upstream_port: int, module: WasmServer) -> dict:
    """Envoy's configuration for the one Gateway among `objects`, its one HTTP listener and the
    HTTPRoutes attached to it, with the policies that target them."""
    [gateway] = of_kind(objects, "Gateway")
    gw_ns, gw_name = gateway["metadata"]["namespace"], gateway["metadata"]["name"]
    [listener] = [ln for ln in gateway["spec"]["listeners"] if ln["protocol"] == "HTTP"]
    listener_name = f"{gw_ns}/{gw_name}/{listener['name']}"
    # Envoy Gateway listens on port + 10000 below 1024 (an unprivileged container port).
    container_port = listener["port"] + 10000 if listener["port"] < 1024 else listener["port"]

    client = [p for p in of_kind(objects, "ClientTrafficPolicy") if targets(p, "Gateway", gw_name, gw_ns)]
    buffer_limit, underscores = DEFAULT_BUFFER_LIMIT, "REJECT_REQUEST"
    for policy in client:
        if "bufferLimit" in policy["spec"].get("connection", {}):
            buffer_limit = quantity_bytes(policy["spec"]["connection"]["bufferLimit"])
        if "withUnderscoresAction" in policy["spec"].get("headers", {}):
            underscores = UNDERSCORES[policy["spec"]["headers"]["withUnderscoresAction"]]

    http_filters: list[dict] = []
    routes: list[dict] = []
    clusters: list[dict] = []
    for route in of_kind(objects, "HTTPRoute"):
        r_ns, r_name = route["metadata"]["namespace"], route["metadata"]["name"]
        if not any(p.get("name") == gw_name and p.get("namespace", r_ns) == gw_ns
                   and p.get("sectionName", listener["name"]) == listener["name"] for p in route["spec"]["parentRefs"]):
            continue
        extensions = [p for p in of_kind(objects, "EnvoyExtensionPolicy") if targets(p, "HTTPRoute", r_name, r_ns)]
        enabled = []
        for policy in extensions:
            for index in range(len(policy["spec"].get("wasm", []))):
                wasm = envoygateway_wasm_filter(policy, index, module.remote_code())
                http_filters.append(wasm)
                enabled.append(wasm["name"])
        backend = [p for p in of_kind(objects, "BackendTrafficPolicy") if targets(p, "HTTPRoute", r_name, r_ns)]
        retry = next((p["spec"]["retry"] for p in backend if "retry" in p["spec"]), None)
        for i, rule in enumerate(route["spec"]["rules"]):
            cluster = f"httproute/{r_ns}/{r_name}/rule/{i}"
            clusters.append(static_cluster(cluster, upstream_port))
            for j, match in enumerate(rule.get("matches", [{}])):
                action = {"cluster": cluster, "upgrade_configs": [{"upgrade_type": "websocket"}]}
                if "request" in rule.get("timeouts", {}):
                    action["timeout"] = rule["timeouts"]["request"]
                    # The stream idle timeout follows: an hour, the request timeout if longer, none
                    # where the request has none (route.go, idleTimeout).
                    timeout = duration_seconds(rule["timeouts"]["request"])
                    action["idle_timeout"] = f"{0 if timeout == 0 else max(3600, timeout)}s"
                if retry is not None:
                    action["retry_policy"] = envoygateway_retry_policy(retry)
                out = {"name": f"httproute/{r_ns}/{r_name}/rule/{i}/match/{j}/*", "match": route_match(match),
                       "route": action}
                for name in enabled:
                    envoygateway_route_enable(out, name)
                routes.append(out)
    # More specific first: a method match ahead of none (Envoy Gateway's route sorting).
    routes.sort(key=lambda r: not r["match"].get("headers"))

    for policy in of_kind(objects, "EnvoyPatchPolicy"):
        if not targets(policy, "Gateway", gw_name, gw_ns):
            continue
        for patch in policy["spec"]["jsonPatches"]:
            operation = patch["operation"]
            if patch["type"] != PATCH_CLUSTER_TYPE or operation["op"] != "add" or operation.get("path"):
                raise ValueError(f"only whole clusters added are rendered here, not {patch}")
            clusters.append(copy.deepcopy(operation["value"]))

    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [{
                "name": listener_name,
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen_port}},
                "per_connection_buffer_limit_bytes": buffer_limit,
                "default_filter_chain": {"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
                                 ".HttpConnectionManager",
                        "stat_prefix": f"http-{container_port}",
                        "common_http_protocol_options": {"headers_with_underscores_action": underscores},
                        "use_remote_address": True,
                        "normalize_path": True,
                        "merge_slashes": True,
                        "path_with_escaped_slashes_action": "UNESCAPE_AND_REDIRECT",
                        "server_header_transformation": "PASS_THROUGH",
                        "http_filters": http_filters + [ROUTER],
                        "route_config": {"name": listener_name, "ignore_port_in_host_matching": True,
                                         "virtual_hosts": [{"name": f"{listener_name}/*", "domains": ["*"],
                                                            "routes": routes}]},
                    }}]},
            }],
            "clusters": clusters + [static_cluster(WASM_CLUSTER, module.port)],
        },
    }


def point_ledger_cluster_at(config: dict, cluster_name: str, ledger_ports: list[int], ca: Path) -> dict:
    """The EnvoyPatchPolicy's ledger cluster with this run's endpoints (STATIC on loopback) and
    CA file; everything else as the manifest says."""
    [cluster] = [c for c in config["static_resources"]["clusters"] if c["name"] == cluster_name]
    cluster["type"] = "STATIC"
    cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
        for p in ledger_ports]}]
    tls = cluster["transport_socket"]["typed_config"]
    tls["common_tls_context"]["validation_context"]["trusted_ca"] = {"filename": str(ca)}
    return cluster


# ---------------------------------------------------------------- the manifests, rendered

ENVOY_DIR = ROOT / "envoy"
EG_DIR = ENVOY_DIR / "gateway"
EG_DOC = ROOT / "docs" / "envoy-gateway.md"
KUSTOMIZATIONS = sorted(str(p.parent.relative_to(EG_DIR)) for p in EG_DIR.rglob("kustomization.yaml"))
BASE, MCP_OVERLAY, LEDGER_OVERLAY = "mcp", "overlays/mcp-server", "overlays/ledger-postgres"


def ledger_env_file() -> dict[str, str]:
    return {"service-token": uuid.uuid4().hex * 2, "admin-token": uuid.uuid4().hex * 2,
            "store-url": "postgres://atmost@db.example.internal:5432/atmost?sslmode=verify-full"}


def render_gateway(parent: Path, digests: dict[str, str], ledger_env: dict[str, str]) -> dict[str, list[dict]]:
    """kustomization (relative to envoy/gateway/) -> its rendered objects, the operator's inputs in
    place: `digests` (ledger, filter) where docs/envoy-gateway.md step 0 writes them, `ledger_env`
    as the ledger overlay's ledger.env. The whole of envoy/ is copied: the ledger overlay builds
    on envoy/istio/ledger/."""
    tree = parent / "envoy"
    shutil.copytree(ENVOY_DIR, tree, ignore=shutil.ignore_patterns("ledger.env"))
    set_digests(tree / "gateway", digests["ledger"], digests["filter"])
    (tree / "gateway" / LEDGER_OVERLAY / "ledger.env").write_text("".join(f"{k}={v}\n" for k, v in ledger_env.items()))
    return {k: kustomize(tree / "gateway" / k) for k in KUSTOMIZATIONS}


def one(objects: list[dict], kind: str) -> dict:
    [obj] = of_kind(objects, kind)
    return obj


def plugin_of(objects: list[dict]) -> dict:
    [entry] = one(objects, "EnvoyExtensionPolicy")["spec"]["wasm"]
    return entry
