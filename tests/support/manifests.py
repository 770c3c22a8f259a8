"""The Kubernetes manifests under envoy/, as `kubectl kustomize` renders them the way an operator
applies them, and what the checks of the files tier (tests/files/test_manifests.py,
tests/files/test_envoy_gateway_manifests.py, tests/files/test_admission_policy.py) and their
halves in tests/e2e share: the operator's inputs put in place on a copy (image digests where the
rollout steps write them, a ledger.env), the rollout steps' own commands run on a copy, the
schema validators (CRDs in strict mode, core kinds with kubernetes-validate's strict schemas),
and the parts of a rendering both halves read.

Which digests go into the overlays is the caller's: the files tier writes STAND_IN, digests of
no image, so it needs no build; tests/e2e writes the ones `make oci` built (tests/support/oci.py).

`kubectl` is the one on PATH (Debian's `kubernetes-client`, installed by `make setup` when none
is); KUBECTL names another.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

from tests.support.stack import ROOT

ISTIO_DIR = ROOT / "envoy" / "istio"
OVERLAYS_DIR = ISTIO_DIR / "overlays"
SCHEMAS = ROOT / "tests" / "files" / "schemas"
ISTIO_CRDS = SCHEMAS / "istio-crds.yaml"
EQUIVALENT_ENVOY = ISTIO_DIR / "equivalent-envoy.yaml"
ISTIO_DOC = ROOT / "docs" / "istio.md"
K8S_VERSION = "1.37"  # the newest Kubernetes whose schemas kubernetes-validate 1.37.0 ships
KUBECTL = os.environ.get("KUBECTL", "kubectl")

# Every kustomization, as a path relative to envoy/istio/ ("ledger", "overlays/ledger-sqlite", ...).
KUSTOMIZATIONS = sorted(str(p.parent.relative_to(ISTIO_DIR)) for p in ISTIO_DIR.rglob("kustomization.yaml"))
OVERLAYS = [k for k in KUSTOMIZATIONS if k.startswith("overlays/")]
BASES = [k for k in KUSTOMIZATIONS if k not in OVERLAYS]
# What an operator applies for one mesh: the ledger on PostgreSQL, the agents' namespace, one
# agent with the EnvoyFilter form, the same agent with the WasmPlugin form (never both at once
# in a real mesh; here they are compared).
LEDGER_POSTGRES, LEDGER_SQLITE = "overlays/ledger-postgres", "overlays/ledger-sqlite"
AGENT_NAMESPACE, AGENT_ENVOYFILTER, AGENT_WASMPLUGIN = "agent", "overlays/billing-agent", "overlays/billing-agent-wasmplugin"
AGENT_NAME = "billing-agent"
# The agents namespace with a governed MCP server outside the mesh (its checks: the last section).
EXTERNAL_PROVIDER = "overlays/external-provider"
# The verifier in front of one MCP server, in its two forms, and its server's label value.
VERIFIER_ENVOYFILTER, VERIFIER_WASMPLUGIN = "overlays/payments-verifier", "overlays/payments-verifier-wasmplugin"
TOOL_NAME = "payments-mcp"

# The filter's secrets: the sidecar's environment variables they come from, in this order.
SECRET_ENV = ["ATMOST_SERVICE_TOKEN", "ATMOST_UPSTREAM_KEY_SECRET"]
AGENT_LABEL = "atmost.dev/agent"
DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
HEX_RE = re.compile(r"[0-9a-f]{64}")
# Digests of no image, written where the rollout steps write the ones `make oci` printed: the
# files tier renders the overlays with these, so the checks that an overlay pins a digest, and
# pins it where the steps put it, need no build.
STAND_IN = {"ledger": "sha256:" + hashlib.sha256(b"atmost-ledger stand-in").hexdigest(),
            "filter": "sha256:" + hashlib.sha256(b"atmost-filter stand-in").hexdigest()}
# The files `make oci` writes beside each image, `sha256:<hex>` and a newline (scripts/oci_image.py).
DIGEST_FILES = {"ledger": "atmost-ledger.digest", "filter": "atmost-filter.digest"}


# ---------------------------------------------------------------- rendering


def kustomize(directory: Path) -> list[dict]:
    result = subprocess.run([KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"kubectl kustomize {directory}: {result.stderr}"
    return [d for d in yaml.safe_load_all(result.stdout) if d is not None]


def set_digests(tree: Path, ledger_digest: str, filter_digest: str) -> None:
    """What the rollout steps have the operator do after `make oci` (docs/istio.md and
    docs/envoy-gateway.md, step 0), in `tree` (a copy of envoy/istio/ or envoy/gateway/): the
    ledger's digest into the store overlays' `images:`, the filter's into every filter-image.yaml."""
    for kustomization in (tree / "overlays").glob("ledger-*/kustomization.yaml"):
        kustomization.write_text(DIGEST_RE.sub(ledger_digest, kustomization.read_text()))
    for patch in (tree / "overlays").glob("*/filter-image.yaml"):
        patch.write_text(HEX_RE.sub(filter_digest.split(":")[1], patch.read_text()))


def new_ledger_env() -> dict[str, str]:
    """The values of the ledger.env the operator writes for ../overlays/ledger-postgres/."""
    return {"service-token": secrets.token_hex(32), "admin-token": secrets.token_hex(32),
            "store-url": f"postgres://atmost:{secrets.token_hex(8)}@db.example.internal:5432/atmost?sslmode=verify-full"}


def istio_copy(parent: Path, digests: dict[str, str]) -> Path:
    """A copy of envoy/istio/ under `parent` with `digests` (ledger, filter) where the rollout
    steps put them."""
    tree = parent / "istio"
    # Never a developer's own ledger.env: the test writes its own.
    shutil.copytree(ISTIO_DIR, tree, ignore=shutil.ignore_patterns("ledger.env"))
    set_digests(tree, digests["ledger"], digests["filter"])
    return tree


def render_istio(parent: Path, digests: dict[str, str], ledger_env: dict[str, str]) -> dict[str, list[dict]]:
    """kustomization (relative path) -> its rendered objects, with the operator's inputs in place:
    `digests` (istio_copy) and `ledger_env` as the PostgreSQL overlay's ledger.env."""
    tree = istio_copy(parent, digests)
    (tree / LEDGER_POSTGRES / "ledger.env").write_text("".join(f"{k}={v}\n" for k, v in ledger_env.items()))
    return {k: kustomize(tree / k) for k in KUSTOMIZATIONS}


def by_kind(docs: list[dict]) -> dict[str, dict]:
    """kind -> the single object of that kind."""
    out: dict[str, dict] = {}
    for doc in docs:
        assert doc["kind"] not in out, f"two {doc['kind']} objects"
        out[doc["kind"]] = doc
    return out


def mesh_objects(rendered: dict[str, list[dict]]) -> dict[str, dict]:
    """kind -> object, for one mesh: the ledger on PostgreSQL (its NetworkPolicy among them), the
    agent namespace's VirtualService, and one agent's EnvoyFilter and WasmPlugin (each agent
    overlay's NetworkPolicy is the agent's own: agent_network_policy)."""
    agents = (AGENT_ENVOYFILTER, AGENT_WASMPLUGIN)
    return by_kind([d for k in (LEDGER_POSTGRES, AGENT_NAMESPACE, *agents) for d in rendered[k]
                    if not (k in agents and d["kind"] == "NetworkPolicy")])


def agent_network_policy(docs: list[dict]) -> dict:
    """The one NetworkPolicy of an agent overlay's rendering: what the agent's pods may send."""
    [policy] = of_kind(docs, "NetworkPolicy")
    return policy


def filter_object(docs: list[dict]) -> dict:
    """The one EnvoyFilter or WasmPlugin of an overlay's rendering."""
    [doc] = [d for d in docs if d["kind"] in ("EnvoyFilter", "WasmPlugin")]
    return doc


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


# ---------------------------------------------------------------- schema validation


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
      shipped kinds are checked in `istio_cel_errors` (tests/files/test_manifests.py).
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


def crd_schemas(*paths: Path) -> dict[tuple[str, str], tuple[dict, dict]]:
    """(apiVersion, kind) -> (JSON Schema, the CRD's openAPIV3Schema), for every served version of
    every CRD in the files: the object's own apiVersion, kind and metadata required, nothing else
    beside its schema's fields."""
    schemas = {}
    for path in paths:
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                if not version.get("served"):
                    continue
                api_version = f"{group}/{version['name']}"
                structural = version["schema"]["openAPIV3Schema"]
                schema = _structural_to_jsonschema(structural)
                schema["properties"] = {**schema["properties"], "apiVersion": {"const": api_version},
                                        "kind": {"const": kind}, "metadata": OBJECT_META}
                schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata"})
                schema["additionalProperties"] = False
                schemas[(api_version, kind)] = (schema, structural)
    return schemas


def kubernetes_errors(doc: dict) -> list[str]:
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.path)) or '<root>'}: {e.message}"]
    return []


# ---------------------------------------------------------------- parts of a rendering


def ledger_container(docs: list[dict]) -> dict:
    deployment = by_kind(docs)["Deployment"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return container


def filter_image(kinds: dict[str, dict]) -> tuple[str, str]:
    """(oci:// URL, hex sha256) of the filter image an agent's object refers to."""
    if "WasmPlugin" in kinds:
        spec = kinds["WasmPlugin"]["spec"]
        return spec["url"], spec["sha256"]
    ext, _ = envoyfilter_parts(kinds)
    remote = ext["patch"]["value"]["typed_config"]["config"]["vm_config"]["code"]["remote"]
    return remote["http_uri"]["uri"], remote["sha256"]


def host_env_keys_of(wasm_plugin_spec: dict) -> list[str]:
    """What istiod makes of a WasmPlugin's vmConfig.env for the VM's host_env_keys: the names whose
    valueFrom is HOST, in order (Istio source, pilot/pkg/model/extensions.go, buildVMConfig)."""
    return [e["name"] for e in wasm_plugin_spec.get("vmConfig", {}).get("env", []) if e.get("valueFrom") == "HOST"]


def envoyfilter_parts(objs) -> tuple[dict, dict]:
    patches = objs["EnvoyFilter"]["spec"]["configPatches"]
    ext = next(p for p in patches if p["applyTo"] == "EXTENSION_CONFIG")
    http = next(p for p in patches if p["applyTo"] == "HTTP_FILTER")
    return ext, http


# The governed MCP server outside the mesh that overlays/external-provider declares.
PROVIDER_HOST = "mcp.provider.example"


# ---------------------------------------------------------------- secrets


def assert_no_committed_secret(directory: str, ledger_env: str) -> None:
    """No tracked file under `directory` holds a store URL with a password, a secretGenerator
    literal, or is a ledger.env; the overlay's `ledger_env` is ignored by git."""
    tracked = subprocess.run(["git", "ls-files", directory], capture_output=True, text=True, cwd=ROOT,
                             timeout=30).stdout.split()
    assert tracked
    for rel in tracked:
        text = (ROOT / rel).read_text()
        assert not re.search(r"postgres(ql)?://[^\s/@]+:[^\s/@]+@", text), f"{rel}: a store URL with a password"
        assert "literals:" not in text, f"{rel}: a secretGenerator literal"
        assert not rel.endswith("ledger.env"), f"{rel}: committed secrets"
    ignored = subprocess.run(["git", "check-ignore", "-q", ledger_env], cwd=ROOT, timeout=30)
    assert ignored.returncode == 0, "ledger.env must be ignored by git"


# ---------------------------------------------------------------- the docs' rollout steps


def istio_doc_section(title: str) -> str:
    text = ISTIO_DOC.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def write_digest_files(directory: Path, digests: dict[str, str]) -> Path:
    """`directory` with the digest files `make oci` writes, holding `digests` (ledger, filter)."""
    directory.mkdir(parents=True, exist_ok=True)
    for key, name in DIGEST_FILES.items():
        (directory / name).write_text(digests[key] + "\n")
    return directory


def run_digest_steps(steps: str, tree: Path, tmp_path: Path, set_digests_by_test, digest_files: Path) -> int:
    """Runs the two `sed -i` commands of a doc's step 0 on a copy of `tree` (a directory under
    envoy/), with the digest files in `digest_files` where the commands read `make oci`'s, and
    `set_digests_by_test` with the same digests on another copy; both copies must end alike.
    Returns how many files the commands changed."""
    [block] = [b for b in re.findall(r"```sh\n(.*?)```", steps, re.S) if "sed -i" in b]
    commands = [line for line in block.splitlines() if line.startswith("sed -i")]
    assert len(commands) == 2, commands
    digests = {key: (digest_files / name).read_text().strip() for key, name in DIGEST_FILES.items()}
    assert all(DIGEST_RE.fullmatch(d) for d in digests.values()), digests
    where = tree.relative_to(ROOT)
    by_docs, by_test = tmp_path / "docs", tmp_path / "test"
    for copy_root in (by_docs, by_test):
        # Where the commands read them: the repository's target/oci, here in the copy.
        (copy_root / "target" / "oci").mkdir(parents=True)
        shutil.copytree(tree, copy_root / where, ignore=shutil.ignore_patterns("ledger.env"))
        for name in DIGEST_FILES.values():
            shutil.copy(digest_files / name, copy_root / "target" / "oci")
    for command in commands:
        result = subprocess.run(["bash", "-ec", command], cwd=by_docs, capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
    set_digests_by_test(by_test / where, digests["ledger"], digests["filter"])
    changed = 0
    for path in (by_test / where).rglob("*"):
        if path.is_file():
            assert path.read_bytes() == (by_docs / path.relative_to(by_test)).read_bytes(), path
            changed += path.read_bytes() != (tree / path.relative_to(by_test / where)).read_bytes()
    return changed


# ---------------------------------------------------------------- the Envoy configs the project ships


def is_envoy_config(path: Path) -> bool:
    """An Envoy bootstrap, not Kubernetes objects (one or several documents), a kustomization
    or a JSON patch (a list)."""
    docs = list(yaml.safe_load_all(path.read_text()))
    return len(docs) == 1 and isinstance(docs[0], dict) and bool(docs[0].get("static_resources"))


# What tests/e2e/test_envoy_configs.py validates in real Envoy.
SHIPPED_ENVOY_CONFIGS = sorted(p for p in (ROOT / "envoy").rglob("*.yaml") if is_envoy_config(p))
