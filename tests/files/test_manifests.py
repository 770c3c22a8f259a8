"""The Kubernetes / Istio manifests under envoy/istio/, rendered by `kubectl kustomize` the way an
operator applies them, validate against their schemas and say what the rollout needs: a
fail-closed filter per agent pod, pinned by digest where the rollout steps put the image `make
oci` built; the ledger on the chosen store, its image pinned by digest; Secret-held credentials
(generated from a file that is not committed, or an existing Secret; the filter's own taken from
the sidecar's environment), a NetworkPolicy that admits only sidecars and admins, and no retries.

Every directory with a kustomization.yaml is rendered: the bases and every overlay. Rendering
happens on a copy of envoy/istio/ in which the overlays got what the operator supplies
(docs/istio.md): digests written into the overlays the way the rollout steps do it (here
stand-ins, tests/support/manifests.py STAND_IN) and a ledger.env for the generated Secret.

Istio kinds are checked against the openAPIV3Schema of the Istio CRDs in
tests/files/schemas/istio-crds.yaml (their source: the README beside it), in strict mode (an
unknown field is an error, as with `kubectl apply --validate=strict`). Core kinds are checked with
kubernetes-validate's strict schemas for K8S_VERSION.

Reads files only: no build, no process but kubectl, git and sed. What needs `make wasm` or `make
oci` (the overlays pin exactly the digests `make oci` built, the image's own configuration, the
Envoy config each EnvoyFilter inserts passing `envoy --mode validate` with the built filter) is
tests/e2e/test_manifests_built.py.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.support.manifests import (
    AGENT_ENVOYFILTER,
    AGENT_LABEL,
    AGENT_NAME,
    AGENT_NAMESPACE,
    AGENT_WASMPLUGIN,
    BASES,
    EQUIVALENT_ENVOY,
    EXTERNAL_PROVIDER,
    FORMATS,
    ISTIO_CRDS,
    ISTIO_DIR,
    ISTIO_DOC,
    KUBECTL,
    KUSTOMIZATIONS,
    LEDGER_POSTGRES,
    LEDGER_SQLITE,
    OVERLAYS,
    PROVIDER_HOST,
    SECRET_ENV,
    SHIPPED_ENVOY_CONFIGS,
    STAND_IN,
    TOOL_NAME,
    VERIFIER_ENVOYFILTER,
    VERIFIER_WASMPLUGIN,
    agent_network_policy,
    assert_no_committed_secret,
    by_kind,
    crd_schemas,
    envoyfilter_parts,
    filter_image,
    filter_object,
    host_env_keys_of,
    istio_copy,
    istio_doc_section,
    kustomize,
    kubernetes_errors,
    ledger_container,
    mesh_objects,
    new_ledger_env,
    of_kind,
    render_istio,
    run_digest_steps,
    set_digests,
    write_digest_files,
)

# The ledger's Secret: its keys, and the environment variable each one feeds.
LEDGER_SECRET_KEYS = {"service-token": "ATMOST_SERVICE_TOKEN", "admin-token": "ATMOST_ADMIN_TOKEN",
                      "store-url": "ATMOST_STORE"}

PLUGIN_KEYS = {"ledger", "permit_header", "governed_tools", "key_required_tools", "upstream_key", "denial_format",
               "max_body_bytes", "max_receipt_bytes", "report_interval_ms"}
LEDGER_KEYS = {"cluster", "authority", "timeout_ms", "service_token_env"}


# ---------------------------------------------------------------- rendering


@pytest.fixture(scope="session")
def ledger_env() -> dict[str, str]:
    """The values of the ledger.env the operator writes for ../overlays/ledger-postgres/."""
    return new_ledger_env()


@pytest.fixture(scope="session")
def rendered(tmp_path_factory, ledger_env) -> dict[str, list[dict]]:
    """kustomization (relative path) -> its rendered objects, with the operator's inputs in place
    (the stand-in digests)."""
    return render_istio(tmp_path_factory.mktemp("kustomize"), STAND_IN, ledger_env)


@pytest.fixture(scope="session")
def objs(rendered) -> dict[str, dict]:
    """kind -> object, for one mesh: the ledger on PostgreSQL, the agent namespace's
    VirtualService, and one agent's EnvoyFilter and WasmPlugin."""
    return mesh_objects(rendered)


# ---------------------------------------------------------------- Istio CRD schema validation


@lru_cache(maxsize=1)
def istio_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> JSON Schema, for every served version of every Istio CRD."""
    return {key: schema for key, (schema, _) in crd_schemas(ISTIO_CRDS).items()}


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


def errors_of(doc: dict) -> list[str]:
    return istio_errors(doc) if is_istio(doc) else kubernetes_errors(doc)


# ---------------------------------------------------------------- every kustomization renders and validates


def test_kustomizations_present():
    assert set(BASES) == {"ledger", "ledger-serviceentry", "agent", "agent-envoyfilter", "agent-wasmplugin", "agent-egress",
                          "agent-network", "verifier-envoyfilter", "verifier-wasmplugin", "verifier-port"}
    assert set(OVERLAYS) == {LEDGER_POSTGRES, LEDGER_SQLITE, AGENT_ENVOYFILTER, AGENT_WASMPLUGIN, EXTERNAL_PROVIDER,
                             VERIFIER_ENVOYFILTER, VERIFIER_WASMPLUGIN}


def test_overlays_render_what_a_rollout_needs(rendered):
    kinds = {k: sorted(d["kind"] for d in docs) for k, docs in rendered.items()}
    ledger = ["Deployment", "Namespace", "NetworkPolicy", "PodDisruptionBudget", "Service", "ServiceAccount",
              "ServiceEntry"]
    assert kinds[LEDGER_POSTGRES] == sorted(ledger + ["Secret"])
    assert kinds[LEDGER_SQLITE] == sorted(ledger + ["PersistentVolumeClaim"])
    assert kinds[AGENT_NAMESPACE] == ["VirtualService"]
    assert kinds[AGENT_ENVOYFILTER] == ["EnvoyFilter", "NetworkPolicy"]
    assert kinds[AGENT_WASMPLUGIN] == ["NetworkPolicy", "WasmPlugin"]
    assert kinds["agent-egress"] == ["Sidecar"]
    assert kinds["agent-network"] == ["NetworkPolicy"]
    assert kinds[VERIFIER_ENVOYFILTER] == ["EnvoyFilter", "Sidecar"]
    assert kinds[VERIFIER_WASMPLUGIN] == ["Sidecar", "WasmPlugin"]


def rendered_objects() -> list[tuple[str, int]]:
    """(kustomization, index of an object in its rendering), for parametrizing, by
    expected_count; a rendering with more or fewer objects fails test_objects_counted."""
    return [(k, i) for k in KUSTOMIZATIONS for i in range(expected_count(k))]


def expected_count(kustomization: str) -> int:
    counts = {"ledger": 6, "ledger-serviceentry": 1, "agent": 1, "agent-envoyfilter": 1, "agent-wasmplugin": 1, LEDGER_POSTGRES: 8,
              LEDGER_SQLITE: 8, AGENT_ENVOYFILTER: 2, AGENT_WASMPLUGIN: 2, "agent-egress": 1, EXTERNAL_PROVIDER: 7,
              "agent-network": 1, "verifier-envoyfilter": 1, "verifier-wasmplugin": 1, "verifier-port": 1,
              VERIFIER_ENVOYFILTER: 2, VERIFIER_WASMPLUGIN: 2}
    return counts[kustomization]


def test_objects_counted(rendered):
    assert {k: len(docs) for k, docs in rendered.items()} == {k: expected_count(k) for k in KUSTOMIZATIONS}


@pytest.mark.parametrize("kustomization,index", rendered_objects(), ids=lambda v: str(v))
def test_rendered_object_validates(rendered, kustomization, index):
    doc = rendered[kustomization][index]
    assert errors_of(doc) == [], f"{kustomization}: {doc['kind']} {doc['metadata'].get('name')}"


def test_no_envsubst_placeholders_left():
    """The manifests are plain Kustomize now: nothing is filled in by envsubst."""
    for path in ISTIO_DIR.rglob("*.yaml"):
        assert not re.search(r"\$\{[A-Za-z0-9_]+\}", path.read_text()), path


# ---------------------------------------------------------------- the validators can fail


def test_istio_validator_rejects_broken_copies(objs):
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


def test_kubernetes_validator_rejects_broken_copies(objs, rendered):
    deployment = copy.deepcopy(objs["Deployment"])
    deployment["spec"]["replica"] = deployment["spec"].pop("replicas")
    assert any("replica" in e for e in kubernetes_errors(deployment))

    policy = copy.deepcopy(objs["NetworkPolicy"])
    policy["spec"]["ingress"][0]["form"] = policy["spec"]["ingress"][0].pop("from")
    assert kubernetes_errors(policy)

    pdb = copy.deepcopy(objs["PodDisruptionBudget"])
    pdb["spec"]["minAvailable"] = [1]
    assert kubernetes_errors(pdb)

    secret = copy.deepcopy(objs["Secret"])
    secret["dat"] = secret.pop("data")
    assert any("dat" in e for e in kubernetes_errors(secret))

    claim = copy.deepcopy(by_kind(rendered[LEDGER_SQLITE])["PersistentVolumeClaim"])
    claim["spec"]["accessMode"] = claim["spec"].pop("accessModes")
    assert kubernetes_errors(claim)


def test_kustomize_refuses_a_patch_whose_base_moved(tmp_path):
    """The SQLite overlay replaces env and volume entries by position; its `test` operations make
    the render fail when the base's order changes, rather than overwrite another entry (here:
    one more variable before ATMOST_STORE would put ATMOST_ADMIN_TOKEN where it was)."""
    tree = tmp_path / "istio"
    shutil.copytree(ISTIO_DIR, tree, ignore=shutil.ignore_patterns("ledger.env"))
    deployment = tree / "ledger" / "deployment.yaml"
    text = deployment.read_text()
    anchor = "        - name: RUST_LOG\n          value: info\n"
    assert text.count(anchor) == 1
    deployment.write_text(text.replace(anchor, anchor + "        - name: ATMOST_PG_POOL_SIZE\n          value: \"8\"\n"))
    assert kustomize(tree / "ledger")  # the base itself still renders
    result = subprocess.run([KUBECTL, "kustomize", str(tree / LEDGER_SQLITE)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0 and "/spec/template/spec/containers/0/env/5/name" in result.stderr, result.stderr


# ---------------------------------------------------------------- images by digest


@pytest.mark.parametrize("kustomization", [LEDGER_POSTGRES, LEDGER_SQLITE])
def test_ledger_overlays_pin_the_image_by_digest(rendered, kustomization):
    """The digest the rollout steps wrote (here the stand-in; that it is the one `make oci` built:
    tests/e2e/test_manifests_built.py)."""
    image = ledger_container(rendered[kustomization])["image"]
    name, _, digest = image.partition("@")
    assert digest == STAND_IN["ledger"], f"{image} is not the image the overlay was given"
    assert name == "registry.example.com/atmost/atmost-ledger" and ":" not in name, "by digest, no tag"


def test_the_ledger_base_leaves_the_image_to_an_overlay(rendered):
    assert ledger_container(rendered["ledger"])["image"] == "atmost-ledger"


@pytest.mark.parametrize("kustomization", [AGENT_ENVOYFILTER, AGENT_WASMPLUGIN, VERIFIER_ENVOYFILTER, VERIFIER_WASMPLUGIN])
def test_agent_overlays_pin_the_filter_by_digest(rendered, kustomization):
    """The digest the rollout steps wrote (here the stand-in; that it is the one `make oci` built:
    tests/e2e/test_manifests_built.py)."""
    url, sha256 = filter_image(by_kind(rendered[kustomization]))
    hex_digest = STAND_IN["filter"].split(":")[1]
    assert url == f"oci://registry.example.com/atmost/atmost-filter@sha256:{hex_digest}"
    assert sha256 == hex_digest


@pytest.mark.parametrize("base", ["agent-envoyfilter", "agent-wasmplugin"])
def test_agent_bases_carry_a_placeholder_no_pod_matches(rendered, base):
    kinds = by_kind(rendered[base])
    url, sha256 = filter_image(kinds)
    assert sha256 == "0" * 64 and url.endswith("@sha256:" + "0" * 64)
    assert selector_of(next(iter(kinds.values()))) == {AGENT_LABEL: "per-agent-overlay"}


@pytest.mark.parametrize("base", ["verifier-envoyfilter", "verifier-wasmplugin"])
def test_verifier_bases_carry_a_placeholder_no_pod_matches(rendered, base):
    kinds = by_kind(rendered[base])
    url, sha256 = filter_image(kinds)
    assert sha256 == "0" * 64 and url.endswith("@sha256:" + "0" * 64)
    assert selector_of(next(iter(kinds.values()))) == {"app": "per-tool-overlay"}
    [port] = rendered["verifier-port"]
    assert port["spec"]["workloadSelector"]["labels"] == {"app": "per-tool-overlay"}


# ---------------------------------------------------------------- the per-agent selector


def selector_of(doc: dict) -> dict:
    if doc["kind"] == "WasmPlugin":
        return doc["spec"]["selector"]["matchLabels"]
    return doc["spec"]["workloadSelector"]["labels"]


@pytest.mark.parametrize("kustomization", [AGENT_ENVOYFILTER, AGENT_WASMPLUGIN])
def test_agent_overlay_selects_one_agents_pods(rendered, kustomization):
    doc = filter_object(rendered[kustomization])
    assert selector_of(doc) == {AGENT_LABEL: AGENT_NAME}
    # The agent's NetworkPolicy selects the same pods, under a name that carries the agent.
    policy = agent_network_policy(rendered[kustomization])
    assert policy["spec"]["podSelector"] == {"matchLabels": {AGENT_LABEL: AGENT_NAME}}
    assert policy["metadata"]["name"] == f"atmost-agent-network-{AGENT_NAME}"
    assert policy["metadata"]["namespace"] == doc["metadata"]["namespace"]
    # One object per agent: the name carries the agent, so overlays for two agents coexist.
    assert doc["metadata"]["name"] == f"atmost-{AGENT_NAME}"
    assert doc["metadata"]["namespace"] == "agents"


# ---------------------------------------------------------------- the ledger's store


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container["env"]}


def test_postgres_overlay_runs_replicas_on_one_store_from_a_generated_secret(rendered, ledger_env):
    kinds = by_kind(rendered[LEDGER_POSTGRES])
    deployment = kinds["Deployment"]["spec"]
    assert deployment["replicas"] >= 2
    assert 1 <= kinds["PodDisruptionBudget"]["spec"]["minAvailable"] < deployment["replicas"]
    secret = kinds["Secret"]
    assert secret["metadata"]["namespace"] == kinds["Deployment"]["metadata"]["namespace"]
    # Generated from ledger.env, under a name that changes with its contents.
    assert re.fullmatch(r"atmost-ledger-[a-z0-9]{10}", secret["metadata"]["name"])
    assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == ledger_env
    env = env_of(ledger_container(rendered[LEDGER_POSTGRES]))
    for key, name in LEDGER_SECRET_KEYS.items():
        assert env[name]["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": key}


def test_sqlite_overlay_runs_one_replica_on_a_volume_with_an_existing_secret(rendered):
    kinds = by_kind(rendered[LEDGER_SQLITE])
    deployment = kinds["Deployment"]["spec"]
    assert deployment["replicas"] == 1
    assert deployment["strategy"] == {"type": "Recreate"}, "never two pods on one SQLite file"
    assert "minAvailable" not in kinds["PodDisruptionBudget"]["spec"], "a single replica must not block drains"
    container = ledger_container(rendered[LEDGER_SQLITE])
    env = env_of(container)
    assert env["ATMOST_STORE"] == {"name": "ATMOST_STORE", "value": "sqlite"}
    assert env["ATMOST_DRAIN_DELAY"]["value"] == "0s", "no other replica to drain to"
    claim = kinds["PersistentVolumeClaim"]
    volumes = {v["name"]: v for v in deployment["template"]["spec"]["volumes"]}
    [mount] = container["volumeMounts"]
    assert volumes[mount["name"]]["persistentVolumeClaim"] == {"claimName": claim["metadata"]["name"]}
    assert mount["mountPath"] == env["ATMOST_DATA_DIR"]["value"]
    assert claim["metadata"]["namespace"] == kinds["Deployment"]["metadata"]["namespace"]
    # No Secret in the rendering: the tokens come from the one the operator created.
    for name in ("ATMOST_SERVICE_TOKEN", "ATMOST_ADMIN_TOKEN"):
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "atmost-ledger"


# ---------------------------------------------------------------- secrets are never literals


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_credentials_come_from_a_secret(rendered, kustomization):
    for doc in rendered[kustomization]:
        if doc["kind"] != "Deployment":
            continue
        env = env_of(doc["spec"]["template"]["spec"]["containers"][0])
        for name in ("ATMOST_SERVICE_TOKEN", "ATMOST_ADMIN_TOKEN"):
            assert "value" not in env[name], f"{name} must not be a literal"
            ref = env[name]["valueFrom"]["secretKeyRef"]
            assert ref["name"].startswith("atmost-ledger") and ref["key"] and not ref.get("optional", False)


def test_no_committed_file_holds_a_secret():
    """No store URL and no generator literal in any file under envoy/istio/ (ledger.env, where
    the operator puts them, is ignored by git)."""
    assert_no_committed_secret("envoy/istio", f"envoy/istio/{LEDGER_POSTGRES}/ledger.env")


def plugin_configs(doc: dict) -> list[dict]:
    """The filter's plugin configuration(s) an Istio object carries."""
    if doc["kind"] == "WasmPlugin":
        return [doc["spec"]["pluginConfig"]]
    if doc["kind"] == "EnvoyFilter":
        return [json.loads(p["patch"]["value"]["typed_config"]["config"]["configuration"]["value"])
                for p in doc["spec"]["configPatches"] if p["applyTo"] == "EXTENSION_CONFIG"]
    return []


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_no_agent_object_carries_a_filter_secret(rendered, kustomization):
    """Not in place either: the filter's secrets are not rendered into Istio objects (whoever may
    `get` those, or read /config_dump, would read them)."""
    for doc in rendered[kustomization]:
        for plugin in plugin_configs(doc):
            assert "service_token" not in plugin.get("ledger", {}), f"{kustomization}: in-place service_token"
            assert "secret" not in plugin.get("upstream_key", {}), f"{kustomization}: in-place upstream_key.secret"


def test_secret_checks_see_the_plugin_configs(objs):
    """The check above would find an in-place secret in both the WasmPlugin and the EnvoyFilter."""
    assert len(plugin_configs(objs["WasmPlugin"])) == 1 and len(plugin_configs(objs["EnvoyFilter"])) == 1
    for kind in ("WasmPlugin", "EnvoyFilter"):
        assert all("service_token_env" in p["ledger"] for p in plugin_configs(objs[kind]))


# ---------------------------------------------------------------- what the rollout needs


def ledger_cluster(objs) -> tuple[str, int]:
    entry = objs["ServiceEntry"]["spec"]
    return entry["hosts"][0], entry["ports"][0]["number"]


def test_wasmplugin_is_per_agent_fail_closed_and_complete(objs):
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
    assert set(config) == PLUGIN_KEYS | {"request_hold"}
    # A WasmPlugin cannot set allow_on_headers_stop_iteration: the filter holds only the body.
    assert config["request_hold"] == "body"
    assert set(config["ledger"]) == LEDGER_KEYS
    assert set(config["upstream_key"]) == {"mode", "secret_env"}
    host, port = ledger_cluster(objs)
    assert config["ledger"]["cluster"] == f"outbound|{port}||{host}"
    assert config["ledger"]["authority"] == host
    # Secrets come from the sidecar's environment: pluginConfig names the variables, and
    # vmConfig.env lists them with valueFrom HOST (istiod turns that into host_env_keys).
    assert [config["ledger"]["service_token_env"], config["upstream_key"]["secret_env"]] == SECRET_ENV
    assert spec["vmConfig"] == {"env": [{"name": name, "valueFrom": "HOST"} for name in SECRET_ENV]}


def test_envoyfilter_delivers_the_same_filter_with_stop_iteration(objs):
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
    # The same plugin configuration, except that the EnvoyFilter holds the whole request
    # (request_hold's default, `headers`), which allow_on_headers_stop_iteration permits.
    plugin = json.loads(config["configuration"]["value"])
    assert "request_hold" not in plugin
    assert plugin == {k: v for k, v in wasm_plugin["pluginConfig"].items() if k != "request_hold"}
    # The same variables, as istiod would list them for the WasmPlugin.
    assert config["vm_config"]["environment_variables"] == {"host_env_keys": host_env_keys_of(wasm_plugin)}

    assert http["match"]["context"] == "SIDECAR_OUTBOUND"
    assert http["match"]["listener"]["portNumber"] in {p["number"] for m in wasm_plugin["match"] for p in m["ports"]}
    assert http["patch"]["operation"] == "INSERT_BEFORE"
    assert http["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == "envoy.filters.http.router"
    # The HTTP filter's config_discovery fetches the ECDS resource of the same name.
    assert http["patch"]["value"]["name"] == ext["patch"]["value"]["name"]
    assert http["patch"]["value"]["config_discovery"]["type_urls"] == [wasm["@type"]]


def test_envoyfilter_merges_underscore_refusal_into_the_filters_listener(objs):
    """The NETWORK_FILTER patch targets the connection manager of the listener the filter is
    inserted into, and sets what equivalent-envoy.yaml's connection manager says."""
    _, http = envoyfilter_parts(objs)
    merge = next(p for p in objs["EnvoyFilter"]["spec"]["configPatches"] if p["applyTo"] == "NETWORK_FILTER")
    assert merge["patch"]["operation"] == "MERGE"
    http_listener = copy.deepcopy(http["match"]["listener"])
    del http_listener["filterChain"]["filter"]["subFilter"]
    assert merge["match"] == {"context": http["match"]["context"], "listener": http_listener}
    value = merge["patch"]["value"]["typed_config"]
    assert value["common_http_protocol_options"] == {"headers_with_underscores_action": "REJECT_REQUEST"}
    config = yaml.safe_load(EQUIVALENT_ENVOY.read_text())
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert value["@type"] == hcm["@type"]
    assert hcm["common_http_protocol_options"] == value["common_http_protocol_options"]


def test_equivalent_envoy_config_mirrors_the_manifests(objs):
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
    expected = {k: v for k, v in objs["WasmPlugin"]["spec"]["pluginConfig"].items() if k != "request_hold"}
    assert plugin == expected
    clusters = {c["name"] for c in config["static_resources"]["clusters"]}
    assert expected["ledger"]["cluster"] in clusters
    assert "retry_policy" not in EQUIVALENT_ENVOY.read_text()


def test_envoy_config_suite_picks_up_only_the_equivalent_config():
    assert EQUIVALENT_ENVOY in SHIPPED_ENVOY_CONFIGS
    assert [p for p in SHIPPED_ENVOY_CONFIGS if p.is_relative_to(ISTIO_DIR)] == [EQUIVALENT_ENVOY]


def test_mcp_routes_have_no_retries(objs):
    vs = objs["VirtualService"]["spec"]
    ports = {p["number"] for m in objs["WasmPlugin"]["spec"]["match"] for p in m["ports"]}
    assert vs["http"], "routes expected"
    for route in vs["http"]:
        assert route["retries"]["attempts"] == 0, route
        for destination in route["route"]:
            assert destination["destination"]["host"] in vs["hosts"]
            assert destination["destination"]["port"]["number"] in ports
    # The agents' namespace: where the per-agent overlays put the filter.
    assert objs["VirtualService"]["metadata"]["namespace"] == objs["EnvoyFilter"]["metadata"]["namespace"]


def test_networkpolicy_admits_only_sidecars_and_admins(objs):
    policy = objs["NetworkPolicy"]["spec"]
    pod_labels = objs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert policy["policyTypes"] == ["Ingress"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert len(policy["ingress"]) == 2

    sidecars, admins = policy["ingress"]
    for rule in (sidecars, admins):
        assert rule.get("from"), "an ingress rule without `from` admits everyone"
        assert all("ipBlock" not in peer for peer in rule["from"])
    # Sidecars reach the filter's API only; the admin API and the inbox listen on a port of
    # their own, which only admins reach.
    env = {e["name"]: e.get("value") for e in objs["Deployment"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["ATMOST_LISTEN"] == "0.0.0.0:8081" and env["ATMOST_ADMIN_LISTEN"] == "0.0.0.0:8082"
    assert sidecars["ports"] == [{"protocol": "TCP", "port": 8081}]
    assert admins["ports"] == [{"protocol": "TCP", "port": 8082}]

    # Sidecars: pods that carry the label the filter's selector uses, in any namespace.
    assert sidecars["from"] == [{"namespaceSelector": {}, "podSelector": {
        "matchExpressions": [{"key": AGENT_LABEL, "operator": "Exists"}]}}]
    assert AGENT_LABEL in objs["WasmPlugin"]["spec"]["selector"]["matchLabels"]
    # Admins: labelled pods of the ledger's own namespace only (no namespaceSelector).
    assert admins["from"] == [{"podSelector": {"matchLabels": {"atmost.dev/role": "ledger-admin"}}}]


def test_ledger_deployment_service_and_pdb(objs):
    deployment = objs["Deployment"]["spec"]
    pod_labels = deployment["template"]["metadata"]["labels"]

    pdb = objs["PodDisruptionBudget"]["spec"]
    assert pdb["selector"]["matchLabels"].items() <= pod_labels.items()

    service = objs["Service"]["spec"]
    assert service["clusterIP"] == "None", "headless Service"
    assert service["selector"].items() <= pod_labels.items()
    assert [(p["name"], p["port"]) for p in service["ports"]] == [("http2-api", 8081), ("http-admin", 8082)]

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


def test_ledger_may_migrate_before_liveness_counts(objs):
    """A ledger listens only once its migrations are applied (docs/postgresql.md, "Upgrades"):
    the startup probe gives it ten minutes, and the liveness probe, which counts only after
    the startup probe passed, has no delay of its own that would stand in for it."""
    [container] = objs["Deployment"]["spec"]["template"]["spec"]["containers"]
    startup = container["startupProbe"]
    assert startup["httpGet"] == {"path": "/healthz", "port": "http2-api"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, startup
    assert "initialDelaySeconds" not in container["livenessProbe"], container["livenessProbe"]


def test_ledger_drains_before_the_pod_is_killed(objs):
    """A planned stop denies nothing (docs/postgresql.md, "Upgrades"): the readiness probe sees
    the drain well inside the drain delay, and the grace period covers the delay plus the
    longest store operation in flight (connect timeout + twice the statement timeout)."""
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    drain = env["ATMOST_DRAIN_DELAY"]
    assert re.fullmatch(r"\d+s", drain), drain
    drain_seconds = int(drain[:-1])
    probe = container["readinessProbe"]
    noticed_within = probe["periodSeconds"] * probe["failureThreshold"] + probe["timeoutSeconds"]
    assert noticed_within < drain_seconds, (probe, drain)
    longest_store_operation = 5 + 2 * 5  # --pg-connect-timeout, --pg-statement-timeout defaults
    assert pod["terminationGracePeriodSeconds"] > drain_seconds + longest_store_operation
    # The ledger's sidecar passes requests until the ledger is done, and is killed with it.
    proxy = json.loads(objs["Deployment"]["spec"]["template"]["metadata"]["annotations"]["proxy.istio.io/config"])
    sidecar_drain = int(proxy["terminationDrainDuration"].removesuffix("s"))
    assert drain_seconds + longest_store_operation < sidecar_drain < pod["terminationGracePeriodSeconds"]


# ---------------------------------------------------------------- docs/istio.md


def test_rollout_steps_render_and_apply_the_kustomizations():
    """The rollout applies with `kubectl apply -k` and looks with `kubectl kustomize`, naming
    kustomizations that exist; nothing is piped through envsubst any more."""
    steps = istio_doc_section("Adding atmost to an existing Istio mesh")
    applied = re.findall(r"kubectl apply -k (envoy/istio/\S+)", steps)
    looked = re.findall(r"kubectl kustomize (envoy/istio/\S+)", steps)
    assert applied and looked
    for path in applied + looked:
        assert path.removeprefix("envoy/istio/").rstrip("/") in KUSTOMIZATIONS, path
    assert {AGENT_NAMESPACE, AGENT_ENVOYFILTER} <= {p.removeprefix("envoy/istio/").rstrip("/") for p in applied}
    assert any(p.removeprefix("envoy/istio/").rstrip("/") in (LEDGER_POSTGRES, LEDGER_SQLITE) for p in applied)
    assert "envsubst" not in ISTIO_DOC.read_text()
    assert "kubectl apply -f envoy/istio" not in ISTIO_DOC.read_text()


def test_rollout_steps_write_the_digests_where_the_test_puts_them(tmp_path):
    """Step 0's commands put the digests `make oci` printed into the overlays, as set_digests does
    here: run them on a copy, with digest files of the stand-ins where `make oci` writes its own,
    and compare (with the files `make oci` wrote: tests/e2e/test_manifests_built.py)."""
    steps = istio_doc_section("Adding atmost to an existing Istio mesh")
    digest_files = write_digest_files(tmp_path / "digests", STAND_IN)
    changed = run_digest_steps(steps, ISTIO_DIR, tmp_path / "run", set_digests, digest_files)
    # Both store overlays, both agent overlays and both verifier overlays got the digests.
    assert changed == 6


def test_istio_doc_proxy_entry_feeds_the_variables_the_manifests_name(objs):
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



# ---------------------------------------------------------------- tools outside the mesh
#
# overlays/external-provider/ is the agents namespace with a governed MCP server outside the mesh:
# every route from an agent pod to a governed tool must go through the filter in plain HTTP, and
# every other route must be closed. The checks below are functions that list what is wrong, so
# the same code judges the rendering (no error) and broken copies of it (each error found).

GOVERNED_LABEL = "atmost.dev/governed-mcp"
# What a governed host's port may be: HTTP the sidecar reads, so the filter sees every body.
READABLE_PROTOCOLS = {"HTTP", "HTTP2"}
KUBE_DNS = "kube-system/kube-dns.kube-system.svc.cluster.local"


def covers(pattern: str, host: str) -> bool:
    """Whether an Istio host (`*`, `*.suffix` or a name) names `host`, or the other way round: a
    wildcard entry that covers a governed host lets it through as much as an exact one."""
    def one_way(p: str, h: str) -> bool:
        return p == "*" or p == h or (p.startswith("*.") and h.endswith(p[1:]))
    return one_way(pattern, host) or one_way(host, pattern)


def in_mesh_mcp_hosts(rendered) -> set[str]:
    """The MCP server inside the mesh: the host the agent namespace's no-retry routes serve."""
    return {h for vs in of_kind(rendered[AGENT_NAMESPACE], "VirtualService") for h in vs["spec"]["hosts"]}


def governed_hosts(docs: list[dict], in_mesh: set[str]) -> set[str]:
    """Every host that carries governed MCP: the in-mesh server and each ServiceEntry marked governed."""
    marked = {h for se in of_kind(docs, "ServiceEntry") if se["metadata"].get("labels", {}).get(GOVERNED_LABEL) == "true"
              for h in se["spec"]["hosts"]}
    return in_mesh | marked


def filter_ports(docs: list[dict]) -> set[int]:
    """The outbound ports the agent's filter is attached to (EnvoyFilter HTTP_FILTER patches, or
    the WasmPlugin's CLIENT ports)."""
    ports = {p["match"]["listener"]["portNumber"] for ef in of_kind(docs, "EnvoyFilter")
             for p in ef["spec"]["configPatches"] if p["applyTo"] == "HTTP_FILTER"}
    ports |= {p["number"] for wp in of_kind(docs, "WasmPlugin") for m in wp["spec"]["match"] if m["mode"] == "CLIENT"
              for p in m["ports"]}
    return ports


def passthrough_errors(docs: list[dict], governed: set[str]) -> list[str]:
    """A governed host must never be declared so that the sidecar forwards it unread: no
    ServiceEntry port other than plain HTTP for it (port 443 TLS or HTTPS would carry the agent's
    own https:// straight through), no TLS or TCP route of a VirtualService for it."""
    errors = []
    for doc in docs:
        name = f"{doc['kind']} {doc['metadata'].get('namespace', '')}/{doc['metadata']['name']}"
        hosts = doc.get("spec", {}).get("hosts", [])
        hit = sorted(h for h in governed if any(covers(p, h) for p in hosts))
        if not hit:
            continue
        if doc["kind"] == "ServiceEntry":
            for port in doc["spec"].get("ports", []):
                if port.get("protocol") not in READABLE_PROTOCOLS:
                    errors.append(f"{name}: port {port['number']} {port.get('protocol')} passes {hit} through unread")
        if doc["kind"] == "VirtualService" and (doc["spec"].get("tls") or doc["spec"].get("tcp")):
            errors.append(f"{name}: TLS or TCP routes for {hit}")
    return errors


def no_retry_errors(vs: dict) -> list[str]:
    name = f"VirtualService {vs['metadata']['namespace']}/{vs['metadata']['name']}"
    spec = vs["spec"]
    errors = [f"{name}: TLS or TCP routes"] if spec.get("tls") or spec.get("tcp") else []
    if not spec.get("http"):
        errors.append(f"{name}: no HTTP routes")
    for route in spec.get("http", []):
        if route.get("retries", {}).get("attempts") != 0:
            errors.append(f"{name}: route {route.get('name')} may retry (a second dispatch)")
        if "timeout" not in route:
            errors.append(f"{name}: route {route.get('name')} has no timeout")
        for destination in route["route"]:
            if destination["destination"]["host"] not in spec["hosts"]:
                errors.append(f"{name}: route {route.get('name')} leaves for another host")
    if spec.get("exportTo") != ["."]:
        errors.append(f"{name}: exported beyond its namespace")
    return errors


def egress_errors(docs: list[dict], governed: set[str], ledger_entry: str) -> list[str]:
    """The namespace's Sidecar is REGISTRY_ONLY and lists no pattern; it lets out the ledger
    and DNS; and every governed host it lets out is declared plain HTTP on a port the filter
    covers, with a no-retry VirtualService the Sidecar imports. No port of a governed host is
    let out without the filter on it: an egress listener bound to a port lets its hosts out on
    that port only, which must be filtered and declared HTTP there; the listener without a port
    lets its hosts out on every port of their Service, so a governed host may be there only when
    a ServiceEntry of the rendering says its ports (each of which must be filtered), never an
    in-mesh Service whose ports the rendering cannot see."""
    sidecars = of_kind(docs, "Sidecar")
    if len(sidecars) != 1:
        return [f"{len(sidecars)} Sidecars"]
    [sidecar] = sidecars
    spec, namespace = sidecar["spec"], sidecar["metadata"]["namespace"]
    errors = []
    if spec.get("outboundTrafficPolicy", {}).get("mode") != "REGISTRY_ONLY":
        errors.append("outboundTrafficPolicy is not REGISTRY_ONLY: unknown destinations pass through")
    if "workloadSelector" in spec:
        errors.append("a workloadSelector: the namespace's other pods keep Istio's defaults")
    listeners = spec.get("egress", [])
    # Istio's own validation of a Sidecar (pkg/config/validation/validation.go): one egress
    # listener without a port at most, and it comes last; one listener per port.
    catch_alls = [i for i, listener in enumerate(listeners) if "port" not in listener]
    if len(catch_alls) > 1 or (catch_alls and catch_alls[0] != len(listeners) - 1):
        errors.append("the egress listener without a port must be the only one and the last")
    bound = [listener["port"]["number"] for listener in listeners if "port" in listener]
    if len(bound) != len(set(bound)):
        errors.append("two egress listeners on one port")
    entries = [e for listener in listeners for e in listener["hosts"]]
    for entry in entries:
        entry_namespace, _, host = entry.partition("/")
        if "*" in entry_namespace or "*" in host or entry_namespace == "~":
            errors.append(f"egress host {entry}: a pattern lets out more than the team listed")
    for needed in (ledger_entry, KUBE_DNS):
        if needed not in entries:
            errors.append(f"egress hosts lack {needed}")
    ports = filter_ports(docs)

    def imported(listener: dict, entry_namespace: str, host: str) -> bool:
        return (f"{entry_namespace}/{host}" in listener["hosts"]
                or (entry_namespace == namespace and f"./{host}" in listener["hosts"]))

    for host in sorted(governed):
        letting_out = [listener for listener in listeners if any(e.partition("/")[2] == host for e in listener["hosts"])]
        if not letting_out:
            continue
        service_entries = [se for se in of_kind(docs, "ServiceEntry") if host in se["spec"]["hosts"]]
        for listener in letting_out:
            if "port" in listener:
                number = listener["port"]["number"]
                if number not in ports:
                    errors.append(f"{host}: let out on port {number}, which has no filter (filter ports {sorted(ports)})")
                if listener["port"].get("protocol") not in READABLE_PROTOCOLS:
                    errors.append(f"{host}: port {number} is not declared HTTP in the Sidecar")
            elif not service_entries:
                errors.append(f"{host}: let out on every port of its Service by the egress listener without a port, "
                              "and no ServiceEntry here says which ports those are: bind it to its governed port")
        for se in service_entries:
            if not all(imported(listener, se["metadata"]["namespace"], host) for listener in letting_out):
                errors.append(f"{host}: its ServiceEntry's namespace is not imported")
            for port in se["spec"]["ports"]:
                if port.get("protocol") not in READABLE_PROTOCOLS or not port["name"].startswith("http"):
                    errors.append(f"{host}: port {port['number']} is not declared HTTP")
                if port["number"] not in ports:
                    errors.append(f"{host}: port {port['number']} has no filter (filter ports {sorted(ports)})")
        routes = [vs for vs in of_kind(docs, "VirtualService") if host in vs["spec"]["hosts"]]
        if not routes:
            errors.append(f"{host}: no VirtualService, so Istio's default retries apply")
        for vs in routes:
            errors += no_retry_errors(vs)
            if not all(imported(listener, vs["metadata"]["namespace"], host) for listener in letting_out):
                errors.append(f"{host}: the Sidecar does not import VirtualService {vs['metadata']['name']} "
                              "(an entry for its namespace is needed in each egress listener that lets the host "
                              "out), so Istio's default retries apply")
            for route in vs["spec"]["http"]:
                for destination in route["route"]:
                    if destination["destination"]["port"]["number"] not in ports:
                        errors.append(f"{host}: routed to port {destination['destination']['port']['number']}, "
                                      "which has no filter")
    for se in of_kind(docs, "ServiceEntry"):
        if se["spec"].get("resolution") == "NONE":
            errors.append(f"ServiceEntry {se['metadata']['name']}: resolution NONE forwards to whatever address "
                          "the agent dialled")
    return errors


def tls_origination_errors(docs: list[dict], governed: set[str]) -> list[str]:
    """Each governed provider outside the mesh: its ServiceEntry resolves the name itself and
    sends port 80 to 443, and its DestinationRule originates TLS there that checks the CA, the
    name and sends SNI."""
    errors = []
    rules = {dr["spec"]["host"]: dr for dr in of_kind(docs, "DestinationRule")}
    for se in of_kind(docs, "ServiceEntry"):
        spec = se["spec"]
        if spec.get("location") != "MESH_EXTERNAL" or not set(spec["hosts"]) & governed:
            continue
        if spec.get("resolution") != "DNS":
            errors.append(f"{spec['hosts']}: resolution {spec.get('resolution')}, not DNS")
        for host in spec["hosts"]:
            rule = rules.get(host)
            if rule is None:
                errors.append(f"{host}: no DestinationRule, so the provider would get plain HTTP")
                continue
            levels = {p["port"]["number"]: p for p in rule["spec"].get("trafficPolicy", {}).get("portLevelSettings", [])}
            for port in spec["ports"]:
                if port.get("targetPort") != 443:
                    errors.append(f"{host}: port {port['number']} does not go to 443")
                tls = levels.get(port["number"], {}).get("tls", {})
                if tls.get("mode") != "SIMPLE" or tls.get("sni") != host or tls.get("subjectAltNames") != [host]:
                    errors.append(f"{host}: port {port['number']} does not originate TLS with SNI and the name checked")
                if not tls.get("caCertificates") or tls.get("insecureSkipVerify") or "credentialName" in tls:
                    errors.append(f"{host}: port {port['number']} does not verify against the CA file")
    return errors


def ledger_egress_entry(rendered) -> str:
    entry = by_kind(rendered[LEDGER_POSTGRES])["ServiceEntry"]
    return f"{entry['metadata']['namespace']}/{entry['spec']['hosts'][0]}"


def route_errors(rendered, docs: list[dict]) -> list[str]:
    governed = governed_hosts(docs, in_mesh_mcp_hosts(rendered))
    return (egress_errors(docs, governed, ledger_egress_entry(rendered)) + passthrough_errors(docs, governed)
            + tls_origination_errors(docs, governed))


def test_external_provider_overlay_renders_the_namespace_egress(rendered):
    docs = rendered[EXTERNAL_PROVIDER]
    assert sorted(d["kind"] for d in docs) == sorted(
        ["Sidecar", "ServiceEntry", "DestinationRule", "VirtualService", "VirtualService", "EnvoyFilter",
         "NetworkPolicy"])
    assert {d["metadata"]["namespace"] for d in docs} == {"agents"}
    assert governed_hosts(docs, in_mesh_mcp_hosts(rendered)) == {PROVIDER_HOST} | in_mesh_mcp_hosts(rendered)
    # The in-mesh server's routes and the agent's filter are the shipped ones, unchanged but for the ports.
    assert [vs for vs in of_kind(docs, "VirtualService") if vs["spec"]["hosts"] != [PROVIDER_HOST]] == \
        of_kind(rendered[AGENT_NAMESPACE], "VirtualService")
    [ef] = of_kind(docs, "EnvoyFilter")
    shipped = filter_object(rendered[AGENT_ENVOYFILTER])
    assert {**ef, "spec": {**ef["spec"], "configPatches": []}} == {**shipped, "spec": {**shipped["spec"], "configPatches": []}}
    assert filter_ports(docs) == {8000, 80}
    # The agent's NetworkPolicy, as its overlay renders it.
    assert agent_network_policy(docs) == agent_network_policy(rendered[AGENT_ENVOYFILTER])


def test_every_governed_route_goes_through_the_filter_and_every_other_is_closed(rendered):
    assert route_errors(rendered, rendered[EXTERNAL_PROVIDER]) == []


def test_no_rendered_object_lets_tls_through_for_a_governed_host(rendered):
    """Across every kustomization: no ServiceEntry declares a governed host with a port the
    sidecar would pass through unread, and no VirtualService has TLS or TCP routes for one."""
    everything = [d for docs in rendered.values() for d in docs]
    governed = governed_hosts(everything, in_mesh_mcp_hosts(rendered))
    assert PROVIDER_HOST in governed
    assert passthrough_errors(everything, governed) == []


def test_governed_ports_copy_every_patch_the_base_makes_for_the_in_mesh_port(rendered):
    """Each patch the agent's EnvoyFilter makes for port 8000 (the filter; the connection
    manager's settings) has a twin for port 80, the same but for the port, so the providers'
    listener gets what the in-mesh server's gets."""
    [ef] = of_kind(rendered[EXTERNAL_PROVIDER], "EnvoyFilter")
    patches = ef["spec"]["configPatches"]

    def on_port(patch: dict, port: int) -> dict:
        twin = copy.deepcopy(patch)
        twin["match"]["listener"]["portNumber"] = port
        return twin

    in_mesh = [p for p in patches if p.get("match", {}).get("listener", {}).get("portNumber") == 8000]
    assert {p["applyTo"] for p in in_mesh} >= {"HTTP_FILTER"}
    for patch in in_mesh:
        assert on_port(patch, 80) in patches, patch
    shipped = filter_object(rendered[AGENT_ENVOYFILTER])
    assert [p for p in patches if p.get("match", {}).get("listener", {}).get("portNumber") != 80] == \
        shipped["spec"]["configPatches"]


def catch_all(docs: list[dict]) -> dict:
    """The Sidecar's egress listener without a port."""
    [sidecar] = of_kind(docs, "Sidecar")
    [listener] = [listener for listener in sidecar["spec"]["egress"] if "port" not in listener]
    return listener


def in_mesh_listener(docs: list[dict]) -> dict:
    """The Sidecar's egress listener bound to the in-mesh server's port."""
    [sidecar] = of_kind(docs, "Sidecar")
    [listener] = [listener for listener in sidecar["spec"]["egress"] if "port" in listener]
    return listener


def test_the_in_mesh_server_is_let_out_on_its_governed_port_only(rendered):
    """Its Service is listed in an egress listener bound to the port the filter covers, declared
    HTTP there, with the no-retry VirtualService's namespace; the catch-all lists it nowhere."""
    docs = rendered[EXTERNAL_PROVIDER]
    listener = in_mesh_listener(docs)
    [in_mesh] = sorted(in_mesh_mcp_hosts(rendered))
    assert listener["port"] == {"number": 8000, "protocol": "HTTP", "name": "http-mcp"}
    assert sorted(listener["hosts"]) == sorted([f"tools/{in_mesh}", f"./{in_mesh}"])
    assert listener["port"]["number"] in filter_ports(docs)
    assert not any(e.endswith(f"/{in_mesh}") for e in catch_all(docs)["hosts"])


def test_the_route_checks_find_each_way_around_the_filter(rendered):
    """Broken copies of the rendering: each one is caught, so the checks above can fail."""
    docs = rendered[EXTERNAL_PROVIDER]

    def broken(change) -> list[str]:
        copied = copy.deepcopy(docs)
        change(copied)
        return route_errors(rendered, copied)

    def one(kind: str, copied: list[dict], host: str | None = PROVIDER_HOST) -> dict:
        return next(d for d in copied if d["kind"] == kind and (host is None or host in json.dumps(d["spec"])))

    passthrough = {"number": 443, "name": "tls", "protocol": "TLS"}
    assert any("443 TLS passes" in e for e in broken(lambda c: one("ServiceEntry", c)["spec"]["ports"].append(passthrough)))
    wildcard = {"apiVersion": "networking.istio.io/v1", "kind": "ServiceEntry",
                "metadata": {"name": "anything-at-provider", "namespace": "agents"},
                "spec": {"hosts": ["*.provider.example"], "location": "MESH_EXTERNAL", "resolution": "NONE",
                         "ports": [{"number": 443, "name": "https", "protocol": "HTTPS"}]}}
    wildcard_errors = broken(lambda c: c.append(wildcard))
    assert any("HTTPS passes" in e for e in wildcard_errors) and any("resolution NONE" in e for e in wildcard_errors)
    assert any("may retry" in e for e in broken(
        lambda c: one("VirtualService", c)["spec"]["http"][1].update(retries={"attempts": 2})))
    assert any("no VirtualService" in e for e in broken(lambda c: c.remove(one("VirtualService", c))))
    assert any("REGISTRY_ONLY" in e for e in broken(
        lambda c: one("Sidecar", c, None)["spec"].update(outboundTrafficPolicy={"mode": "ALLOW_ANY"})))
    assert any("a pattern" in e for e in broken(lambda c: catch_all(c)["hosts"].append("*/*")))
    assert any("lack atmost-system/" in e for e in broken(
        lambda c: catch_all(c)["hosts"].remove(ledger_egress_entry(rendered))))
    # Without the `./` entry for the in-mesh server, its no-retry VirtualService is not imported.
    in_mesh = sorted(in_mesh_mcp_hosts(rendered))[0]
    assert any("does not import" in e for e in broken(lambda c: in_mesh_listener(c)["hosts"].remove(f"./{in_mesh}")))
    # Every port of the in-mesh server's Service: its entries moved to the listener without a
    # port (as the Sidecar was before), its listener moved to a port without the filter, or not
    # declared HTTP there (sniffed).
    def every_port(c):
        listener = in_mesh_listener(c)
        catch_all(c)["hosts"].extend(listener["hosts"])
        one("Sidecar", c, None)["spec"]["egress"].remove(listener)
    assert any("every port of its Service" in e for e in broken(every_port))
    assert any("let out on port 9100, which has no filter" in e for e in broken(
        lambda c: in_mesh_listener(c)["port"].update(number=9100)))
    assert any("not declared HTTP in the Sidecar" in e for e in broken(
        lambda c: in_mesh_listener(c)["port"].update(protocol="TCP")))
    assert any("must be the only one and the last" in e for e in broken(
        lambda c: one("Sidecar", c, None)["spec"]["egress"].reverse()))
    # A provider port the filter does not cover.
    def moved_port(c):
        one("ServiceEntry", c)["spec"]["ports"][0]["number"] = 8443
    assert any("8443 has no filter" in e for e in broken(moved_port))
    assert any("name checked" in e for e in broken(
        lambda c: one("DestinationRule", c)["spec"]["trafficPolicy"]["portLevelSettings"][0]["tls"].pop("subjectAltNames")))
    assert any("CA file" in e for e in broken(
        lambda c: one("DestinationRule", c)["spec"]["trafficPolicy"]["portLevelSettings"][0]["tls"].update(
            insecureSkipVerify=True)))
    assert any("plain HTTP" in e for e in broken(lambda c: c.remove(one("DestinationRule", c))))



def test_the_overlays_wasmplugin_form_renders_as_its_kustomization_says(rendered, tmp_path):
    """The switch kustomization.yaml describes (the WasmPlugin agent overlay and
    governed-ports-wasmplugin.yaml): the plugin then matches both governed ports, and every
    route check holds."""
    tree = istio_copy(tmp_path, STAND_IN)
    kustomization = tree / EXTERNAL_PROVIDER / "kustomization.yaml"
    text = kustomization.read_text()
    envoyfilter_target = ("    group: networking.istio.io\n    version: v1alpha3\n    kind: EnvoyFilter\n"
                          "    name: atmost\n    namespace: agents\n  path: governed-ports.yaml\n")
    assert text.count("- ../billing-agent\n") == 1 and text.count(envoyfilter_target) == 1
    text = text.replace("- ../billing-agent\n", "- ../billing-agent-wasmplugin\n").replace(envoyfilter_target, (
        "    group: extensions.istio.io\n    version: v1alpha1\n    kind: WasmPlugin\n"
        "    name: atmost\n    namespace: agents\n  path: governed-ports-wasmplugin.yaml\n"))
    kustomization.write_text(text)
    docs = kustomize(tree / EXTERNAL_PROVIDER)
    [plugin] = of_kind(docs, "WasmPlugin")
    assert filter_ports(docs) == {8000, 80}
    shipped = filter_object(rendered[AGENT_WASMPLUGIN])
    assert {**plugin, "spec": {**plugin["spec"], "match": []}} == {**shipped, "spec": {**shipped["spec"], "match": []}}
    assert route_errors(rendered, docs) == []
    assert all(errors_of(d) == [] for d in docs)


def test_istio_doc_steps_for_tools_outside_the_mesh(rendered):
    """docs/istio.md, "Tools outside the mesh": its commands name kustomizations that exist, and
    its `istio-proxy` entry is a valid container that mounts the CA ConfigMap the steps create
    where the DestinationRule reads it, in the istio-proxy container only."""
    section = istio_doc_section("Tools outside the mesh")
    named = re.findall(r"kubectl (?:apply -k|kustomize|delete -k) (envoy/istio/[\w./-]+)", section)
    assert f"envoy/istio/{EXTERNAL_PROVIDER}" in named
    for path in named:
        assert path.removeprefix("envoy/istio/").rstrip("/") in KUSTOMIZATIONS, path
    [block] = [b for b in re.findall(r"```yaml\n(.*?)```", section, re.S) if "istio-proxy" in b]
    pod = yaml.safe_load(block)
    [container] = pod["containers"]
    assert container["name"] == "istio-proxy" and container["image"] == "auto"
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "billing-agent", "namespace": "agents"},
                  "spec": {"selector": {"matchLabels": {AGENT_LABEL: "billing-agent"}}, "template": {
                      "metadata": {"labels": {AGENT_LABEL: "billing-agent"}},
                      "spec": {"containers": [{"name": "agent", "image": "registry.example.com/agent:1"}, container],
                               "volumes": pod["volumes"]}}}}
    assert kubernetes_errors(deployment) == []
    [mount] = container["volumeMounts"]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    [dr] = of_kind(rendered[EXTERNAL_PROVIDER], "DestinationRule")
    ca_path = dr["spec"]["trafficPolicy"]["portLevelSettings"][0]["tls"]["caCertificates"]
    [key] = [i["key"] for i in volume["configMap"]["items"]] if "items" in volume["configMap"] else [Path(ca_path).name]
    assert f"{mount['mountPath'].rstrip('/')}/{key}" == ca_path and mount["readOnly"] is True
    assert f"create configmap {volume['configMap']['name']}" in section and f"--from-file={key}=" in section


# ---------------------------------------------------------------- what an agent pod sends past its sidecar
#
# Istio captures TCP only. Each agent overlay ships a NetworkPolicy for the agent's pods: UDP to the
# cluster's DNS pods and nowhere else, TCP (which the sidecar captures) to anywhere, nothing else.
# The checks read the rendered policy as a CNI would apply it (tests/support/network_policy.py,
# which tests/e2e/test_pod_routes.py enforces in a pod's network namespace).

KUBE_DNS_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                 "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}


def agent_network_errors(policy: dict) -> list[str]:
    """UDP only to the cluster DNS pods' port 53, TCP to anywhere, nothing else; no address
    block (a pod address or a provider's could be let out that way)."""
    spec = policy["spec"]
    errors = []
    if "Egress" not in spec.get("policyTypes", []):
        errors.append("no Egress in policyTypes: the policy restricts nothing the pod sends")
    tcp_anywhere = False
    for i, rule in enumerate(spec.get("egress", [])):
        peers = rule.get("to")
        if any("ipBlock" in peer for peer in peers or []):
            errors.append(f"egress[{i}]: an ipBlock")
        ports = rule.get("ports")
        protocols = {p.get("protocol", "TCP") for p in ports} if ports else {"TCP", "UDP", "SCTP"}
        if protocols - {"TCP", "UDP"}:
            errors.append(f"egress[{i}]: lets out {sorted(protocols - {'TCP', 'UDP'})}")
        if "UDP" in protocols:
            udp_ports = [p.get("port") for p in ports or [{}] if p.get("protocol", "TCP") == "UDP" or not ports]
            if peers != [KUBE_DNS_PEER] or udp_ports != [53]:
                errors.append(f"egress[{i}]: lets out UDP to {peers or 'anywhere'} on {udp_ports}, "
                              "not to the cluster DNS on 53 alone")
        if peers is None and ports and any(p.get("protocol", "TCP") == "TCP" and "port" not in p for p in ports):
            tcp_anywhere = True
    if not tcp_anywhere:
        errors.append("no rule lets TCP out to anywhere: the sidecar could not reach the mesh or the providers")
    return errors


@pytest.mark.parametrize("kustomization", [AGENT_ENVOYFILTER, AGENT_WASMPLUGIN, EXTERNAL_PROVIDER])
def test_an_agent_pods_udp_goes_to_the_cluster_dns_only(rendered, kustomization):
    policy = agent_network_policy(rendered[kustomization])
    assert agent_network_errors(policy) == []
    assert policy["spec"]["policyTypes"] == ["Egress"]


def test_the_agent_network_policy_enforced_lets_udp_out_to_dns_alone(rendered):
    """The rendered policy as the pod-network test enforces it: UDP accepted to the DNS pod's port
    53 only, TCP to any address, everything else dropped."""
    from tests.support.network_policy import Cluster, Pod, egress_rules

    policy = agent_network_policy(rendered[AGENT_ENVOYFILTER])
    agent = Pod("agents", {AGENT_LABEL: AGENT_NAME}, "10.0.0.7")
    cluster = Cluster(namespaces={"agents": {"kubernetes.io/metadata.name": "agents"},
                                  "kube-system": {"kubernetes.io/metadata.name": "kube-system"},
                                  "tools": {"kubernetes.io/metadata.name": "tools"}},
                      pods=(agent, Pod("kube-system", {"k8s-app": "kube-dns"}, "10.0.0.53"),
                            Pod("kube-system", {"k8s-app": "metrics-server"}, "10.0.0.54"),
                            Pod("tools", {"k8s-app": "kube-dns"}, "10.0.0.55")))
    accepted = [line for line in egress_rules(policy, agent, cluster).splitlines()
                if line.startswith("-A ATMOST_NETPOL") and line.endswith("-j ACCEPT")]
    assert accepted == ["-A ATMOST_NETPOL -d 10.0.0.53/32 -p udp --dport 53 -j ACCEPT",
                        "-A ATMOST_NETPOL -d 10.0.0.53/32 -p tcp --dport 53 -j ACCEPT",
                        "-A ATMOST_NETPOL -p tcp -j ACCEPT"]


def test_the_agent_network_checks_find_udp_let_out(rendered):
    """Broken copies: each one is caught, so the checks above can fail."""
    def broken(change) -> list[str]:
        policy = copy.deepcopy(agent_network_policy(rendered[AGENT_ENVOYFILTER]))
        change(policy["spec"])
        return agent_network_errors(policy)

    assert any("not to the cluster DNS" in e for e in broken(lambda s: s["egress"].append({})))
    assert any("not to the cluster DNS" in e for e in broken(
        lambda s: s["egress"].append({"ports": [{"protocol": "UDP", "port": 443}]})))
    assert any("not to the cluster DNS" in e for e in broken(lambda s: s["egress"][0].pop("to")))
    assert any("an ipBlock" in e for e in broken(
        lambda s: s["egress"].append({"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}], "ports": [{"protocol": "TCP"}]})))
    assert any("SCTP" in e for e in broken(lambda s: s["egress"].append({"ports": [{"protocol": "SCTP"}]})))
    assert any("no Egress" in e for e in broken(lambda s: s.update(policyTypes=["Ingress"])))
    assert any("TCP out to anywhere" in e for e in broken(lambda s: s["egress"].pop()))


# ---------------------------------------------------------------- the verifier at the tool server
#
# overlays/payments-verifier (EnvoyFilter) and overlays/payments-verifier-wasmplugin (WasmPlugin):
# the filter with `role: verify` on the server's inbound side, and its port declared HTTP for the
# server's sidecar, so no sniffing listener sends a request past it to tcp_proxy.


def verifier_plugin(doc: dict) -> dict:
    [plugin] = plugin_configs(doc)
    return plugin


def inbound_ports(doc: dict) -> set[int]:
    """The inbound ports a verifier object puts the filter on."""
    if doc["kind"] == "WasmPlugin":
        return {p["number"] for m in doc["spec"]["match"] if m["mode"] == "SERVER" for p in m["ports"]}
    return {p["match"]["listener"]["portNumber"] for p in doc["spec"]["configPatches"]
            if p["applyTo"] == "HTTP_FILTER" and p["match"]["context"] == "SIDECAR_INBOUND"}


def verifier_errors(docs: list[dict]) -> list[str]:
    """What a verifier overlay must be: one verifying filter, fail closed, pinned by digest, on the
    server's inbound side only; every port it is on declared HTTP (protocol HTTP) by a Sidecar
    ingress listener for the same pods; no gateway field in its configuration."""
    errors = []
    [doc] = [d for d in docs if d["kind"] in ("EnvoyFilter", "WasmPlugin")]
    [sidecar] = of_kind(docs, "Sidecar")
    plugin = verifier_plugin(doc)
    if plugin.get("role") != "verify":
        errors.append("the filter's role is not verify")
    if doc["kind"] == "WasmPlugin":
        spec = doc["spec"]
        if spec.get("failStrategy") != "FAIL_CLOSE":
            errors.append("the WasmPlugin does not fail closed")
        if any(m["mode"] != "SERVER" for m in spec["match"]):
            errors.append("the WasmPlugin matches more than the server's inbound side")
        if plugin.get("request_hold") != "body":
            errors.append("a WasmPlugin cannot hold headers: request_hold must be body")
    else:
        ext, http = envoyfilter_parts({"EnvoyFilter": doc})
        config = ext["patch"]["value"]["typed_config"]["config"]
        if config.get("failure_policy") != "FAIL_CLOSED" or config.get("allow_on_headers_stop_iteration") is not True:
            errors.append("the EnvoyFilter's Wasm filter does not fail closed, or cannot hold headers")
        if any(p.get("match", {}).get("context") not in (None, "SIDECAR_INBOUND") for p in doc["spec"]["configPatches"]):
            errors.append("the EnvoyFilter patches more than the server's inbound side")
        if http["patch"]["value"]["name"] != ext["patch"]["value"]["name"]:
            errors.append("the HTTP filter does not fetch the EXTENSION_CONFIG it adds")
    ports = inbound_ports(doc)
    if not ports:
        errors.append("the verifier is on no inbound port")
    declared = {i["port"]["number"]: i["port"] for i in sidecar["spec"].get("ingress", [])}
    for port in sorted(ports):
        if port not in declared:
            errors.append(f"port {port}: the verifier's port is not declared for the server's sidecar")
        elif declared[port].get("protocol") not in READABLE_PROTOCOLS:
            errors.append(f"port {port}: declared {declared[port].get('protocol')}, not HTTP: a sniffed port sends "
                          "what its inspector does not read as HTTP past the verifier")
    if sidecar["spec"].get("workloadSelector", {}).get("labels") != selector_of(doc):
        errors.append("the Sidecar selects other pods than the verifier")
    if "egress" in sidecar["spec"] or "outboundTrafficPolicy" in sidecar["spec"]:
        errors.append("the Sidecar changes the server's outbound side")
    return errors


@pytest.mark.parametrize("kustomization", [VERIFIER_ENVOYFILTER, VERIFIER_WASMPLUGIN])
def test_the_verifier_overlay_declares_its_port_http(rendered, kustomization):
    docs = rendered[kustomization]
    assert verifier_errors(docs) == []
    doc = filter_object(docs)
    assert selector_of(doc) == {"app": TOOL_NAME}
    assert {d["metadata"]["namespace"] for d in docs} == {"tools"}
    assert all(d["metadata"]["name"].endswith(f"-{TOOL_NAME}") for d in docs)
    # It serves its own Service's names, and no other server's: the base's placeholder is gone.
    assert verifier_plugin(doc)["verify"]["authorities"] == [
        f"{TOOL_NAME}.tools.svc.cluster.local:8000", f"{TOOL_NAME}.tools:8000", f"{TOOL_NAME}:8000"]


def test_the_verifier_forms_carry_the_same_configuration(rendered):
    """The same verifier in both forms, but that the WasmPlugin holds the body only; the same
    port, the same pods, the same Sidecar."""
    ef_docs, wp_docs = rendered[VERIFIER_ENVOYFILTER], rendered[VERIFIER_WASMPLUGIN]
    ef, wp = filter_object(ef_docs), filter_object(wp_docs)
    assert {k: v for k, v in verifier_plugin(wp).items() if k != "request_hold"} == verifier_plugin(ef)
    assert "request_hold" not in verifier_plugin(ef)
    assert inbound_ports(ef) == inbound_ports(wp) == {8000}
    assert selector_of(ef) == selector_of(wp)
    assert of_kind(ef_docs, "Sidecar") == of_kind(wp_docs, "Sidecar")
    # The ledger's cluster and authority the agents' filter uses, for the key set.
    agent = plugin_configs(filter_object(rendered[AGENT_ENVOYFILTER]))[0]
    jwks = verifier_plugin(ef)["verify"]["jwks"]
    assert (jwks["cluster"], jwks["authority"]) == (agent["ledger"]["cluster"], agent["ledger"]["authority"])


def test_the_verifier_checks_find_a_sniffed_or_missing_port(rendered):
    """Broken copies: each one is caught, so the checks above can fail."""
    def broken(kustomization: str, change) -> list[str]:
        docs = copy.deepcopy(rendered[kustomization])
        change(docs)
        return verifier_errors(docs)

    def sidecar(docs):
        [s] = of_kind(docs, "Sidecar")
        return s

    for kustomization in (VERIFIER_ENVOYFILTER, VERIFIER_WASMPLUGIN):
        assert any("not HTTP" in e for e in broken(
            kustomization, lambda d: sidecar(d)["spec"]["ingress"][0]["port"].update(protocol="TCP")))
        assert any("not declared" in e for e in broken(
            kustomization, lambda d: sidecar(d)["spec"]["ingress"][0]["port"].update(number=9000)))
        assert any("other pods" in e for e in broken(
            kustomization, lambda d: sidecar(d)["spec"]["workloadSelector"]["labels"].update(app="other")))
    assert any("fail closed" in e for e in broken(
        VERIFIER_WASMPLUGIN, lambda d: filter_object(d)["spec"].update(failStrategy="FAIL_OPEN")))
    assert any("request_hold must be body" in e for e in broken(
        VERIFIER_WASMPLUGIN, lambda d: filter_object(d)["spec"]["pluginConfig"].pop("request_hold")))

    def outbound(docs):
        for patch in filter_object(docs)["spec"]["configPatches"]:
            if "match" in patch:
                patch["match"]["context"] = "SIDECAR_OUTBOUND"
    errors = broken(VERIFIER_ENVOYFILTER, outbound)
    assert any("more than the server's inbound side" in e for e in errors)
    assert any("on no inbound port" in e for e in errors)
