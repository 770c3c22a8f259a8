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
"""

from __future__ import annotations

import json
import socket
import ssl
import sys

TIMEOUT = 8.0


def read_response(sock: socket.socket) -> dict:
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


def probe(p: dict) -> dict:
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
        return read_response(sock)
    except OSError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        raw.close()


def main() -> None:
    probes = json.load(sys.stdin)
    json.dump([probe(p) for p in probes], sys.stdout)


if __name__ == "__main__":
    main()
