"""The Kubernetes / Istio manifests under envoy/istio/ validate against their schemas and say what
the rollout needs: a fail-closed filter per agent pod, the ledger's cluster, Secret-held
credentials (the filter's own taken from the sidecar's environment, never written into a
manifest), a NetworkPolicy that admits only sidecars and admins, and no retries.

Istio kinds are checked against the openAPIV3Schema of the Istio CRDs in
tests/e2e/schemas/istio-crds.yaml (their source: the README beside it), in strict mode (an unknown
field is an error, as with `kubectl apply --validate=strict`). Core kinds are checked with
kubernetes-validate's strict schemas for K8S_VERSION.
"""

from __future__ import annotations

import copy
import json
import re
from functools import lru_cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.support.stack import ROOT, WASM, validate_envoy_config

ISTIO_DIR = ROOT / "envoy" / "istio"
ISTIO_CRDS = ROOT / "tests" / "e2e" / "schemas" / "istio-crds.yaml"
EQUIVALENT_ENVOY = ISTIO_DIR / "equivalent-envoy.yaml"
K8S_VERSION = "1.37"  # the newest Kubernetes whose schemas kubernetes-validate 1.37.0 ships

# Deploy-time values (rendered with envsubst in a real rollout); the tests render these. No
# secret is among them: the filter's secrets come from the sidecar's environment.
PLACEHOLDERS = {
    "ATMOST_FILTER_IMAGE": "registry.example.com/atmost/atmost-filter",
    "ATMOST_FILTER_DIGEST": "3f" * 32,
}
# The sidecar's environment variables the filter's secrets come from, in this order.
SECRET_ENV = ["ATMOST_SERVICE_TOKEN", "ATMOST_UPSTREAM_KEY_SECRET"]
# `envoy --mode validate` runs the filter's on_configure, which reads them.
VALIDATION_ENV = {"ATMOST_SERVICE_TOKEN": "validation-service-token",
                  "ATMOST_UPSTREAM_KEY_SECRET": "validation-upstream-key-secret"}
PLACEHOLDER_RE = re.compile(r"\$\{([A-Za-z0-9_]+)\}")

PLUGIN_KEYS = {"ledger", "permit_header", "governed_tools", "key_required_tools", "upstream_key", "denial_format",
               "max_body_bytes", "max_receipt_bytes", "report_interval_ms"}
LEDGER_KEYS = {"cluster", "authority", "timeout_ms", "service_token_env"}
AGENT_LABEL = "atmost.dev/agent"


def is_envoy_config(path: Path) -> bool:
    return bool(yaml.safe_load(path.read_text()).get("static_resources"))


MANIFESTS = sorted(p for p in ISTIO_DIR.rglob("*.yaml") if not is_envoy_config(p))


def render(text: str) -> str:
    return PLACEHOLDER_RE.sub(lambda m: PLACEHOLDERS[m.group(1)], text)


def load(path: Path) -> dict:
    docs = [d for d in yaml.safe_load_all(render(path.read_text())) if d is not None]
    assert len(docs) == 1, f"{path}: one object per file (tests/e2e/test_envoy_configs.py loads each file as one document)"
    return docs[0]


def objects() -> dict[str, dict]:
    """kind -> the (single) shipped object of that kind."""
    out: dict[str, dict] = {}
    for path in MANIFESTS:
        doc = load(path)
        assert doc["kind"] not in out, f"two {doc['kind']} objects"
        out[doc["kind"]] = doc
    return out


# ---------------------------------------------------------------- Istio CRD schema validation


def _structural_to_jsonschema(node):
    """A CRD structural schema (OpenAPI v3) as a JSON Schema, strict about unknown fields.

    - `nullable: true` admits null;
    - `x-kubernetes-int-or-string` admits integers and strings;
    - an object with `properties` and neither `additionalProperties` nor
      `x-kubernetes-preserve-unknown-fields` refuses other fields (the API server would prune
      them silently; strict field validation refuses them, and so do we);
    - `x-kubernetes-preserve-unknown-fields` objects stay open (pluginConfig, EnvoyFilter values);
    - `format`s are checked by FORMATS (int32/int64 ranges); others are annotations;
    - CEL rules (`x-kubernetes-validations`) are not evaluated here: the ones that matter for the
      shipped kinds are checked in `istio_cel_errors`.
    """
    if isinstance(node, list):
        return [_structural_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _structural_to_jsonschema(v) for k, v in node.items()
           if k not in ("description", "x-kubernetes-validations")}
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["type"] = ["integer", "string"]
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


FORMATS = jsonschema.FormatChecker()


@FORMATS.checks("int32")
def _int32(value) -> bool:
    return not isinstance(value, int) or -(2 ** 31) <= value < 2 ** 31


@FORMATS.checks("int64")
def _int64(value) -> bool:
    return not isinstance(value, int) or -(2 ** 63) <= value < 2 ** 63


OBJECT_META = {
    "type": "object",
    "required": ["name", "namespace"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
                 "maxLength": 253},
        "namespace": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "labels": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 63}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


@lru_cache(maxsize=1)
def istio_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> JSON Schema, for every served version of every Istio CRD."""
    schemas = {}
    for crd in yaml.safe_load_all(ISTIO_CRDS.read_text()):
        if not crd or crd.get("kind") != "CustomResourceDefinition":
            continue
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if not version.get("served"):
                continue
            api_version = f"{group}/{version['name']}"
            schema = _structural_to_jsonschema(version["schema"]["openAPIV3Schema"])
            schema["properties"] = {**schema["properties"], "apiVersion": {"const": api_version},
                                    "kind": {"const": kind}, "metadata": OBJECT_META}
            schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata"})
            schema["additionalProperties"] = False
            schemas[(api_version, kind)] = schema
    return schemas


def is_istio(doc: dict) -> bool:
    return doc.get("apiVersion", "").split("/")[0].endswith(".istio.io")


def istio_cel_errors(doc: dict) -> list[str]:
    """The CRDs' CEL rules that apply to the shipped kinds, evaluated by hand."""
    spec, errors = doc.get("spec", {}), []
    if doc["kind"] == "WasmPlugin":
        if sum(k in spec for k in ("selector", "targetRef", "targetRefs")) > 1:
            errors.append("only one of targetRefs or selector can be set")
        scheme = spec.get("url", "").split("://")[0] if "://" in spec.get("url", "") else ""
        if scheme not in ("", "http", "https", "oci", "file"):
            errors.append("url must have schema one of [http, https, file, oci]")
        for env in spec.get("vmConfig", {}).get("env", []):
            if env.get("valueFrom") == "HOST" and "value" in env:
                errors.append("value may only be set when valueFrom is INLINE")
    labels = (spec.get("selector", {}).get("matchLabels") or spec.get("workloadSelector", {}).get("labels") or {})
    for key, value in labels.items():
        if not key or "*" in key or "*" in value:
            errors.append("wildcard or empty key in label match")
    if doc["kind"] == "EnvoyFilter":
        for patch in spec.get("configPatches", []):
            match = patch.get("match", {})
            if ("waypoint" in match) != (match.get("context") == "WAYPOINT"):
                errors.append("only support waypointMatch when context is WAYPOINT")
    return errors


def istio_errors(doc: dict) -> list[str]:
    """Every schema violation of an Istio object (empty when it validates)."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    schema = istio_schemas().get(key)
    if schema is None:
        return [f"no served Istio CRD version for {key}"]
    validator = jsonschema.Draft7Validator(schema, format_checker=FORMATS)
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(doc)]
    return errors + istio_cel_errors(doc)


def kubernetes_errors(doc: dict) -> list[str]:
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.path)) or '<root>'}: {e.message}"]
    return []


def errors_of(doc: dict) -> list[str]:
    return istio_errors(doc) if is_istio(doc) else kubernetes_errors(doc)


# ---------------------------------------------------------------- every manifest validates


def test_manifests_present():
    kinds = {load(p)["kind"] for p in MANIFESTS}
    assert kinds == {"Namespace", "ServiceAccount", "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy",
                     "ServiceEntry", "WasmPlugin", "EnvoyFilter", "VirtualService"}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(ISTIO_DIR)))
def test_manifest_validates(path: Path):
    doc = load(path)
    assert errors_of(doc) == []


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(ISTIO_DIR)))
def test_placeholders_are_known_and_documented(path: Path):
    text = path.read_text()
    used = set(PLACEHOLDER_RE.findall(text))
    assert used <= set(PLACEHOLDERS), f"unknown deploy-time values: {used - set(PLACEHOLDERS)}"
    comments = "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
    for name in used:
        assert f"${{{name}}}" in comments, f"{name} is used but not explained in the file's comments"


# ---------------------------------------------------------------- the validators can fail


def test_istio_validator_rejects_broken_copies():
    objs = objects()
    wasm_plugin = objs["WasmPlugin"]
    assert istio_errors(wasm_plugin) == []

    misspelled = copy.deepcopy(wasm_plugin)
    misspelled["spec"]["failStrategey"] = misspelled["spec"].pop("failStrategy")
    assert any("failStrategey" in e for e in istio_errors(misspelled))

    envoy_spelling = copy.deepcopy(wasm_plugin)
    envoy_spelling["spec"]["failStrategy"] = "FAIL_CLOSED"  # Envoy's name, not Istio's
    assert any("FAIL_CLOSED" in e for e in istio_errors(envoy_spelling))

    bad_digest = copy.deepcopy(wasm_plugin)
    bad_digest["spec"]["sha256"] = "sha256:" + "0" * 64
    assert istio_errors(bad_digest)

    both_selectors = copy.deepcopy(wasm_plugin)
    both_selectors["spec"]["targetRefs"] = [{"kind": "Service", "name": "x"}]
    assert "only one of targetRefs or selector can be set" in istio_errors(both_selectors)

    host_with_value = copy.deepcopy(wasm_plugin)
    host_with_value["spec"]["vmConfig"]["env"][0]["value"] = "a literal secret"
    assert "value may only be set when valueFrom is INLINE" in istio_errors(host_with_value)

    unknown_source = copy.deepcopy(wasm_plugin)
    unknown_source["spec"]["vmConfig"]["env"][0]["valueFrom"] = "SECRET"
    assert any("SECRET" in e for e in istio_errors(unknown_source))

    envoy_filter = copy.deepcopy(objs["EnvoyFilter"])
    envoy_filter["spec"]["configPatches"][1]["match"]["listner"] = envoy_filter["spec"]["configPatches"][1]["match"].pop("listener")
    assert any("listner" in e for e in istio_errors(envoy_filter))


def test_kubernetes_validator_rejects_broken_copies():
    objs = objects()
    deployment = copy.deepcopy(objs["Deployment"])
    deployment["spec"]["replica"] = deployment["spec"].pop("replicas")
    assert any("replica" in e for e in kubernetes_errors(deployment))

    policy = copy.deepcopy(objs["NetworkPolicy"])
    policy["spec"]["ingress"][0]["form"] = policy["spec"]["ingress"][0].pop("from")
    assert kubernetes_errors(policy)

    pdb = copy.deepcopy(objs["PodDisruptionBudget"])
    pdb["spec"]["minAvailable"] = [1]
    assert kubernetes_errors(pdb)


# ---------------------------------------------------------------- what the rollout needs


def ledger_cluster(objs) -> tuple[str, int]:
    entry = objs["ServiceEntry"]["spec"]
    return entry["hosts"][0], entry["ports"][0]["number"]


def test_wasmplugin_is_per_agent_fail_closed_and_complete():
    objs = objects()
    spec = objs["WasmPlugin"]["spec"]
    assert spec["failStrategy"] == "FAIL_CLOSE"
    assert spec["selector"]["matchLabels"].get(AGENT_LABEL), "the plugin must select one agent's pods"
    assert spec["phase"] in ("AUTHN", "AUTHZ", "STATS")
    assert spec["type"] == "HTTP"
    assert spec["match"] and all(m["mode"] == "CLIENT" and m["ports"] for m in spec["match"])
    assert spec["url"].startswith("oci://")
    assert spec["url"].endswith("@sha256:" + spec["sha256"]), "pin the image by digest"
    assert spec["imagePullPolicy"] in ("IfNotPresent", "Always")

    config = spec["pluginConfig"]
    assert set(config) == PLUGIN_KEYS
    assert set(config["ledger"]) == LEDGER_KEYS
    assert set(config["upstream_key"]) == {"mode", "secret_env"}
    host, port = ledger_cluster(objs)
    assert config["ledger"]["cluster"] == f"outbound|{port}||{host}"
    assert config["ledger"]["authority"] == host
    # Secrets come from the sidecar's environment: pluginConfig names the variables, and
    # vmConfig.env lists them with valueFrom HOST (istiod turns that into host_env_keys).
    assert [config["ledger"]["service_token_env"], config["upstream_key"]["secret_env"]] == SECRET_ENV
    assert spec["vmConfig"] == {"env": [{"name": name, "valueFrom": "HOST"} for name in SECRET_ENV]}


def host_env_keys_of(wasm_plugin_spec: dict) -> list[str]:
    """What istiod makes of a WasmPlugin's vmConfig.env for the VM's host_env_keys: the names whose
    valueFrom is HOST, in order (Istio source, pilot/pkg/model/extensions.go, buildVMConfig)."""
    return [e["name"] for e in wasm_plugin_spec.get("vmConfig", {}).get("env", []) if e.get("valueFrom") == "HOST"]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(ISTIO_DIR)))
def test_no_agent_manifest_carries_a_filter_secret(path: Path):
    """Neither a value nor a deploy-time placeholder for one: the filter's secrets are not
    rendered into Istio objects (whoever may `get` those, or read /config_dump, would read them)."""
    text = path.read_text()
    for name in SECRET_ENV:
        assert f"${{{name}}}" not in text and f"$({name})" not in text, f"{path}: {name} rendered in"
    for plugin in plugin_configs(load(path)):
        assert "service_token" not in plugin.get("ledger", {}), f"{path}: in-place service_token"
        assert "secret" not in plugin.get("upstream_key", {}), f"{path}: in-place upstream_key.secret"


def plugin_configs(doc: dict) -> list[dict]:
    """The filter's plugin configuration(s) an Istio object carries."""
    if doc["kind"] == "WasmPlugin":
        return [doc["spec"]["pluginConfig"]]
    if doc["kind"] == "EnvoyFilter":
        return [json.loads(p["patch"]["value"]["typed_config"]["config"]["configuration"]["value"])
                for p in doc["spec"]["configPatches"] if p["applyTo"] == "EXTENSION_CONFIG"]
    return []


def test_secret_checks_see_the_plugin_configs():
    """The check above would find an in-place secret in both the WasmPlugin and the EnvoyFilter."""
    objs = objects()
    assert len(plugin_configs(objs["WasmPlugin"])) == 1 and len(plugin_configs(objs["EnvoyFilter"])) == 1
    for kind in ("WasmPlugin", "EnvoyFilter"):
        assert all("service_token_env" in p["ledger"] for p in plugin_configs(objs[kind]))


def envoyfilter_parts(objs) -> tuple[dict, dict]:
    patches = objs["EnvoyFilter"]["spec"]["configPatches"]
    ext = next(p for p in patches if p["applyTo"] == "EXTENSION_CONFIG")
    http = next(p for p in patches if p["applyTo"] == "HTTP_FILTER")
    return ext, http


def test_envoyfilter_delivers_the_same_filter_with_stop_iteration():
    objs = objects()
    wasm_plugin = objs["WasmPlugin"]["spec"]
    ext, http = envoyfilter_parts(objs)
    assert objs["EnvoyFilter"]["spec"]["workloadSelector"]["labels"] == wasm_plugin["selector"]["matchLabels"]

    assert ext["patch"]["operation"] == "ADD"
    wasm = ext["patch"]["value"]["typed_config"]
    assert wasm["@type"] == "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
    config = wasm["config"]
    assert config["allow_on_headers_stop_iteration"] is True
    assert config["failure_policy"] == "FAIL_CLOSED"
    assert config["root_id"] == wasm_plugin["pluginName"]
    remote = config["vm_config"]["code"]["remote"]
    assert remote["http_uri"]["uri"] == wasm_plugin["url"]
    assert remote["sha256"] == wasm_plugin["sha256"]
    assert json.loads(config["configuration"]["value"]) == wasm_plugin["pluginConfig"]
    # The same variables, as istiod would list them for the WasmPlugin.
    assert config["vm_config"]["environment_variables"] == {"host_env_keys": host_env_keys_of(wasm_plugin)}

    assert http["match"]["context"] == "SIDECAR_OUTBOUND"
    assert http["match"]["listener"]["portNumber"] in {p["number"] for m in wasm_plugin["match"] for p in m["ports"]}
    assert http["patch"]["operation"] == "INSERT_BEFORE"
    assert http["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == "envoy.filters.http.router"
    # The HTTP filter's config_discovery fetches the ECDS resource of the same name.
    assert http["patch"]["value"]["name"] == ext["patch"]["value"]["name"]
    assert http["patch"]["value"]["config_discovery"]["type_urls"] == [wasm["@type"]]


def test_envoyfilter_wasm_config_passes_envoy_validate(tmp_path):
    """The EnvoyFilter's Wasm config, with its code made local, loads in real Envoy."""
    assert WASM.exists(), "build the filter first (make wasm)"
    ext, _ = envoyfilter_parts(objects())
    wasm = copy.deepcopy(ext["patch"]["value"]["typed_config"])
    wasm["config"]["vm_config"]["code"] = {"local": {"filename": str(WASM)}}
    config = yaml.safe_load(EQUIVALENT_ENVOY.read_text())
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    index = next(i for i, f in enumerate(hcm["http_filters"]) if f["name"] == "atmost")
    hcm["http_filters"][index] = {"name": "atmost", "typed_config": wasm}
    path = tmp_path / "envoyfilter-as-envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    result = validate_envoy_config(path, env=VALIDATION_ENV)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    # The filter's on_configure did read the variables: without them the same config is refused.
    result = validate_envoy_config(path, env={**VALIDATION_ENV, "ATMOST_SERVICE_TOKEN": ""})
    assert result.returncode != 0 and "field `ledger.service_token_env`" in result.stdout + result.stderr


def test_equivalent_envoy_config_mirrors_the_manifests():
    objs = objects()
    config = yaml.safe_load(EQUIVALENT_ENVOY.read_text())
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    wasm = next(f for f in hcm["http_filters"] if f["name"] == "atmost")["typed_config"]["config"]
    ext, _ = envoyfilter_parts(objs)
    mesh = ext["patch"]["value"]["typed_config"]["config"]
    for key in ("name", "root_id", "allow_on_headers_stop_iteration", "failure_policy"):
        assert wasm[key] == mesh[key]
    assert wasm["vm_config"]["code"]["local"]["filename"] == "target/wasm32-wasip1/wasm/atmost_filter.wasm"
    assert wasm["vm_config"]["environment_variables"] == mesh["vm_config"]["environment_variables"]

    plugin = json.loads(wasm["configuration"]["value"])
    expected = objs["WasmPlugin"]["spec"]["pluginConfig"]
    assert plugin == expected
    clusters = {c["name"] for c in config["static_resources"]["clusters"]}
    assert expected["ledger"]["cluster"] in clusters
    assert "retry_policy" not in EQUIVALENT_ENVOY.read_text()


def test_envoy_config_suite_picks_up_only_the_equivalent_config():
    from tests.e2e.test_envoy_configs import SHIPPED

    assert EQUIVALENT_ENVOY in SHIPPED
    assert not set(MANIFESTS) & set(SHIPPED)


def test_mcp_routes_have_no_retries():
    objs = objects()
    vs = objs["VirtualService"]["spec"]
    ports = {p["number"] for m in objs["WasmPlugin"]["spec"]["match"] for p in m["ports"]}
    assert vs["http"], "routes expected"
    for route in vs["http"]:
        assert route["retries"]["attempts"] == 0, route
        for destination in route["route"]:
            assert destination["destination"]["host"] in vs["hosts"]
            assert destination["destination"]["port"]["number"] in ports


def test_networkpolicy_admits_only_sidecars_and_admins():
    objs = objects()
    policy = objs["NetworkPolicy"]["spec"]
    pod_labels = objs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert policy["policyTypes"] == ["Ingress"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert len(policy["ingress"]) == 2

    sidecars, admins = policy["ingress"]
    for rule in (sidecars, admins):
        assert rule.get("from"), "an ingress rule without `from` admits everyone"
        assert rule["ports"] == [{"protocol": "TCP", "port": 8081}]
        assert all("ipBlock" not in peer for peer in rule["from"])

    # Sidecars: pods that carry the label the filter's selector uses, in any namespace.
    assert sidecars["from"] == [{"namespaceSelector": {}, "podSelector": {
        "matchExpressions": [{"key": AGENT_LABEL, "operator": "Exists"}]}}]
    assert AGENT_LABEL in objs["WasmPlugin"]["spec"]["selector"]["matchLabels"]
    # Admins: labelled pods of the ledger's own namespace only (no namespaceSelector).
    assert admins["from"] == [{"podSelector": {"matchLabels": {"atmost.dev/role": "ledger-admin"}}}]


def test_ledger_deployment_service_and_pdb():
    objs = objects()
    deployment = objs["Deployment"]["spec"]
    pod_labels = deployment["template"]["metadata"]["labels"]
    assert deployment["replicas"] >= 2

    pdb = objs["PodDisruptionBudget"]["spec"]
    assert pdb["selector"]["matchLabels"].items() <= pod_labels.items()
    assert 1 <= pdb["minAvailable"] < deployment["replicas"]

    service = objs["Service"]["spec"]
    assert service["clusterIP"] == "None", "headless Service"
    assert service["selector"].items() <= pod_labels.items()
    assert [p["port"] for p in service["ports"]] == [8081]

    entry = objs["ServiceEntry"]["spec"]
    assert entry["workloadSelector"]["labels"].items() <= pod_labels.items()
    assert entry["resolution"] == "STATIC" and entry["location"] == "MESH_INTERNAL"
    assert entry["ports"] == [{"number": 8081, "name": "http2-api", "protocol": "HTTP2", "targetPort": 8081}]
    # Not the headless Service's host: that one is an ORIGINAL_DST cluster in sidecars.
    service_host = f"{objs['Service']['metadata']['name']}.{objs['Service']['metadata']['namespace']}.svc.cluster.local"
    assert entry["hosts"] != [service_host]

    container = deployment["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_ledger_credentials_and_store_come_from_a_secret():
    objs = objects()
    env = {e["name"]: e for e in objs["Deployment"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    for name in ("ATMOST_SERVICE_TOKEN", "ATMOST_ADMIN_TOKEN", "ATMOST_STORE"):
        assert "value" not in env[name], f"{name} must not be a literal"
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "atmost-ledger" and ref["key"]
        assert not ref.get("optional", False)
    for path in MANIFESTS:
        parsed = json.dumps(load(path))
        assert "postgres://" not in parsed, f"{path}: a store URL belongs in the Secret"


# ---------------------------------------------------------------- how the secrets reach the sidecar (docs/istio.md)

ISTIO_DOC = ROOT / "docs" / "istio.md"


def istio_doc_section(title: str) -> str:
    text = ISTIO_DOC.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def test_istio_doc_proxy_entry_feeds_the_variables_the_manifests_name():
    """docs/istio.md's `istio-proxy` container entry is a valid container (strict Kubernetes schema,
    inside a Deployment of the agent), sets exactly the variables the WasmPlugin and EnvoyFilter
    name, each from a key of the Secret the rollout steps create."""
    section = istio_doc_section("What an agent in the pod can read and do")
    [block] = [b for b in re.findall(r"```yaml\n(.*?)```", section, re.S) if "istio-proxy" in b]
    [container] = yaml.safe_load(block)
    assert container["name"] == "istio-proxy" and container["image"] == "auto"
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment",
                  "metadata": {"name": "billing-agent", "namespace": "agents"},
                  "spec": {"selector": {"matchLabels": {AGENT_LABEL: "billing-agent"}}, "template": {
                      "metadata": {"labels": {AGENT_LABEL: "billing-agent"}},
                      "spec": {"containers": [{"name": "agent", "image": "registry.example.com/agent:1"}, container]}}}}
    assert kubernetes_errors(deployment) == []
    assert [e["name"] for e in container["env"]] == SECRET_ENV
    objs = objects()
    assert host_env_keys_of(objs["WasmPlugin"]["spec"]) == SECRET_ENV
    ext, _ = envoyfilter_parts(objs)
    vm_config = ext["patch"]["value"]["typed_config"]["config"]["vm_config"]
    assert vm_config["environment_variables"]["host_env_keys"] == SECRET_ENV
    steps = istio_doc_section("Adding atmost to an existing Istio mesh")
    for env in container["env"]:
        ref = env["valueFrom"]["secretKeyRef"]
        assert "value" not in env and not ref.get("optional", False)
        assert f"create secret generic {ref['name']}" in steps
        assert f"--from-literal={ref['key']}=" in steps
