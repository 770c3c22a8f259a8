"""The Kubernetes / Istio manifests under envoy/istio/ with what `make wasm` and `make oci-test`
built: rendered by `kubectl kustomize` with the digests `make oci-test` printed (target/oci-
test/*.digest, written into the overlays the way the rollout steps do it), the overlays pin exactly
those images, the Deployment relies on the ledger image's own configuration, and the Envoy config
each EnvoyFilter and WasmPlugin inserts passes `envoy --mode validate` with the built filter.

Everything else about these manifests (rendering, schemas, structure, the docs' steps) reads
files only and is tests/files/test_manifests.py, with stand-in digests.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from tests.support.certificates import make_ca
from tests.support.manifests import (
    AGENT_ENVOYFILTER,
    AGENT_WASMPLUGIN,
    EQUIVALENT_ENVOY,
    EXTERNAL_PROVIDER,
    ISTIO_DIR,
    LEDGER_POSTGRES,
    LEDGER_SQLITE,
    PROVIDER_HOST,
    VERIFIER_ENVOYFILTER,
    VERIFIER_WASMPLUGIN,
    by_kind,
    envoyfilter_parts,
    filter_image,
    filter_object,
    host_env_keys_of,
    istio_doc_section,
    ledger_container,
    mesh_objects,
    new_ledger_env,
    of_kind,
    render_istio,
    run_digest_steps,
    set_digests,
)
from tests.support.oci import OCI_DIR, built, ledger_image_config
from tests.support.stack import WASM, validate_envoy_config, wasmplugin_filter_config

# `envoy --mode validate` runs the filter's on_configure, which reads them.
VALIDATION_ENV = {"ATMOST_SERVICE_TOKEN": "validation-service-token-of-32-bytes",
                  "ATMOST_UPSTREAM_KEY_SECRET": "validation-upstream-key-secret"}


# ---------------------------------------------------------------- rendered with what `make oci-test` built


@pytest.fixture(scope="session")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """kustomization (relative path) -> its rendered objects, with the operator's inputs in place:
    the digests `make oci-test` built, and a ledger.env."""
    return render_istio(tmp_path_factory.mktemp("kustomize"), built(), new_ledger_env())


@pytest.fixture(scope="session")
def objs(rendered) -> dict[str, dict]:
    """kind -> object, for one mesh: the ledger on PostgreSQL, the agent namespace's
    VirtualService, and one agent's EnvoyFilter and WasmPlugin."""
    return mesh_objects(rendered)


# ---------------------------------------------------------------- images by digest


@pytest.mark.parametrize("kustomization", [LEDGER_POSTGRES, LEDGER_SQLITE])
def test_ledger_overlays_pin_the_built_image_by_digest(rendered, kustomization):
    image = ledger_container(rendered[kustomization])["image"]
    name, _, digest = image.partition("@")
    assert digest == built()["ledger"], f"{image} is not the image `make oci-test` built"
    assert name == "registry.example.com/atmost/atmost-ledger" and ":" not in name, "by digest, no tag"


@pytest.mark.parametrize("kustomization", [AGENT_ENVOYFILTER, AGENT_WASMPLUGIN, VERIFIER_ENVOYFILTER, VERIFIER_WASMPLUGIN])
def test_agent_overlays_pin_the_built_filter_by_digest(rendered, kustomization):
    url, sha256 = filter_image(by_kind(rendered[kustomization]))
    hex_digest = built()["filter"].split(":")[1]
    assert url == f"oci://registry.example.com/atmost/atmost-filter@sha256:{hex_digest}"
    assert sha256 == hex_digest


def test_deployment_runs_the_image_as_built(objs):
    """The Deployment relies on the image's own entrypoint, user, data directory (a volume) and
    listen address, and on nothing writable but that volume."""
    config = ledger_image_config()
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert "command" not in container and container["args"] == ["ledger"]
    assert config["Entrypoint"] == ["/usr/local/bin/atmost"] and config["Cmd"] == ["ledger"]
    assert config["User"] == f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}"
    env = {e["name"]: e.get("value") for e in container["env"]}
    image_env = dict(e.split("=", 1) for e in config["Env"])
    assert env["ATMOST_DATA_DIR"] == image_env["ATMOST_DATA_DIR"]
    assert [m["mountPath"] for m in container["volumeMounts"]] == [env["ATMOST_DATA_DIR"]]
    assert list(config["Volumes"]) == [env["ATMOST_DATA_DIR"]]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    port = int(env["ATMOST_LISTEN"].rsplit(":", 1)[1])
    admin_port = int(env["ATMOST_ADMIN_LISTEN"].rsplit(":", 1)[1])
    assert [p["containerPort"] for p in container["ports"]] == [port, admin_port]
    assert f"{port}/tcp" in config["ExposedPorts"]


def test_rollout_steps_write_the_digests_make_oci_test_built(tmp_path):
    """Step 0's commands, run on a copy with the digest files `make oci-test` wrote, put those digests
    where set_digests puts them (the same with stand-ins: tests/files/test_manifests.py)."""
    steps = istio_doc_section("Adding atmost to an existing Istio mesh")
    built()  # the digest files name the images skopeo reads
    assert run_digest_steps(steps, ISTIO_DIR, tmp_path, set_digests, OCI_DIR) == 6


# ---------------------------------------------------------------- `envoy --mode validate` with the built filter


def proto_merge(into: dict, value: dict) -> None:
    """Istio's MERGE of a patch value into a config: messages merge field by field, lists
    append, scalars replace."""
    for key, item in value.items():
        if isinstance(item, dict) and isinstance(into.get(key), dict):
            proto_merge(into[key], item)
        elif isinstance(item, list) and isinstance(into.get(key), list):
            into[key].extend(copy.deepcopy(item))
        else:
            into[key] = copy.deepcopy(item)


@pytest.mark.parametrize("kustomization", ["agent-envoyfilter", AGENT_ENVOYFILTER])
def test_envoyfilter_wasm_config_passes_envoy_validate(rendered, kustomization, tmp_path):
    """The Wasm config the rendered EnvoyFilter inserts, with its code made local, and its merge
    into the connection manager load in real Envoy (the filter's on_configure included)."""
    assert WASM.exists(), "build the filter first (make wasm)"
    objs = by_kind(rendered[kustomization])
    ext, http = envoyfilter_parts(objs)
    wasm = copy.deepcopy(ext["patch"]["value"]["typed_config"])
    wasm["config"]["vm_config"]["code"] = {"local": {"filename": str(WASM)}}
    config = yaml.safe_load(EQUIVALENT_ENVOY.read_text())
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    index = next(i for i, f in enumerate(hcm["http_filters"]) if f["name"] == "atmost")
    hcm["http_filters"][index] = {"name": "atmost", "typed_config": wasm}
    # The connection manager as Istio builds it, then the EnvoyFilter's merge.
    del hcm["common_http_protocol_options"]
    port = http["match"]["listener"]["portNumber"]
    for merge in objs["EnvoyFilter"]["spec"]["configPatches"]:
        if merge["applyTo"] == "NETWORK_FILTER" and merge["match"]["listener"]["portNumber"] == port:
            proto_merge(hcm, merge["patch"]["value"]["typed_config"])
    assert hcm["common_http_protocol_options"]["headers_with_underscores_action"] == "REJECT_REQUEST"
    path = tmp_path / "envoyfilter-as-envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    result = validate_envoy_config(path, env=VALIDATION_ENV)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    # The filter's on_configure did read the variables: without them the same config is refused.
    result = validate_envoy_config(path, env={**VALIDATION_ENV, "ATMOST_SERVICE_TOKEN": ""})
    assert result.returncode != 0 and "field `ledger.service_token_env`" in result.stdout + result.stderr


def test_wasmplugin_as_istiod_renders_it_passes_envoy_validate(objs, tmp_path):
    """The WasmPlugin's Wasm config as istiod renders it (no allow_on_headers_stop_iteration),
    with its code made local, loads in real Envoy; the e2e runs with ATMOST_DEPLOYMENT=wasmplugin
    put this same rendering in front of the suites."""
    assert WASM.exists(), "build the filter first (make wasm)"
    spec = objs["WasmPlugin"]["spec"]
    rendered = wasmplugin_filter_config(spec["pluginConfig"], WASM, host_env_keys_of(spec))
    assert "allow_on_headers_stop_iteration" not in json.dumps(rendered)
    assert json.loads(rendered["configuration"]["value"]) == spec["pluginConfig"]
    assert rendered["root_id"] == spec["pluginName"] and rendered["failure_policy"] == "FAIL_CLOSED"
    config = yaml.safe_load(EQUIVALENT_ENVOY.read_text())
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    index = next(i for i, f in enumerate(hcm["http_filters"]) if f["name"] == "atmost")
    hcm["http_filters"][index] = {"name": "atmost", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm", "config": rendered}}
    path = tmp_path / "wasmplugin-as-envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    result = validate_envoy_config(path, env=VALIDATION_ENV)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    # The filter's on_configure read this configuration: a bad request_hold is refused.
    bad = copy.deepcopy(rendered)
    bad["configuration"]["value"] = json.dumps({**spec["pluginConfig"], "request_hold": "sometimes"})
    hcm["http_filters"][index]["typed_config"]["config"] = bad
    path.write_text(yaml.safe_dump(config))
    result = validate_envoy_config(path, env=VALIDATION_ENV)
    assert result.returncode != 0 and "field `request_hold`" in result.stdout + result.stderr


def provider_envoy_config(docs: list[dict], ca_file: Path) -> dict:
    """What a sidecar of the overlay runs for the provider, as plain Envoy: equivalent-envoy.yaml
    plus the outbound listener of port 80 with the EnvoyFilter's Wasm filter and its connection
    manager merges for that port, routed without retries to a cluster that originates TLS as the
    DestinationRule says (`caCertificates` is a path inside the pod: here `ca_file`)."""
    [ef] = of_kind(docs, "EnvoyFilter")
    [se] = [d for d in of_kind(docs, "ServiceEntry") if PROVIDER_HOST in d["spec"]["hosts"]]
    [dr] = [d for d in of_kind(docs, "DestinationRule") if d["spec"]["host"] == PROVIDER_HOST]
    [port] = se["spec"]["ports"]
    [level] = dr["spec"]["trafficPolicy"]["portLevelSettings"]
    ext = next(p for p in ef["spec"]["configPatches"] if p["applyTo"] == "EXTENSION_CONFIG")
    wasm = copy.deepcopy(ext["patch"]["value"]["typed_config"])
    wasm["config"]["vm_config"]["code"] = {"local": {"filename": str(WASM)}}
    config = yaml.safe_load(EQUIVALENT_ENVOY.read_text())
    listener = copy.deepcopy(config["static_resources"]["listeners"][0])
    cluster_name = f"outbound|{port['number']}||{PROVIDER_HOST}"
    listener["name"] = f"0.0.0.0_{port['number']}"
    listener["address"]["socket_address"]["port_value"] = port["number"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["stat_prefix"] = f"outbound_0.0.0.0_{port['number']}"
    hcm.pop("common_http_protocol_options", None)  # as Istio builds it; the EnvoyFilter's merges follow
    for merge in ef["spec"]["configPatches"]:
        if merge["applyTo"] == "NETWORK_FILTER" and merge["match"]["listener"]["portNumber"] == port["number"]:
            assert merge["patch"]["operation"] == "MERGE"
            for field, value in merge["patch"]["value"]["typed_config"].items():
                if field != "@type":
                    hcm.setdefault(field, {}).update(value)
    hcm["http_filters"] = [{"name": "atmost", "typed_config": wasm} if f["name"] == "atmost" else f
                           for f in hcm["http_filters"]]
    [vs] = [d for d in of_kind(docs, "VirtualService") if d["spec"]["hosts"] == [PROVIDER_HOST]]
    routes = []
    for route in vs["spec"]["http"]:
        match = {"prefix": "/"}
        if "match" in route:
            match["headers"] = [{"name": ":method", "string_match": route["match"][0]["method"]}]
        routes.append({"name": route["name"], "match": match, "route": {"cluster": cluster_name, "timeout": route["timeout"]}})
    hcm["route_config"] = {"name": str(port["number"]), "virtual_hosts": [
        {"name": f"{PROVIDER_HOST}:{port['number']}", "domains": [PROVIDER_HOST, f"{PROVIDER_HOST}:{port['number']}"],
         "routes": routes}]}
    config["static_resources"]["listeners"].append(listener)
    tls = level["tls"]
    config["static_resources"]["clusters"].append({
        "name": cluster_name, "type": "STRICT_DNS", "connect_timeout": "10s",
        "load_assignment": {"cluster_name": cluster_name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
            "socket_address": {"address": PROVIDER_HOST, "port_value": port["targetPort"]}}}}]}]},
        "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "sni": tls["sni"],
            "common_tls_context": {"validation_context": {
                "trusted_ca": {"filename": str(ca_file)},
                "match_typed_subject_alt_names": [{"san_type": "DNS", "matcher": {"exact": n}}
                                                  for n in tls["subjectAltNames"]]}}}}})
    return config


def test_the_overlays_provider_listener_passes_envoy_validate(rendered, tmp_path):
    """The Envoy config the overlay amounts to for the provider's port (the Wasm filter the
    EnvoyFilter inserts, its connection manager merge for port 80, TLS origination with the
    DestinationRule's SNI and name) loads in real Envoy; the same without the CA file does not."""
    assert WASM.exists(), "build the filter first (make wasm)"
    ca, _ = make_ca(tmp_path, "provider-ca")
    config = provider_envoy_config(rendered[EXTERNAL_PROVIDER], ca)
    hcm = config["static_resources"]["listeners"][-1]["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["common_http_protocol_options"] == {"headers_with_underscores_action": "REJECT_REQUEST"}
    path = tmp_path / "external-provider-as-envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    result = validate_envoy_config(path, env=VALIDATION_ENV)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    path.write_text(yaml.safe_dump(provider_envoy_config(rendered[EXTERNAL_PROVIDER], tmp_path / "missing.pem")))
    result = validate_envoy_config(path, env=VALIDATION_ENV)
    assert result.returncode != 0 and "missing.pem" in result.stdout + result.stderr


def plugin_json_of(doc: dict) -> dict:
    """The plugin configuration a WasmPlugin or an EnvoyFilter carries."""
    if doc["kind"] == "WasmPlugin":
        return doc["spec"]["pluginConfig"]
    ext, _ = envoyfilter_parts({"EnvoyFilter": doc})
    return json.loads(ext["patch"]["value"]["typed_config"]["config"]["configuration"]["value"])


def verifier_envoy_config(docs: list[dict], plugin_json: dict | None = None) -> dict:
    """What the server's sidecar runs for the verifier overlay, as plain Envoy: equivalent-envoy.yaml's
    listener (an HTTP connection manager, as the Sidecar's ingress port declares it) with the
    overlay's Wasm filter in atmost's place, the code made local: the EnvoyFilter's config with its
    connection manager merge for the port, or the WasmPlugin as istiod renders it. The ledger's
    cluster, which the key set is fetched from, is equivalent-envoy.yaml's. `plugin_json` stands in
    for the overlay's plugin configuration."""
    doc = filter_object(docs)
    config = yaml.safe_load(EQUIVALENT_ENVOY.read_text())
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    index = next(i for i, f in enumerate(hcm["http_filters"]) if f["name"] == "atmost")
    del hcm["common_http_protocol_options"]
    if doc["kind"] == "WasmPlugin":
        spec = doc["spec"]
        wasm = {"@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
                "config": wasmplugin_filter_config(spec["pluginConfig"], WASM, host_env_keys_of(spec))}
        wasm["config"]["name"] = f"{doc['metadata']['namespace']}.{doc['metadata']['name']}"
        # The verifier's WasmPlugin names no variable of the sidecar's environment.
        assert "vmConfig" not in spec
        wasm["config"]["vm_config"]["environment_variables"].pop("host_env_keys", None)
        assert "allow_on_headers_stop_iteration" not in json.dumps(wasm)
    else:
        ext, http = envoyfilter_parts({"EnvoyFilter": doc})
        assert http["match"]["context"] == "SIDECAR_INBOUND"
        wasm = copy.deepcopy(ext["patch"]["value"]["typed_config"])
        wasm["config"]["vm_config"]["code"] = {"local": {"filename": str(WASM)}}
        for merge in doc["spec"]["configPatches"]:
            if merge["applyTo"] == "NETWORK_FILTER":
                proto_merge(hcm, merge["patch"]["value"]["typed_config"])
    if plugin_json is not None:
        wasm["config"]["configuration"]["value"] = json.dumps(plugin_json)
    hcm["http_filters"][index] = {"name": "atmost", "typed_config": wasm}
    return config


@pytest.mark.parametrize("kustomization", [VERIFIER_ENVOYFILTER, VERIFIER_WASMPLUGIN])
def test_the_verifier_overlay_passes_envoy_validate(rendered, kustomization, tmp_path):
    """The verifier overlay's Wasm filter, with the built module, loads in real Envoy: its
    on_configure reads the overlay's verifier configuration; the same with a gateway field in it
    is refused, naming the field."""
    assert WASM.exists(), "build the filter first (make wasm)"
    docs = rendered[kustomization]
    path = tmp_path / "verifier-as-envoy.yaml"
    path.write_text(yaml.safe_dump(verifier_envoy_config(docs)))
    result = validate_envoy_config(path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    plugin = plugin_json_of(filter_object(docs))
    assert plugin["role"] == "verify"
    path.write_text(yaml.safe_dump(verifier_envoy_config(docs, {**plugin, "permit_header": "atmost-permit"})))
    result = validate_envoy_config(path)
    assert result.returncode != 0 and "field `permit_header`" in result.stdout + result.stderr

