"""The agent inside the test pod: sends the requests it is given and reports what came back.

Runs as an ordinary process of the pod's network namespace, under a user of its own (the test
starts it with `ip netns exec … setpriv …`), with Debian's `/usr/bin/python3` and the standard
library only, since the project's virtualenv is not readable by another user. It reads a JSON
list of probes on stdin and writes a JSON list of results on stdout, one per probe:

    {"host": "198.18.1.2", "port": 443, "tls": true, "sni": "mcp.provider.test",
     "request": "<the raw HTTP/1.1 request, as text>"}
    → {"status": 200, "headers": {...}, "body": "..."} or {"error": "ConnectionResetError: …"}

The request is sent exactly as given, so a probe can start with a bare CRLF or carry header
names a client library would refuse. TLS probes do not verify the server: an agent looking for
a way around the gateway does not care whom it talks to, only whether the tool runs.

What follows an upgrade is the agent's too:

    "websocket": "<a JSON-RPC message>"   after a 101, sent as one masked text frame (RFC 6455);
                                          the text frames that come back within the timeout,
                                          up to the first, are the result's "frames"
    "tunnel": "<a raw HTTP/1.1 request>"  after a 2xx to a CONNECT, sent through the tunnel; its
                                          answer is the result's "tunneled"

and a UDP probe sends one datagram and waits for one answer:

    {"udp": true, "host": "198.18.1.2", "port": 443, "payload": "<text>"}
    → {"answer": "<text>"} or {"error": "timeout"}
    {"dns": "mcp.provider.test", "host": "198.18.2.53", "port": 53}
    → {"answer": "198.18.1.2"} (the A record), {"answer": null} (none) or {"error": "timeout"}

The WebSocket and response helpers are imported by tests that play the agent outside a pod.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import ssl
import sys

TIMEOUT = 8.0


def _headers_only(head: bytes, connect: bool) -> bool:
    """An answer that ends at its headers: a 101 (the connection now speaks another protocol)
    or a 2xx to a CONNECT (a tunnel)."""
    parts = head.split(b"\r\n", 1)[0].split(b" ")
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    return status == 101 or (connect and 200 <= status < 300)


def read_response(sock: socket.socket, connect: bool = False) -> dict:
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            break
        if not chunk:
            break
        data += chunk
        head, sep, rest = data.partition(b"\r\n\r\n")
        if sep:
            if _headers_only(head, connect):
                break
            length = None
            chunked = False
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
                if name.strip().lower() == b"transfer-encoding" and b"chunked" in value.lower():
                    chunked = True
            if length is not None and len(rest) >= length:
                break
            if chunked and rest.endswith(b"0\r\n\r\n"):
                break
    if not data:
        return {"error": "closed without an answer"}
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        return {"error": f"not an HTTP answer: {lines[0][:80]!r}"}
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", ""):
        decoded = b""
        while body:
            size_line, _, body = body.partition(b"\r\n")
            size = int(size_line.split(b";")[0] or b"0", 16)
            if size == 0:
                break
            decoded += body[:size]
            body = body[size + 2:]
        body = decoded
    return {"status": int(parts[1]), "headers": headers, "body": body.decode("utf-8", "replace")}


def websocket_key() -> str:
    return base64.b64encode(os.urandom(16)).decode()


def websocket_frame(text: str) -> bytes:
    """One masked text frame, as a client sends it (RFC 6455 §5.2), FIN set."""
    payload = text.encode("utf-8")
    mask = os.urandom(4)
    if len(payload) < 126:
        head = bytes([0x81, 0x80 | len(payload)])
    else:
        head = bytes([0x81, 0x80 | 126]) + len(payload).to_bytes(2, "big")
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def read_frame(sock: socket.socket) -> tuple[int, bytes] | None:
    """One server frame (unmasked): its opcode and payload; None when the connection ends or
    stays silent for the timeout."""
    def exactly(n: int) -> bytes | None:
        data = b""
        while len(data) < n:
            try:
                chunk = sock.recv(n - len(data))
            except socket.timeout:
                return None
            if not chunk:
                return None
            data += chunk
        return data

    head = exactly(2)
    if head is None:
        return None
    length = head[1] & 0x7F
    if length == 126:
        more = exactly(2)
        if more is None:
            return None
        length = int.from_bytes(more, "big")
    elif length == 127:
        more = exactly(8)
        if more is None:
            return None
        length = int.from_bytes(more, "big")
    payload = exactly(length)
    return None if payload is None else (head[0] & 0x0F, payload)


def probe(p: dict) -> dict:
    if p.get("udp") or "dns" in p:
        return udp_probe(p)
    try:
        raw = socket.create_connection((p["host"], p["port"]), timeout=TIMEOUT)
    except OSError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    try:
        sock: socket.socket = raw
        if p.get("tls"):
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            sock = context.wrap_socket(raw, server_hostname=p.get("sni"))
        sock.settimeout(TIMEOUT)
        sock.sendall(p["request"].encode("utf-8"))
        connect = p["request"].lstrip().upper().startswith("CONNECT ")
        answer = read_response(sock, connect=connect)
        if p.get("websocket") is not None and answer.get("status") == 101:
            sock.sendall(websocket_frame(p["websocket"]))
            frame = read_frame(sock)
            answer["frames"] = [] if frame is None or frame[0] != 0x1 else [frame[1].decode("utf-8", "replace")]
        if p.get("tunnel") is not None and connect and 200 <= answer.get("status", 0) < 300:
            sock.sendall(p["tunnel"].encode("utf-8"))
            answer["tunneled"] = read_response(sock)
        return answer
    except OSError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        raw.close()


def dns_query(name: str) -> bytes:
    """An A query for `name` (RFC 1035 §4.1), recursion desired."""
    question = b"".join(bytes([len(label)]) + label.encode("ascii") for label in name.split(".")) + b"\0"
    return bytes.fromhex("a70101000001000000000000") + question + b"\x00\x01\x00\x01"


def dns_address(answer: bytes, query: bytes) -> str | None:
    """The first A record of an answer to `query`, as a dotted address; None without one."""
    if len(answer) < 12 or answer[:2] != query[:2] or int.from_bytes(answer[6:8], "big") == 0:
        return None
    at = len(query)
    # The answer's name is a pointer to the question's (two bytes), then type, class, TTL, length.
    record = answer[at:at + 16]
    if len(record) < 16 or record[2:4] != b"\x00\x01":
        return None
    return ".".join(str(b) for b in record[12:16])


def udp_probe(p: dict) -> dict:
    """One datagram to (host, port), and the first answer within a short wait."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.settimeout(p.get("wait", 2.0))
        payload = dns_query(p["dns"]) if "dns" in p else p["payload"].encode("utf-8")
        sock.sendto(payload, (p["host"], p["port"]))
        data, _ = sock.recvfrom(65536)
        if "dns" in p:
            return {"answer": dns_address(data, payload)}
        return {"answer": data.decode("utf-8", "replace")}
    except socket.timeout:
        return {"error": "timeout"}
    except OSError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        sock.close()


def main() -> None:
    probes = json.load(sys.stdin)
    json.dump([probe(p) for p in probes], sys.stdout)


if __name__ == "__main__":
    main()
