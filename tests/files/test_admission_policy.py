"""The agent pods' admission policy (envoy/agent-pod-security/policy/) and the pod settings that
pass it (envoy/agent-pod-security/billing-agent/), rendered by `kubectl kustomize` and checked
two ways:

- shape: every rendered object validates against kubernetes-validate's strict Kubernetes
  schemas, for the oldest Kubernetes with ValidatingAdmissionPolicy v1 (1.30) and the newest
  the pinned package ships;
- behaviour: the policy's matchConditions, variables and validations are evaluated the way the
  API server does (conditions, then variables in order, then every validation), by two CEL
  implementations from PyPI that must agree: cel-expr-python (the CEL project's Python
  binding of its C++ implementation) and cel-python (celpy, pure Python). Both are set up
  with the standard library only, no extensions, so an expression that passes here is within
  what Kubernetes' CEL accepts (tests/support/admission.py, which tests/e2e/test_pod_routes.py
  asks too).

The pods are what admission sees: the example Deployment's pod template after Istio's sidecar
injector. `injected` builds that pod the way Istio's injection template does (istio-init or,
with Istio CNI, istio-validation; istio-proxy with its securityContext, the pod's own
`istio-proxy` entry merged in), as far as the fields the policy reads go. Each refused case
changes one thing of the admitted pod and names the validations that must refuse it, by the
words of their messages.

Reads files only: no build, no process but kubectl.
"""

from __future__ import annotations

import copy
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

from tests.support.admission import (
    EXAMPLE_DIR,
    PROXY_UID,
    Outcome,
    admission,
    agent,
    agent_pod,
    engines,
    example_deployment,
    example_docs,
    injected,
    policy,
    policy_docs,
    proxy_images,
    set_in,
)
from tests.support.manifests import AGENT_LABEL, K8S_VERSION, KUBECTL, kubernetes_errors

# ValidatingAdmissionPolicy is GA (admissionregistration.k8s.io/v1) from this release on.
OLDEST_K8S = "1.30"

# Each validation of the policy, by words of its message that no other message has.
MESSAGES = {
    "sidecar": "without Istio's injected istio-proxy",
    "capture": "without Istio's istio-init",
    "capture-annotation": "narrows Istio's outbound capture",
    "capture-args": "arguments change what Istio captures",
    "capture-env": "has an environment variable other than ISTIO_META_",
    "proxy-uid": "istio-proxy does not run as UID and GID 1337",
    "ephemeral": "with an ephemeral container",
    "proxy-volumes": "mounts one of the sidecar's volumes",
    "uid-unset": "sets no runAsUser",
    "uid-1337": "running as UID 1337",
    "gid-unset": "sets no runAsGroup",
    "gid-1337": "running with group 1337",
    "root": "may run as root",
    "privileged": "with a privileged container",
    "escalation": "allowPrivilegeEscalation is not false",
    "drop-all": "does not drop ALL",
    "cap-add": "adds capabilities",
    "share-process-namespace": "with shareProcessNamespace",
    "host-network": "with hostNetwork",
    "host-pid": "with hostPID",
    "host-ipc": "with hostIPC",
    "automount-token": "without automountServiceAccountToken false",
}


# ---------------------------------------------------------------- rendering


def binding() -> dict:
    [doc] = [d for d in policy_docs() if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    return doc


def unpatched_deployment() -> dict:
    """The team's Deployment as it is before pod-security.yaml."""
    return yaml.safe_load((EXAMPLE_DIR / "deployment.yaml").read_text())


def test_kustomizations_render_the_policy_and_the_agent():
    assert sorted(d["kind"] for d in policy_docs()) == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    assert binding()["spec"]["policyName"] == policy()["metadata"]["name"]
    assert [d["kind"] for d in example_docs()] == ["Deployment"]


@pytest.mark.parametrize("version", [OLDEST_K8S, K8S_VERSION])
def test_rendered_objects_validate_strictly(version):
    for doc in policy_docs() + example_docs():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']} for Kubernetes {version}: "
                        f"{'.'.join(map(str, e.path))}: {e.message}")


def test_the_schema_check_refuses_broken_copies():
    misspelled = copy.deepcopy(policy())
    misspelled["spec"]["validation"] = misspelled["spec"].pop("validations")
    assert any("validation" in e for e in kubernetes_errors(misspelled))

    bad_action = copy.deepcopy(binding())
    bad_action["spec"]["validationActions"] = "Deny"  # a list in the API
    assert kubernetes_errors(bad_action)

    pod_field = copy.deepcopy(example_deployment())
    pod_field["spec"]["template"]["spec"]["securityContext"]["allowPrivilegeEscalation"] = False  # container-level only
    assert any("allowPrivilegeEscalation" in e for e in kubernetes_errors(pod_field))


def test_the_binding_denies_in_every_namespace():
    """Every namespace: the ledger's NetworkPolicy admits labelled pods from any of them, and a
    labelled pod in a namespace without injection is exactly one the policy must refuse."""
    spec = binding()["spec"]
    assert spec["validationActions"] == ["Deny"]
    assert spec["matchResources"] == {"namespaceSelector": {}}
    assert policy()["spec"]["failurePolicy"] == "Fail"
    [rule] = policy()["spec"]["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["pods", "pods/ephemeralcontainers"]
    assert rule["operations"] == ["CREATE", "UPDATE"]


def test_the_patch_refuses_to_land_on_another_container(tmp_path):
    """pod-security.yaml's container entry is checked by name first: with the agent's container
    moved to index 1 the render fails instead of hardening the istio-proxy entry."""
    tree = tmp_path / "billing-agent"
    shutil.copytree(EXAMPLE_DIR, tree)
    deployment = unpatched_deployment()
    containers = deployment["spec"]["template"]["spec"]["containers"]
    containers.reverse()
    (tree / "deployment.yaml").write_text(yaml.safe_dump(deployment))
    result = subprocess.run([KUBECTL, "kustomize", str(tree)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "/spec/template/spec/containers/0/name" in result.stderr, result.stderr


# ---------------------------------------------------------------- two CEL implementations


def refused_by(outcome: Outcome) -> set[str]:
    assert outcome.matched
    keys = set()
    for message in outcome.failed:
        [key] = [k for k, words in MESSAGES.items() if words in message]
        keys.add(key)
    return keys


def test_the_implementations_have_no_extensions():
    """Kubernetes' CEL adds libraries (strings, lists, optional fields) that neither
    implementation has here; an expression that compiles in both uses none of them."""
    for engine in engines():
        for expression in ("'a,b'.split(',')", "object.?spec.orValue(1)"):
            with pytest.raises(Exception):
                engine.compile(expression)({"object": engine.data({})})


def test_every_validation_has_its_own_message():
    messages = [v["message"] for v in policy()["spec"]["validations"]]
    assert len(messages) == len(set(messages)) == len(MESSAGES)
    for key, words in MESSAGES.items():
        assert sum(words in m for m in messages) == 1, key
    for validation in policy()["spec"]["validations"]:
        # Forbidden (403) rather than the default Invalid: the pod is well-formed, just not allowed.
        assert validation["reason"] == "Forbidden"


# ---------------------------------------------------------------- the pods admission sees


def init(pod: dict, name: str) -> dict:
    [container] = [c for c in pod["spec"]["initContainers"] if c["name"] == name]
    return container


def proxy(pod: dict) -> dict:
    [container] = [c for c in pod["spec"]["containers"] if c["name"] == "istio-proxy"]
    return container


@pytest.mark.parametrize("variant", [{}, {"cni": True}, {"native_sidecar": True}],
                         ids=["istio-init", "istio-cni", "native-sidecar"])
def test_the_patched_agent_pod_is_admitted(variant):
    pod = agent_pod(**variant)
    assert kubernetes_errors(pod) == []
    assert admission(pod) == Outcome(True, ())


def test_the_unpatched_agent_pod_is_refused():
    """The Deployment as the team wrote it, without pod-security.yaml."""
    pod = injected(unpatched_deployment()["spec"]["template"])
    assert kubernetes_errors(pod) == []
    assert refused_by(admission(pod)) == {"uid-unset", "gid-unset", "root", "escalation", "drop-all",
                                          "automount-token"}


# ---------------------------------------------------------------- one change, one refusal


def pod_security(pod: dict) -> dict:
    return pod["spec"]["securityContext"]


def at_pod_level(field, value):
    """The agent's container leaves `field` to the pod, which sets it to `value`."""
    def change(pod):
        del agent(pod)["securityContext"][field]
        pod_security(pod)[field] = value
    return change


def unset(field):
    """Neither the agent's container nor the pod sets `field`."""
    def change(pod):
        del agent(pod)["securityContext"][field]
        del pod_security(pod)[field]
    return change


def add_capability(name):
    def change(pod):
        agent(pod)["securityContext"]["capabilities"]["add"] = [name]
    return change


def privileged(pod):
    # Kubernetes refuses privileged together with allowPrivilegeEscalation false, so a pod that
    # asks for it turns both on.
    set_in(agent(pod), privileged=True, allowPrivilegeEscalation=True)


def no_allow_privilege_escalation(pod):
    del agent(pod)["securityContext"]["allowPrivilegeEscalation"]


def pod_field(name, value):
    def change(pod):
        pod["spec"][name] = value
    return change


def no_automount_field(pod):
    del pod["spec"]["automountServiceAccountToken"]


def debug_container(pod):
    # What `kubectl debug -it <pod> --image=busybox --target=istio-proxy` adds.
    pod["spec"]["ephemeralContainers"] = [{"name": "debugger-7xk2p", "image": "busybox:1.36",
                                           "targetContainerName": "istio-proxy", "stdin": True, "tty": True}]


def mount_proxy_volume(name):
    def change(pod):
        agent(pod)["volumeMounts"] = [{"name": name, "mountPath": "/mnt/proxy"}]
    return change


def annotate(key, value):
    def change(pod):
        pod["metadata"]["annotations"][key] = value
    return change


def no_injection(pod):
    # `sidecar.istio.io/inject: "false"`, or a namespace without injection: the pod runs as
    # its template says, the `image: auto` entry included (which could never start).
    pod["spec"] = copy.deepcopy(example_deployment()["spec"]["template"]["spec"])


def no_capture_init(pod):
    # `sidecar.istio.io/interceptionMode: NONE`: the injector writes no istio-init.
    pod["spec"]["initContainers"] = [c for c in pod["spec"]["initContainers"] if c["name"] != "istio-init"]


def own_proxy_image(pod):
    # The pod's istio-proxy entry names an image (or `sidecar.istio.io/proxyImage` does):
    # the injector keeps it, with the template's UID 1337 and args.
    proxy(pod)["image"] = "registry.example.com/agents/billing-agent:1.0.0"


def own_proxy_command(pod):
    proxy(pod)["command"] = ["/bin/sh", "-c", "exec curl -s http://mcp-server.tools.svc.cluster.local:8000/mcp"]


def other_proxy_args(pod):
    proxy(pod)["args"] = ["request", "GET", "config_dump"]


def agent_named_istio_proxy(pod):
    # The agent's own container under the proxy's name, as UID 1337, in place of the sidecar.
    pod["spec"]["containers"] = [c for c in pod["spec"]["containers"] if c["name"] != "istio-proxy"]
    agent(pod)["name"] = "istio-proxy"
    set_in(pod["spec"]["containers"][0], runAsUser=PROXY_UID, runAsGroup=PROXY_UID)


def proxy_as_plain_init_container(pod):
    # The proxy moved to initContainers without `restartPolicy: Always`: not a native sidecar.
    [sidecar] = [c for c in pod["spec"]["containers"] if c["name"] == "istio-proxy"]
    pod["spec"]["containers"].remove(sidecar)
    pod["spec"]["initContainers"].append(sidecar)


def own_init_image(pod):
    init(pod, "istio-init")["image"] = "registry.example.com/agents/billing-agent:1.0.0"


def own_init_command(pod):
    init(pod, "istio-init")["command"] = ["/bin/sh", "-c", "iptables -t nat -F"]


def second_capture_init(pod):
    # Next to Istio CNI's istio-validation, an istio-init of the pod's own, with the proxy's
    # image and arguments that exclude the agent's UID from capture.
    pod["spec"]["initContainers"].insert(0, {
        "name": "istio-init", "image": proxy_images()[0],
        "args": ["istio-iptables", "-p", "15001", "-u", "10001", "-m", "REDIRECT", "-i", "*"],
        "securityContext": {"allowPrivilegeEscalation": False, "privileged": False,
                            "capabilities": {"add": ["NET_ADMIN", "NET_RAW"], "drop": ["ALL"]},
                            "runAsGroup": 0, "runAsUser": 0, "runAsNonRoot": False}})


def init_args(change):
    """istio-init's arguments changed as a mesh-wide setting or the pod's own istio-init entry
    would change them (the injector keeps the pod's entry, as it does the proxy's)."""
    def apply(pod):
        for container in pod["spec"]["initContainers"]:
            if container["name"] in ("istio-init", "istio-validation"):
                change(container["args"])
    return apply


def set_arg(index, value):
    def change(args):
        args[index] = value
    return change


def extra_args(*extra):
    def change(args):
        args[-1:-1] = list(extra)
    return change


def init_env(*env):
    def change(pod):
        init(pod, "istio-init")["env"] = [{"name": name, "value": value} for name, value in env]
    return change


def init_env_from(pod):
    init(pod, "istio-init")["envFrom"] = [{"configMapRef": {"name": "capture-settings"}}]


def proxy_runs_as(uid, gid=PROXY_UID):
    def change(pod):
        container = next(c for c in pod["spec"]["containers"] + pod["spec"]["initContainers"]
                         if c["name"] == "istio-proxy")
        set_in(container, runAsUser=uid, runAsGroup=gid)
    return change


def unchanged(pod):
    pass


def init_adds_sys_admin(pod):
    init(pod, "istio-init")["securityContext"]["capabilities"]["add"].append("SYS_ADMIN")


def proxy_tproxy(pod):
    # `sidecar.istio.io/interceptionMode: TPROXY`: the injector gives the proxy NET_ADMIN and root.
    set_in(proxy(pod), runAsUser=0, runAsNonRoot=False, capabilities={"add": ["NET_ADMIN"], "drop": ["ALL"]})


def proxy_escalation(pod):
    set_in(proxy(pod), allowPrivilegeEscalation=True)


def second_agent_container(**fields):
    def change(pod):
        helper = copy.deepcopy(agent(pod))
        helper["name"] = "istio-proxy-helper"
        helper["securityContext"].update(fields)
        pod["spec"]["containers"].insert(1, helper)
    return change


REFUSED = [
    ("uid-1337-pod-level", {}, at_pod_level("runAsUser", PROXY_UID), {"uid-1337"}),
    ("uid-1337-container-level", {}, lambda p: set_in(agent(p), runAsUser=PROXY_UID), {"uid-1337"}),
    ("no-run-as-user", {}, unset("runAsUser"), {"uid-unset"}),
    ("gid-1337-pod-level", {}, at_pod_level("runAsGroup", PROXY_UID), {"gid-1337"}),
    ("gid-1337-container-level", {}, lambda p: set_in(agent(p), runAsGroup=PROXY_UID), {"gid-1337"}),
    ("no-run-as-group", {}, unset("runAsGroup"), {"gid-unset"}),
    ("run-as-root", {}, lambda p: set_in(agent(p), runAsUser=0, runAsNonRoot=False), {"root"}),
    ("run-as-non-root-false", {}, lambda p: set_in(agent(p), runAsNonRoot=False), {"root"}),
    ("run-as-non-root-unset", {}, unset("runAsNonRoot"), {"root"}),
    ("add-net-admin", {}, add_capability("NET_ADMIN"), {"cap-add"}),
    ("add-net-raw", {}, add_capability("NET_RAW"), {"cap-add"}),
    ("add-sys-ptrace", {}, add_capability("SYS_PTRACE"), {"cap-add"}),
    ("drop-net-raw-only", {}, lambda p: set_in(agent(p), capabilities={"drop": ["NET_RAW"]}), {"drop-all"}),
    ("no-capabilities", {}, lambda p: agent(p)["securityContext"].pop("capabilities"), {"drop-all"}),
    ("privileged", {}, privileged, {"privileged", "escalation"}),
    ("allow-privilege-escalation-true", {}, lambda p: set_in(agent(p), allowPrivilegeEscalation=True), {"escalation"}),
    ("allow-privilege-escalation-unset", {}, no_allow_privilege_escalation, {"escalation"}),
    ("share-process-namespace", {}, pod_field("shareProcessNamespace", True), {"share-process-namespace"}),
    ("host-network", {}, pod_field("hostNetwork", True), {"host-network"}),
    ("host-pid", {}, pod_field("hostPID", True), {"host-pid"}),
    ("host-ipc", {}, pod_field("hostIPC", True), {"host-ipc"}),
    ("automount-token-true", {}, pod_field("automountServiceAccountToken", True), {"automount-token"}),
    ("automount-token-unset", {}, no_automount_field, {"automount-token"}),
    ("debug-container", {}, debug_container, {"ephemeral"}),
    ("agent-mounts-istio-envoy", {}, mount_proxy_volume("istio-envoy"), {"proxy-volumes"}),
    ("agent-mounts-workload-socket", {}, mount_proxy_volume("workload-socket"), {"proxy-volumes"}),
    ("exclude-outbound-ip-ranges", {}, annotate("traffic.sidecar.istio.io/excludeOutboundIPRanges", "10.96.0.0/12"),
     {"capture-annotation"}),
    ("exclude-outbound-ports", {}, annotate("traffic.sidecar.istio.io/excludeOutboundPorts", "8000"),
     {"capture-annotation"}),
    ("include-outbound-ip-ranges", {}, annotate("traffic.sidecar.istio.io/includeOutboundIPRanges", "10.0.0.0/24"),
     {"capture-annotation"}),
    ("exclude-interfaces", {}, annotate("traffic.sidecar.istio.io/excludeInterfaces", "eth0"), {"capture-annotation"}),
    # The same annotations on the pod template, which the injector writes into istio-init's
    # arguments too (and, with Istio CNI, istio-validation's, while CNI reads the annotation).
    *[(f"template-{name}{'-cni' if cni else ''}", {"annotations": {key: value}, "cni": cni}, unchanged,
       {"capture-annotation", "capture-args"})
      for name, key, value in [
          ("exclude-interfaces", "traffic.sidecar.istio.io/excludeInterfaces", "eth0"),
          ("exclude-outbound-ports", "traffic.sidecar.istio.io/excludeOutboundPorts", "443"),
          ("exclude-outbound-ip-ranges", "traffic.sidecar.istio.io/excludeOutboundIPRanges", "203.0.113.0/24"),
          ("include-outbound-ip-ranges", "traffic.sidecar.istio.io/includeOutboundIPRanges", "10.96.0.0/12")]
      for cni in (False, True)],
    # istio-init's own arguments, without an annotation: a mesh-wide setting, or the pod's own
    # istio-init entry.
    ("init-excluded-ports", {}, init_args(extra_args("-o", "443")), {"capture-args"}),
    ("init-excluded-interface", {}, init_args(extra_args("-c", "eth0")), {"capture-args"}),
    ("init-exempts-the-agents-uid", {}, init_args(set_arg(6, "10001")), {"capture-args"}),
    ("init-exempts-a-second-uid", {}, init_args(set_arg(6, "1337,10001")), {"capture-args"}),
    ("init-exempts-a-group", {}, init_args(extra_args("-g", "10001")), {"capture-args"}),
    ("init-uid-given-twice", {}, init_args(extra_args("-u", "10001")), {"capture-args"}),
    ("init-uid-long-form", {}, init_args(extra_args("--proxy-uid=10001")), {"capture-args"}),
    ("init-uid-attached", {}, init_args(extra_args("-u10001")), {"capture-args"}),
    ("init-captures-one-range", {}, init_args(set_arg(10, "10.96.0.0/12")), {"capture-args"}),
    ("init-captures-nothing", {}, init_args(set_arg(10, "")), {"capture-args"}),
    ("init-excluded-range", {}, init_args(set_arg(12, "0.0.0.0/1")), {"capture-args"}),
    ("init-to-the-inbound-port", {}, init_args(set_arg(2, "15006")), {"capture-args"}),
    ("init-dry-run", {}, init_args(extra_args("--dry-run")), {"capture-args"}),
    ("init-skips-its-rules", {}, init_args(extra_args("--skip-rule-apply")), {"capture-args"}),
    ("init-cleanup-only", {}, init_args(extra_args("--cleanup-only")), {"capture-args"}),
    ("init-short-args", {}, init_args(lambda args: args.__delitem__(slice(9, None))), {"capture-args"}),
    ("init-env-excluded-interfaces", {}, init_env(("ISTIO_EXCLUDE_INTERFACES", "eth0")), {"capture-env"}),
    ("init-env-excluded-groups", {}, init_env(("ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE", "10001")), {"capture-env"}),
    ("init-env-from", {}, init_env_from, {"capture-env"}),
    # Istio CNI exempts whatever user the proxy runs as.
    ("proxy-as-the-agents-uid-cni", {"cni": True}, proxy_runs_as(10001), {"proxy-uid"}),
    ("proxy-as-the-agents-gid-cni", {"cni": True}, proxy_runs_as(PROXY_UID, 10001), {"proxy-uid"}),
    ("proxy-as-the-agents-uid", {}, proxy_runs_as(10001), {"proxy-uid"}),
    ("native-proxy-as-the-agents-uid", {"native_sidecar": True}, proxy_runs_as(10001), {"proxy-uid"}),
    # Getting around the sidecar by leaving it out or by taking its place.
    # The `image: auto` entry is then a container of its own, without the settings.
    ("no-injection", {}, no_injection, {"sidecar", "capture", "escalation", "drop-all"}),
    ("no-capture-init", {}, no_capture_init, {"capture"}),
    # A container that is not the proxy gets no exemption: its UID and GID 1337 and its mounts
    # of the proxy's volumes are refused as any agent container's would be.
    ("proxy-own-image", {}, own_proxy_image, {"sidecar", "uid-1337", "gid-1337", "proxy-volumes"}),
    ("proxy-own-command", {}, own_proxy_command, {"sidecar", "uid-1337", "gid-1337", "proxy-volumes"}),
    ("proxy-other-args", {}, other_proxy_args, {"sidecar", "uid-1337", "gid-1337", "proxy-volumes"}),
    ("agent-named-istio-proxy", {}, agent_named_istio_proxy, {"sidecar", "uid-1337", "gid-1337"}),
    ("proxy-as-plain-init-container", {}, proxy_as_plain_init_container,
     {"sidecar", "uid-1337", "gid-1337", "proxy-volumes"}),
    ("second-container-as-1337", {}, second_agent_container(runAsUser=PROXY_UID), {"uid-1337"}),
    ("init-own-image", {}, own_init_image, {"capture", "root", "cap-add"}),
    ("init-own-command", {}, own_init_command, {"capture", "root", "cap-add"}),
    ("init-adds-sys-admin", {}, init_adds_sys_admin, {"cap-add"}),
    ("second-capture-init-beside-cni", {"cni": True}, second_capture_init, {"capture", "capture-args"}),
    ("proxy-tproxy", {}, proxy_tproxy, {"cap-add", "proxy-uid"}),
    ("proxy-escalation", {}, proxy_escalation, {"escalation"}),
    ("native-sidecar-own-image", {"native_sidecar": True},
     lambda p: init(p, "istio-proxy").update(image="registry.example.com/agents/billing-agent:1.0.0"),
     {"sidecar", "uid-1337", "gid-1337", "proxy-volumes"}),
]


@pytest.mark.parametrize("variant,change,expected", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_one_change_is_refused_with_its_message(variant, change, expected):
    pod = agent_pod(**variant)
    change(pod)
    assert kubernetes_errors(pod) == [], "the changed pod must still be a valid Pod"
    assert refused_by(admission(pod)) == expected


def test_every_validation_refuses_some_case():
    assert set().union(*(c[3] for c in REFUSED)) == set(MESSAGES)


def own_volume(pod):
    pod["spec"]["volumes"].append({"name": "scratch", "emptyDir": {}})
    mount_proxy_volume("scratch")(pod)


def settings_only_at_pod_level(pod):
    for field in ("runAsUser", "runAsGroup", "runAsNonRoot"):
        del agent(pod)["securityContext"][field]


ADMITTED = [
    ("include-outbound-ip-ranges-all", annotate("traffic.sidecar.istio.io/includeOutboundIPRanges", "*")),
    ("inbound-exclusion", annotate("traffic.sidecar.istio.io/excludeInboundPorts", "9090")),
    # istio-init settings that capture more, never less.
    ("init-logs-as-json", init_args(extra_args("--log_as_json"))),
    ("init-dns-capture", init_env(("ISTIO_META_DNS_CAPTURE", "true"))),
    ("second-agent-container", second_agent_container()),
    ("agent-mounts-its-own-volume", own_volume),
    ("settings-only-at-container-level", lambda p: p["spec"].pop("securityContext")),
    ("settings-only-at-pod-level", settings_only_at_pod_level),
]


@pytest.mark.parametrize("change", [c[1] for c in ADMITTED], ids=[c[0] for c in ADMITTED])
def test_changes_that_keep_the_pod_governed_are_admitted(change):
    pod = agent_pod()
    change(pod)
    assert kubernetes_errors(pod) == []
    assert admission(pod) == Outcome(True, ())


# Annotations of the pod template the injector turns into istio-init arguments that capture no
# less: more outbound ports (-q), virtual interfaces rerouted to the sidecar (-k), inbound
# settings.
TEMPLATE_ADMITTED = {"traffic.sidecar.istio.io/includeOutboundPorts": "8000",
                     "istio.io/reroute-virtual-interfaces": "tap0",
                     "traffic.sidecar.istio.io/excludeInboundPorts": "9090",
                     "traffic.sidecar.istio.io/includeOutboundIPRanges": "*"}


@pytest.mark.parametrize("variant", [{}, {"cni": True}, {"native_sidecar": True}],
                         ids=["istio-init", "istio-cni", "native-sidecar"])
@pytest.mark.parametrize("annotation", sorted(TEMPLATE_ADMITTED))
def test_template_annotations_that_capture_no_less_are_admitted(annotation, variant):
    pod = agent_pod(annotations={annotation: TEMPLATE_ADMITTED[annotation]}, **variant)
    assert kubernetes_errors(pod) == []
    assert admission(pod) == Outcome(True, ())


def test_the_injected_capture_arguments_are_the_templates():
    """Without annotations, the injector's arguments as Istio's template writes them for the mesh's
    defaults; an annotation adds its flag where the template puts it."""
    args = init(agent_pod(), "istio-init")["args"]
    assert args == ["istio-iptables", "-p", "15001", "-z", "15006", "-u", "1337", "-m", "REDIRECT", "-i", "*",
                    "-x", "", "-b", "*", "-d", "15090,15021,15020", "--log_output_level=default:info"]
    args = init(agent_pod(annotations={"traffic.sidecar.istio.io/excludeInterfaces": "eth0"}), "istio-init")["args"]
    assert args[-3:] == ["-c", "eth0", "--log_output_level=default:info"]
    cni = init(agent_pod(cni=True), "istio-validation")["args"]
    assert cni[-2:] == ["--run-validation", "--skip-rule-apply"] and cni[:17] == args[:17]


# ---------------------------------------------------------------- which pods are matched


def without_agent_label(pod):
    del pod["metadata"]["labels"][AGENT_LABEL]


@pytest.mark.parametrize("labels", [None, {}, {"app.kubernetes.io/name": "billing-agent"}],
                         ids=["no-labels", "empty-labels", "other-label"])
def test_a_pod_without_the_agent_label_is_not_matched(labels):
    """Not an agent pod: neither the filter nor the ledger's NetworkPolicy selects it, so the
    policy leaves it alone, however it is set up (here: host network, UID 1337, NET_ADMIN)."""
    pod = agent_pod()
    pod_field("hostNetwork", True)(pod)
    set_in(agent(pod), runAsUser=PROXY_UID)
    add_capability("NET_ADMIN")(pod)
    assert refused_by(admission(copy.deepcopy(pod))) == {"host-network", "uid-1337", "cap-add"}
    if labels is None:
        del pod["metadata"]["labels"]
    else:
        pod["metadata"]["labels"] = labels
    assert admission(pod) == Outcome(False)


def test_any_value_of_the_agent_label_is_matched():
    pod = agent_pod()
    pod["metadata"]["labels"][AGENT_LABEL] = ""
    assert admission(pod) == Outcome(True, ())
    pod_field("hostPID", True)(pod)
    assert refused_by(admission(pod)) == {"host-pid"}
