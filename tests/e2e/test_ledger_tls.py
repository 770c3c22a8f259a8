"""What an agent container in the standalone sidecar's pod can read of the filter's callouts.

A pod is one network namespace: the agent, Envoy with envoy/atmost-sidecar.yaml (its embedded
addresses: 127.0.0.1:10000, the ledger at 127.0.0.1:8081) and the ledger share its loopback. A
container holding CAP_NET_RAW (in the default capability set of common container runtimes) can
capture that loopback. Here a network namespace the test creates stands for the pod; tcpdump
runs in it as UID 1000 with CAP_NET_RAW and nothing else, as such an agent would, while one
governed call goes through the sidecar and its outcome is reported. The capture is then
searched for the two secrets a forged `released` report needs:

- the service token the test gave the ledger and Envoy (random, so found only if it leaked), in
  each form an HTTP/2 header block may carry it: as sent, and HPACK's Huffman code of the
  `authorization` value;
- the round's capability, which the test never sees: the ledger stores only its SHA-256, so
  every 64-hex-digit run of the captured bytes is hashed and compared with the stored hash (and
  the JSON member `"capability":"` itself is looked for).

With the shipped file (TLS the sidecar verifies) neither is found, though the capture holds the
callouts (their ClientHello names the ledger). With its cleartext form, the control, both are.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import ssl
import struct
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH

from tests.support.stack import (
    EXAMPLE_SERVER,
    VENV_BIN,
    Ledger,
    LedgerTls,
    Process,
    default_ledger_tls,
    ledger_binary,
    make_ledger_tls,
    sidecar_config,
    wait_until,
)

AGENT_UID = 1000
# The shipped file's own addresses: nothing else listens in the test's namespace.
SIDECAR = yaml.safe_load((Path(__file__).resolve().parents[2] / "envoy" / "atmost-sidecar.yaml").read_text())
LISTEN_PORT = SIDECAR["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
ADMIN_PORT = SIDECAR["admin"]["address"]["socket_address"]["port_value"]
CLUSTERS = {c["name"]: c for c in SIDECAR["static_resources"]["clusters"]}


def cluster_port(name: str) -> int:
    return CLUSTERS[name]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
        "socket_address"]["port_value"]


LEDGER_PORT = cluster_port("atmost_ledger")
# The ledger's admin listener, as `atmost ledger` has it by default (8082, beside 8081).
LEDGER_ADMIN_PORT = 8082
UPSTREAM_PORT = cluster_port("mcp_upstream")
LEDGER_NAME = CLUSTERS["atmost_ledger"]["transport_socket"]["typed_config"]["sni"]


def run(argv: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, **kw)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


class Pod:
    """One network namespace with only its loopback: what the containers of a pod share."""

    def __init__(self, name: str):
        self.name = name

    def create(self) -> None:
        self.destroy()
        run(["ip", "netns", "add", self.name])
        run(["ip", "-n", self.name, "link", "set", "lo", "up"])

    def destroy(self) -> None:
        run(["ip", "netns", "del", self.name], check=False)

    def argv(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def agent_argv(self, argv: list[str], caps: tuple[str, ...]) -> list[str]:
        """`argv` as the agent's container runs it: UID 1000, no capability but `caps`."""
        keep = "".join(f",+{c}" for c in caps)
        ambient = [f"--ambient-caps={keep[1:]}"] if caps else []
        return self.argv(["setpriv", f"--reuid={AGENT_UID}", f"--regid={AGENT_UID}", "--clear-groups",
                          f"--inh-caps=-all{keep}", *ambient, f"--bounding-set=-all{keep}", *argv])

    def curl(self, *args: str) -> subprocess.CompletedProcess:
        return run(self.argv(["curl", "-sS", "--max-time", "10", *args]), check=False)


@dataclass
class Captured:
    """The captured bytes: the pcap file as written, and each TCP connection's payload in one
    direction, in order (so a secret split over two segments is still found)."""

    raw: bytes
    streams: list[bytes]

    def contains(self, needle: bytes) -> bool:
        return needle in self.raw or any(needle in s for s in self.streams)

    def hex_runs_hashing_to(self, sha256_hex: str, length: int = 64) -> list[str]:
        found = []
        for blob in (self.raw, *self.streams):
            for m in re.finditer(rb"(?=([0-9a-f]{%d}))" % length, blob):
                candidate = m.group(1)
                if hashlib.sha256(candidate).hexdigest() == sha256_hex:
                    found.append(candidate.decode())
        return found


def tcp_streams(pcap: bytes) -> list[bytes]:
    """The TCP payloads of a pcap file (Ethernet, as tcpdump writes a Linux loopback capture, or
    Linux cooked), joined per (source, destination) in capture order."""
    magic = pcap[:4]
    endian = "<" if magic in (b"\xd4\xc3\xb2\xa1", b"\x4d\x3c\xb2\xa1") else ">"
    linktype = struct.unpack(endian + "I", pcap[20:24])[0]
    flows: dict[tuple, bytearray] = {}
    offset = 24
    while offset + 16 <= len(pcap):
        incl_len = struct.unpack(endian + "I", pcap[offset + 8:offset + 12])[0]
        frame = pcap[offset + 16:offset + 16 + incl_len]
        offset += 16 + incl_len
        if linktype == 1:
            ethertype, ip = struct.unpack(">H", frame[12:14])[0], frame[14:]
        elif linktype == 113:
            ethertype, ip = struct.unpack(">H", frame[14:16])[0], frame[16:]
        else:
            raise AssertionError(f"unexpected link type {linktype} in the capture")
        if ethertype == 0x0800:
            header_len, proto = (ip[0] & 0x0F) * 4, ip[9]
            total = struct.unpack(">H", ip[2:4])[0]
            src, dst, segment = ip[12:16], ip[16:20], ip[header_len:total]
        elif ethertype == 0x86DD:
            proto, src, dst, segment = ip[6], ip[8:24], ip[24:40], ip[40:]
        else:
            continue
        if proto != 6 or len(segment) < 20:
            continue
        ports = segment[0:4]
        payload = segment[(segment[12] >> 4) * 4:]
        if payload:
            flows.setdefault((src, dst, ports), bytearray()).extend(payload)
    return [bytes(v) for v in flows.values()]


def stored_capability_hashes(data_dir: Path) -> list[str]:
    conn = sqlite3.connect(f"file:{data_dir / 'atmost.sqlite3'}?mode=ro", uri=True, timeout=10)
    try:
        return [row[0] for row in conn.execute("SELECT capability_hash FROM attempts WHERE capability_hash IS NOT NULL")]
    finally:
        conn.close()


@dataclass
class CallCaptured:
    captured: Captured
    service_token: str
    capability_hashes: list[str]
    answer: str


def huffman(value: bytes) -> bytes:
    return HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH).encode(value)


def capture_a_governed_call(log_dir: Path, tag: str, tls: bool) -> CallCaptured:
    """Starts the pod (ledger, example MCP server, Envoy with the shipped sidecar file or its
    cleartext form), captures its loopback's ledger port as the agent while one governed call
    goes through and its outcome is reported, and takes everything down again."""
    pod = Pod(f"atmost-tls-{tag}-{os.getpid() % 100000}")
    work = Path(tempfile.mkdtemp(prefix=f"atmost-tls-{tag}-"))
    os.chmod(work, 0o755)
    capture_dir = work / "agent"
    capture_dir.mkdir()
    os.chown(capture_dir, AGENT_UID, AGENT_UID)
    pcap = capture_dir / "ledger-port.pcap"
    data_dir = work / "ledger-data"
    service_token = f"svc-{uuid.uuid4().hex}"
    admin_token = f"adm-{uuid.uuid4().hex}"
    ledger_tls = default_ledger_tls() if tls else None
    started: list[Process] = []
    tcpdump: subprocess.Popen | None = None
    tcpdump_log = log_dir / f"tcpdump-{tag}.log"
    pod.create()
    try:
        # The agent's capture, on from before the first callout: an HTTP/2 connection sends a
        # header in full only the first time, then may name it by its index. Immediate mode:
        # each packet is written as it comes, not when a kernel buffer block is handed over.
        with open(tcpdump_log, "wb") as log:
            tcpdump = subprocess.Popen(
                pod.agent_argv(["tcpdump", "-p", "-n", "-i", "lo", "-s", "0", "--immediate-mode", "-U", "-w", str(pcap),
                                "tcp", "port", str(LEDGER_PORT)], caps=("net_raw",)),
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(lambda: tcpdump.poll() is None and b"listening on lo" in tcpdump_log.read_bytes(), 20,
                   f"tcpdump in the pod (log: {tcpdump_log})")

        ledger_argv = [str(ledger_binary()), "ledger", "--listen", f"127.0.0.1:{LEDGER_PORT}",
                       "--admin-listen", f"127.0.0.1:{LEDGER_ADMIN_PORT}", "--data-dir", str(data_dir)]
        if ledger_tls:
            ledger_argv += ["--tls-cert-file", str(ledger_tls.cert), "--tls-key-file", str(ledger_tls.key)]
        ledger = Process(f"ledger-{tag}", pod.argv(ledger_argv), log_dir, env={
            "ATMOST_SERVICE_TOKEN": service_token, "ATMOST_ADMIN_TOKEN": admin_token, "ATMOST_DRAIN_DELAY": "0s"})
        ledger.start()
        started.append(ledger)
        ledger_url = f"{'https' if ledger_tls else 'http'}://127.0.0.1:{LEDGER_PORT}"
        admin_url = f"{'https' if ledger_tls else 'http'}://127.0.0.1:{LEDGER_ADMIN_PORT}"
        ca_args = ["--cacert", str(ledger_tls.ca)] if ledger_tls else []

        ledger.wait_started(
            lambda: pod.curl(*ca_args, "-o", "/dev/null", "-w", "%{http_code}", ledger_url + "/readyz").stdout == "200",
            30, "the ledger in the pod")

        server = Process(f"mcp-server-{tag}", pod.argv([str(VENV_BIN / "python"), str(EXAMPLE_SERVER), "--port",
                                                         str(UPSTREAM_PORT), "--json-response", "--stateless"]),
                         log_dir)
        server.start()
        started.append(server)
        server.wait_started(lambda: pod.curl(f"http://127.0.0.1:{UPSTREAM_PORT}/_example/state").returncode == 0,
                            30, "the MCP server in the pod")

        # The shipped file with only the filter's path and the CA file made absolute (or, for the
        # control, its cleartext form); its secrets come from Envoy's environment as shipped.
        config = sidecar_config(LISTEN_PORT, ADMIN_PORT, UPSTREAM_PORT, [LEDGER_PORT], secrets_from_env=True,
                                deployment_form="envoyfilter", ledger_tls=ledger_tls or False)
        config_path = work / "envoy.yaml"
        config_path.write_text(yaml.safe_dump(config))
        envoy = Process(f"envoy-{tag}", pod.argv([str(VENV_BIN / "envoy"), "-c", str(config_path), "--concurrency", "1",
                                                  "--use-dynamic-base-id", "-l", "info"]), log_dir,
                        env={"ATMOST_SERVICE_TOKEN": service_token,
                             "ATMOST_UPSTREAM_KEY_SECRET": "tls-capture-upstream-key-secret"})
        envoy.start()
        started.append(envoy)
        admin = f"http://127.0.0.1:{ADMIN_PORT}"

        envoy.wait_started(lambda: f"atmost_ledger::127.0.0.1:{LEDGER_PORT}::health_flags::healthy"
                           in pod.curl(admin + "/clusters").stdout, 30, "Envoy in the pod to see the ledger healthy")

        cli = [str(ledger_binary()), "--ledger", admin_url, "--json"]
        cli_env = {**os.environ, "ATMOST_ADMIN_TOKEN": admin_token}
        if ledger_tls:
            cli_env["ATMOST_LEDGER_CA_FILE"] = str(ledger_tls.ca)
        permit = json.loads(run(pod.argv([*cli, "permit", "create", "--label", "tls-capture", "--expires", "1h"]),
                                env=cli_env).stdout)
        call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                "params": {"name": "pay_invoice", "arguments": {"invoice": f"INV-{tag}", "amount": 250}}}
        answer = pod.curl("-i", f"http://127.0.0.1:{LISTEN_PORT}/mcp", "-H", "content-type: application/json",
                          "-H", "accept: application/json, text/event-stream", "-H", f"atmost-permit: {permit['token']}",
                          "-H", f'idempotency-key: "tls-capture-{tag}"', "-d", json.dumps(call)).stdout

        def completed() -> bool:
            listed = json.loads(run(pod.argv([*cli, "attempts", "list", "--permit", permit["id"]]), env=cli_env).stdout)
            return [a["state"] for a in listed["attempts"]] == ["completed"]

        # The outcome report carries the capability back: wait, bounded, until the ledger has it.
        wait_until(completed, 20, f"the call's outcome to be reported (its answer: {answer[:1500]})")
        capability_hashes = stored_capability_hashes(data_dir)
        # A last connection to the ledger's port with a mark in clear bytes (over TLS, a request
        # that fails its handshake): once the capture file holds it, it holds every packet
        # before it, the callouts and the outcome report among them.
        mark = f"capture-mark-{uuid.uuid4().hex}"
        pod.curl("-o", "/dev/null", f"http://127.0.0.1:{LEDGER_PORT}/{mark}")
        wait_until(lambda: mark.encode() in pcap.read_bytes(), 20, f"the capture to reach the mark (log: {tcpdump_log})")
    finally:
        for p in reversed(started):
            p.stop()
        if tcpdump is not None and tcpdump.poll() is None:
            os.killpg(tcpdump.pid, signal.SIGINT)
            try:
                tcpdump.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(tcpdump.pid, signal.SIGKILL)
                tcpdump.wait(timeout=10)
        pod.destroy()
    raw = pcap.read_bytes()
    shutil.rmtree(work, ignore_errors=True)
    return CallCaptured(Captured(raw, tcp_streams(raw)), service_token, capability_hashes, answer)


def token_forms(service_token: str) -> list[bytes]:
    """The service token as a capture may hold it: as sent, and the Huffman-coded value of the
    `authorization` header in an HTTP/2 header block."""
    return [service_token.encode(), huffman(f"Bearer {service_token}".encode())]


@pytest.fixture(scope="module")
def captured_tls(log_dir) -> CallCaptured:
    return capture_a_governed_call(log_dir, "tls", tls=True)


@pytest.fixture(scope="module")
def captured_cleartext(log_dir) -> CallCaptured:
    return capture_a_governed_call(log_dir, "clear", tls=False)


def check_the_call_went_through(c: CallCaptured) -> None:
    head = c.answer.split("\r\n\r\n", 1)[0].lower()
    assert head.startswith("http/1.1 200"), c.answer[:2000]
    assert "atmost-denial" not in head, c.answer[:2000]
    assert len(c.capability_hashes) == 1, c.capability_hashes


def test_the_agent_reads_neither_the_token_nor_the_capability_off_the_shipped_sidecars_callouts(captured_tls):
    c = captured_tls
    check_the_call_went_through(c)
    # The capture does hold the callouts: their ClientHello names the ledger in clear.
    assert c.captured.contains(LEDGER_NAME.encode()), "the capture holds no connection to the ledger"
    assert len(c.captured.raw) > 4096, len(c.captured.raw)
    for form in token_forms(c.service_token):
        assert not c.captured.contains(form), f"the service token is readable in the capture ({form!r})"
    assert not c.captured.hex_runs_hashing_to(c.capability_hashes[0]), "the round's capability is readable"
    assert not c.captured.contains(b'"capability":"')


def test_with_the_cleartext_form_the_same_capture_reads_both(captured_cleartext):
    """The control: the same capture of the same call through the file without its TLS finds the
    token and the capability, so the test above can fail."""
    c = captured_cleartext
    check_the_call_went_through(c)
    assert any(c.captured.contains(form) for form in token_forms(c.service_token)), \
        "the service token was not found in the cleartext capture"
    assert c.captured.contains(b'"capability":"')
    found = c.captured.hex_runs_hashing_to(c.capability_hashes[0])
    assert found, "the round's capability was not found in the cleartext capture"


def test_without_net_raw_the_agent_cannot_capture(tmp_path):
    """What dropping NET_RAW from the agent's container takes away: the same capture, refused."""
    pod = Pod(f"atmost-tls-noraw-{os.getpid() % 100000}")
    pod.create()
    try:
        result = subprocess.run(pod.agent_argv(["tcpdump", "-p", "-n", "-i", "lo", "-c", "1", "-w", "/dev/null"],
                                               caps=()),
                                capture_output=True, text=True, timeout=30)
    finally:
        pod.destroy()
    assert result.returncode != 0
    assert "Operation not permitted" in result.stderr, result.stderr


def served_certificate(port: int, context: ssl.SSLContext) -> bytes:
    """The certificate a new TLS connection to the ledger gets (DER)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="atmost-ledger") as tls:
            return tls.getpeercert(binary_form=True)


def metric(ledger: Ledger, line_start: str) -> float | None:
    for line in ledger.metrics().splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    return None


def test_a_renewed_certificate_is_served_without_a_restart_and_a_broken_one_leaves_it(log_dir, tmp_path):
    """The ledger reads its certificate files again when they change: a new pair is what the
    next connection gets, on both its ports; a pair that does not load is logged and counted,
    and the previous one stays served."""
    first = make_ledger_tls(tmp_path / "first")
    second = make_ledger_tls(tmp_path / "second")
    live = tmp_path / "live"
    live.mkdir()
    files = LedgerTls(ca=first.ca, cert=live / "ledger.pem", key=live / "ledger.key")
    shutil.copy(first.cert, files.cert)
    shutil.copy(first.key, files.key)
    ledger = Ledger(log_dir, tmp_path / "data", name="ledger-tls-reload", tls=files)
    ledger.start()
    try:
        context = ssl.create_default_context(cafile=str(first.ca))
        context.load_verify_locations(cafile=str(second.ca))
        # The test's own requests (metrics) trust either CA.
        ledger.ssl_context = context
        first_der = ssl.PEM_cert_to_DER_cert(first.cert.read_text())
        second_der = ssl.PEM_cert_to_DER_cert(second.cert.read_text())
        assert served_certificate(ledger.port, context) == first_der
        assert served_certificate(ledger.admin_port, context) == first_der

        # A renewal as a Secret volume or cert-manager does it: new files in place of the old.
        for source, target in ((second.key, files.key), (second.cert, files.cert)):
            shutil.copy(source, target.with_name(target.name + ".new"))
            os.replace(target.with_name(target.name + ".new"), target)
        wait_until(lambda: served_certificate(ledger.port, context) == second_der, 20,
                   "the renewed certificate to be served")
        assert served_certificate(ledger.admin_port, context) == second_der
        assert metric(ledger, 'atmost_tls_reloads_total{result="ok"}') >= 1

        files.cert.write_text("not a certificate\n")
        wait_until(lambda: metric(ledger, 'atmost_tls_reloads_total{result="error"}') == 1, 20,
                   "the broken certificate to be refused")
        assert metric(ledger, "atmost_tls_reload_failing") == 1
        assert served_certificate(ledger.port, context) == second_der
        assert served_certificate(ledger.admin_port, context) == second_der
        assert "TLS certificate not reloaded: the previous certificate is still served" in ledger.log_text()
        # The admin CLI still reaches it through the certificate it serves.
        ledger.tls = second
        assert ledger.cli_json("permit", "list") is not None
    finally:
        ledger.stop()
