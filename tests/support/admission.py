"""The agent pods' admission policy (envoy/agent-pod-security/policy/) evaluated the way the API
server evaluates it, and the pods it sees: the example Deployment (envoy/agent-pod-security/
billing-agent/) after Istio's sidecar injector. Shared by tests/files/test_admission_policy.py,
which checks the policy, and tests/e2e/test_pod_routes.py, which asks it about the pods whose
routes it tries.

The policy's matchConditions, variables and validations run in the API server's order
(conditions, then variables in order, then every validation) in two CEL implementations from
PyPI that must agree: cel-expr-python (the CEL project's Python binding of its C++
implementation) and cel-python (celpy, pure Python). Both are set up with the standard library
only, no extensions, so an expression that passes here is within what Kubernetes' CEL accepts.

`injected` builds a pod the way Istio's injection template does (istio-init or, with Istio CNI,
istio-validation; istio-proxy with its securityContext, the pod's own `istio-proxy` entry merged
in), as far as the fields the policy reads go.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import lru_cache

import celpy
from cel_expr_python import cel

from tests.support.manifests import kustomize
from tests.support.stack import ROOT

POD_SECURITY_DIR = ROOT / "envoy" / "agent-pod-security"
POLICY_DIR = POD_SECURITY_DIR / "policy"
EXAMPLE_DIR = POD_SECURITY_DIR / "billing-agent"
PROXY_UID = 1337


@lru_cache(maxsize=1)
def policy_docs() -> tuple[dict, ...]:
    return tuple(kustomize(POLICY_DIR))


@lru_cache(maxsize=1)
def example_docs() -> tuple[dict, ...]:
    return tuple(kustomize(EXAMPLE_DIR))


def policy() -> dict:
    [doc] = [d for d in policy_docs() if d["kind"] == "ValidatingAdmissionPolicy"]
    return doc


def example_deployment() -> dict:
    [doc] = example_docs()
    assert doc["kind"] == "Deployment"
    return doc


# ---------------------------------------------------------------- two CEL implementations


class CelError(Exception):
    pass


# The variables Kubernetes declares for a ValidatingAdmissionPolicy's expressions, except
# `authorizer`, which the policy does not use (an expression naming an undeclared variable
# does not compile here).
DECLARED = ("object", "oldObject", "request", "params", "namespaceObject", "variables")


class CppCel:
    name = "cel-expr-python"

    def __init__(self):
        self.env = cel.NewEnv(variables={n: cel.Type.DYN for n in DECLARED})

    def compile(self, expression: str):
        program = self.env.compile(expression)

        def run(activation: dict):
            value = program.eval(data=activation)
            if value.type() == cel.Type.ERROR:
                raise CelError(f"{self.name}: {expression}: {value.value()}")
            return value.plain_value()

        return run

    def data(self, value):
        return value

    def namespace(self, values: dict):
        return values

    def plain(self, value):
        return value


class PyCel:
    name = "cel-python"

    def __init__(self):
        self.env = celpy.Environment()

    def compile(self, expression: str):
        program = self.env.program(self.env.compile(expression))

        def run(activation: dict):
            try:
                result = program.evaluate(activation)
            except celpy.CELEvalError as e:
                raise CelError(f"{self.name}: {expression}: {e}") from e
            if isinstance(result, celpy.CELEvalError):
                raise CelError(f"{self.name}: {expression}: {result}")
            return result

        return run

    def data(self, value):
        return celpy.json_to_cel(value)

    def namespace(self, values: dict):
        """`variables`: the values as this implementation produced them."""
        return celpy.celtypes.MapType({celpy.celtypes.StringType(k): v for k, v in values.items()})

    def plain(self, value):
        """celpy's values as plain Python, to compare with the other implementation's."""
        if isinstance(value, celpy.celtypes.BoolType):
            return bool(value)
        if isinstance(value, celpy.celtypes.IntType):
            return int(value)
        if isinstance(value, celpy.celtypes.StringType):
            return str(value)
        if isinstance(value, list):
            return [self.plain(v) for v in value]
        if isinstance(value, dict):
            return {self.plain(k): self.plain(v) for k, v in value.items()}
        return value


@lru_cache(maxsize=None)
def engines() -> tuple:
    return (CppCel(), PyCel())


@lru_cache(maxsize=None)
def compiled(engine_index: int, expression: str):
    return engines()[engine_index].compile(expression)


@dataclass(frozen=True)
class Outcome:
    matched: bool
    failed: tuple[str, ...] = ()


def evaluate_with(index: int, pod: dict) -> tuple[Outcome, dict]:
    """The API server's order: every matchCondition must be true; then the variables, each
    seeing those before it; then every validation, a false one failing with its message."""
    engine, spec = engines()[index], policy()["spec"]
    base = {"object": engine.data(pod), "oldObject": engine.data(None), "params": engine.data(None)}

    def run(expression: str, variables: dict):
        return compiled(index, expression)({**base, "variables": engine.namespace(variables)})

    def boolean(expression: str, variables: dict) -> bool:
        result = engine.plain(run(expression, variables))
        assert isinstance(result, bool), f"{engine.name}: {expression} gave {result!r}, not a bool"
        return result

    for condition in spec["matchConditions"]:
        if not boolean(condition["expression"], {}):
            return Outcome(False), {}
    variables: dict = {}
    for variable in spec["variables"]:
        variables[variable["name"]] = run(variable["expression"], variables)
    failed = tuple(v["message"] for v in spec["validations"] if not boolean(v["expression"], variables))
    return Outcome(True, failed), {k: engine.plain(v) for k, v in variables.items()}


def admission(pod: dict) -> Outcome:
    """What the policy decides for `pod`; both implementations must decide the same, down to
    every variable's value, and neither may fail to evaluate (the API server would then
    refuse the pod under failurePolicy Fail, without saying which rule)."""
    (outcome, variables), (other, other_variables) = (evaluate_with(i, pod) for i in range(len(engines())))
    assert outcome == other, (outcome, other)
    assert variables == other_variables, (variables, other_variables)
    return outcome


def proxy_images() -> list[str]:
    [variable] = [v for v in policy()["spec"]["variables"] if v["name"] == "proxyImages"]
    images = engines()[0].compile(variable["expression"])({})
    assert images and all(isinstance(i, str) and "/" in i for i in images), images
    return images


# ---------------------------------------------------------------- the pods admission sees


def injected(template: dict, *, cni: bool = False, native_sidecar: bool = False) -> dict:
    """The Pod that a ReplicaSet creates from `template`, after Istio's sidecar injector, as
    Istio's injection template writes it (fields the policy does not read are left out)."""
    image = proxy_images()[0]
    spec = copy.deepcopy(template["spec"])
    [override] = [c for c in spec["containers"] if c["name"] == "istio-proxy"] or [{}]
    spec["containers"] = [c for c in spec["containers"] if c["name"] != "istio-proxy"]

    annotations = template["metadata"].get("annotations", {})
    capture_args = capture_arguments(annotations)
    if cni:
        capture = {"name": "istio-validation", "image": image, "args": capture_args + ["--run-validation", "--skip-rule-apply"],
                   "securityContext": {"allowPrivilegeEscalation": False, "privileged": False,
                                       "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": True,
                                       "runAsGroup": PROXY_UID, "runAsUser": PROXY_UID, "runAsNonRoot": True}}
    else:
        capture = {"name": "istio-init", "image": image, "args": capture_args,
                   "securityContext": {"allowPrivilegeEscalation": False, "privileged": False,
                                       "capabilities": {"add": ["NET_ADMIN", "NET_RAW"], "drop": ["ALL"]},
                                       "readOnlyRootFilesystem": False,
                                       "runAsGroup": 0, "runAsUser": 0, "runAsNonRoot": False}}
    proxy = {
        "name": "istio-proxy", "image": image,
        "args": ["proxy", "sidecar", "--domain", "$(POD_NAMESPACE).svc.cluster.local",
                 "--proxyLogLevel=warning", "--proxyComponentLogLevel=misc:error", "--log_output_level=default:info"],
        "env": [{"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                {"name": "ISTIO_META_APP_CONTAINERS", "value": ",".join(c["name"] for c in spec["containers"])}]
        + override.get("env", []),
        "ports": [{"containerPort": 15090, "name": "http-envoy-prom", "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/healthz/ready", "port": 15021}, "periodSeconds": 15},
        "securityContext": {"allowPrivilegeEscalation": False, "privileged": False,
                            "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": True,
                            "runAsGroup": PROXY_UID, "runAsNonRoot": True, "runAsUser": PROXY_UID},
        "volumeMounts": [{"mountPath": "/var/run/secrets/workload-spiffe-uds", "name": "workload-socket"},
                         {"mountPath": "/var/run/secrets/istio", "name": "istiod-ca-cert"},
                         {"mountPath": "/var/lib/istio/data", "name": "istio-data"},
                         {"mountPath": "/etc/istio/proxy", "name": "istio-envoy"},
                         {"mountPath": "/var/run/secrets/tokens", "name": "istio-token"},
                         {"mountPath": "/etc/istio/pod", "name": "istio-podinfo"}],
    }
    # A pod's own istio-proxy entry overrides the template's fields; its env is merged above,
    # and `image: auto` leaves the template's image.
    for key, value in override.items():
        if key != "env" and not (key == "image" and value == "auto"):
            proxy[key] = value
    spec["initContainers"] = [capture] + spec.get("initContainers", [])
    if native_sidecar:
        spec["initContainers"].append({**proxy, "restartPolicy": "Always"})
    else:
        spec["containers"].append(proxy)
    spec["volumes"] = spec.get("volumes", []) + [
        {"name": "workload-socket", "emptyDir": {}},
        {"name": "istio-envoy", "emptyDir": {"medium": "Memory"}},
        {"name": "istio-data", "emptyDir": {}},
        {"name": "istio-podinfo", "downwardAPI": {"items": [
            {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
            {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}}]}},
        {"name": "istio-token", "projected": {"sources": [
            {"serviceAccountToken": {"audience": "istio-ca", "expirationSeconds": 43200, "path": "istio-token"}}]}},
        {"name": "istiod-ca-cert", "configMap": {"name": "istio-ca-root-cert"}},
    ]
    metadata = copy.deepcopy(template["metadata"])
    metadata["annotations"] = {**metadata.get("annotations", {}), "sidecar.istio.io/status": '{"revision":"default"}'}
    if cni:
        # With Istio CNI the injector also writes the capture settings as annotations, which
        # the CNI plugin reads from the pod (the template's `pilot.cni.enabled` block).
        metadata["annotations"] = {**cni_annotations(annotations), **metadata["annotations"]}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "billing-agent-6f7c9d5b8-x2kqz", "namespace": "agents", **metadata}, "spec": spec}


# The annotations the injection template reads for istio-init's arguments, each to its flag,
# written only when the pod sets it (Istio source,
# manifests/charts/istio-control/istio-discovery/files/injection-template.yaml).
OPTIONAL_CAPTURE_FLAGS = (("traffic.sidecar.istio.io/includeOutboundPorts", "-q"),
                          ("traffic.sidecar.istio.io/excludeOutboundPorts", "-o"),
                          ("istio.io/reroute-virtual-interfaces", "-k"),
                          ("traffic.sidecar.istio.io/excludeInterfaces", "-c"))


def capture_arguments(annotations: dict) -> list[str]:
    """istio-init's arguments as the injection template writes them for a pod with these
    annotations, under the mesh's defaults (proxyListenPort 15001, no mesh-wide ranges or ports)."""
    excluded_inbound = ",".join(p for p in ["15020", annotations.get("traffic.sidecar.istio.io/excludeInboundPorts", "")] if p)
    args = ["istio-iptables", "-p", "15001", "-z", "15006", "-u", str(PROXY_UID),
            "-m", annotations.get("sidecar.istio.io/interceptionMode", "REDIRECT"),
            "-i", annotations.get("traffic.sidecar.istio.io/includeOutboundIPRanges", "*"),
            "-x", annotations.get("traffic.sidecar.istio.io/excludeOutboundIPRanges", ""),
            "-b", annotations.get("traffic.sidecar.istio.io/includeInboundPorts", "*"),
            "-d", f"15090,15021,{excluded_inbound}"]
    for annotation, flag in OPTIONAL_CAPTURE_FLAGS:
        if annotation in annotations:
            args += [flag, annotations[annotation]]
    return args + ["--log_output_level=default:info"]


def cni_annotations(annotations: dict) -> dict:
    """What the template adds to a pod's annotations under Istio CNI (its `pilot.cni.enabled`
    block), before the pod's own."""
    out = {"sidecar.istio.io/interceptionMode": annotations.get("sidecar.istio.io/interceptionMode", "REDIRECT"),
           "traffic.sidecar.istio.io/includeOutboundIPRanges": annotations.get(
               "traffic.sidecar.istio.io/includeOutboundIPRanges", "*"),
           "traffic.sidecar.istio.io/includeInboundPorts": annotations.get(
               "traffic.sidecar.istio.io/includeInboundPorts", "*"),
           "traffic.sidecar.istio.io/excludeInboundPorts": "15020"}
    return {**out, **annotations}


def agent_pod(annotations: dict | None = None, **kwargs) -> dict:
    """The example agent's pod after injection; `annotations` are the pod template's own, which
    the injector reads."""
    template = copy.deepcopy(example_deployment()["spec"]["template"])
    template["metadata"].setdefault("annotations", {}).update(annotations or {})
    return injected(template, **kwargs)


def agent(pod: dict) -> dict:
    [container] = [c for c in pod["spec"]["containers"] if c["name"] == "agent"]
    return container


def set_in(container: dict, **fields) -> None:
    container.setdefault("securityContext", {}).update(fields)
