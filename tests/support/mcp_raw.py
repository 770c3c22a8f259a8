"""A plain HTTP MCP client for assertions on exact bytes: ids, headers, denials.

The SDK clients prove interoperability; this one lets a test see what went over the wire.
"""

from __future__ import annotations

import http.client
import itertools
import json
import socket
from urllib.parse import urlsplit

import httpx

PROTOCOL_VERSION = "2026-07-28"
KEY_META = "dev.atmost/idempotency-key"
_ids = itertools.count(1000)


class RawMcp:
    def __init__(self, url: str, permit_header: str = "atmost-permit", timeout: float = 30.0):
        self.url = url
        self.permit_header = permit_header
        # Certificates are loaded only for an https URL: loading the CA bundle costs tens of
        # milliseconds of CPU per client, and a plain-HTTP client never uses it.
        self.http = httpx.Client(timeout=timeout, verify=url.startswith("https:"))

    def close(self) -> None:
        self.http.close()

    def post(self, body, headers: dict | None = None) -> httpx.Response:
        base = {
            "content-type": "application/json",
            "accept": "application/json, text/event-stream",
            "mcp-protocol-version": PROTOCOL_VERSION,
        }
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return self.http.post(self.url, content=content, headers={**base, **(headers or {})})

    def call(self, tool: str, arguments: dict, permit: str | None, key: str | None = None,
             key_via: str = "header", request_id=None, extra_headers: dict | None = None) -> httpx.Response:
        """Sends one tools/call; the key goes in the Idempotency-Key header or in params._meta."""
        body, headers = tool_call(tool, arguments, permit, key, key_via, request_id, self.permit_header)
        return self.post(body, {**headers, **(extra_headers or {})})


def tool_call(tool: str, arguments: dict, permit: str | None, key: str | None = None, key_via: str = "header",
              request_id=None, permit_header: str = "atmost-permit") -> tuple[dict, dict]:
    """The body of one tools/call and its headers besides the base ones."""
    request_id = next(_ids) if request_id is None else request_id
    meta = {
        "io.modelcontextprotocol/protocolVersion": PROTOCOL_VERSION,
        "io.modelcontextprotocol/clientCapabilities": {},
    }
    headers = {"mcp-method": "tools/call", "mcp-name": tool}
    if permit is not None:
        headers[permit_header] = permit
    if key is not None and key_via == "header":
        headers["idempotency-key"] = f'"{key}"'
    if key is not None and key_via == "meta":
        meta[KEY_META] = key
    body = {"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
            "params": {"name": tool, "arguments": arguments, "_meta": meta}}
    return body, headers


class OpenCall:
    """One tools/call sent on a connection of its own, left open without reading the answer
    until `hang_up()`: a client that leaves mid-call, at the moment the test chooses."""

    def __init__(self, url: str, tool: str, arguments: dict, permit: str | None, key: str | None = None,
                 request_id=None):
        body, headers = tool_call(tool, arguments, permit, key, request_id=request_id)
        target = urlsplit(url)
        self.conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
        self.conn.request("POST", target.path, body=json.dumps(body), headers={
            "content-type": "application/json", "accept": "application/json, text/event-stream",
            "mcp-protocol-version": PROTOCOL_VERSION, **headers})

    def hang_up(self) -> None:
        try:
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        finally:
            self.conn.close()


def result_text(response: httpx.Response) -> str:
    body = response.json()
    return body["result"]["content"][0]["text"]


def denial(response: httpx.Response) -> dict | None:
    """The denial's error object if the response is an atmost denial (result form), else None."""
    body = response.json()
    result = body.get("result") or {}
    if result.get("isError") and isinstance(result.get("structuredContent"), dict):
        return result["structuredContent"].get("error")
    return None


def denial_code(response: httpx.Response) -> str | None:
    d = denial(response)
    return d.get("code") if d else None


def race_new_keys(url: str, token: str, tool: str, calls: int, label: str, new_key) -> list[httpx.Response]:
    """`calls` concurrent tools/call under distinct keys, each on its own connection, so the
    kernel spreads them over every Envoy worker."""
    import concurrent.futures

    def one_call(i: int) -> httpx.Response:
        c = RawMcp(url)
        try:
            return c.call(tool, {"invoice": f"{label}-{i}", "amount": 1}, token, new_key())
        finally:
            c.close()

    with concurrent.futures.ThreadPoolExecutor(max_workers=calls) as pool:
        return list(pool.map(one_call, range(calls)))


def worker_connections(envoy) -> list[int]:
    """Connections each of the two Envoy workers has accepted on the MCP listener."""
    return [envoy.stat(f"listener.127.0.0.1_{envoy.port}.worker_{w}.downstream_cx_total") for w in (0, 1)]
