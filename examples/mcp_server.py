"""Example MCP server for atmost demos and end-to-end tests.

Built on the Python MCP SDK (`mcp` on PyPI). Tools:
- `pay_invoice(invoice: str, amount: int)`: stands in for a paid side effect. Its result
  text says how many times it has really executed so far, as `executions=N`.
- `echo(text: str)`: returns the text.

Besides `/mcp`, it serves a small inspection surface for tests and demos:
- `GET /_example/state`: executions per tool and the headers of the last requests seen.
- `POST /_example/config`: `{"pay_delay_ms": N}` makes `pay_invoice` take N ms.
- `POST /_example/reset`: zeroes the counters and forgets the seen requests.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json

from mcp.server.mcpserver import MCPServer
from mcp.server.transport_security import TransportSecuritySettings
from starlette.requests import Request
from starlette.responses import JSONResponse

SEEN_LIMIT = 200

executions: collections.Counter[str] = collections.Counter()
seen_requests: collections.deque[dict] = collections.deque(maxlen=SEEN_LIMIT)
settings = {"pay_delay_ms": 0}

server = MCPServer("atmost-example", version="1.0.0")


@server.tool()
async def pay_invoice(invoice: str, amount: int) -> str:
    """Pay an invoice (a stand-in for a paid, non-repeatable side effect)."""
    executions["pay_invoice"] += 1
    count = executions["pay_invoice"]
    if settings["pay_delay_ms"]:
        await asyncio.sleep(settings["pay_delay_ms"] / 1000)
    return f"paid invoice {invoice} amount={amount} executions={count}"


@server.tool()
async def echo(text: str) -> str:
    """Return the text unchanged."""
    executions["echo"] += 1
    return text


@server.custom_route("/_example/state", methods=["GET"])
async def state(_: Request) -> JSONResponse:
    return JSONResponse({"executions": dict(executions), "requests": list(seen_requests)})


@server.custom_route("/_example/config", methods=["POST"])
async def configure(request: Request) -> JSONResponse:
    body = await request.json()
    if "pay_delay_ms" in body:
        settings["pay_delay_ms"] = int(body["pay_delay_ms"])
    return JSONResponse(settings)


@server.custom_route("/_example/reset", methods=["POST"])
async def reset(_: Request) -> JSONResponse:
    executions.clear()
    seen_requests.clear()
    settings["pay_delay_ms"] = 0
    return JSONResponse({"ok": True})


class RecordRequests:
    """ASGI middleware: remembers method, path, headers and JSON-RPC method of each MCP request."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/mcp"):
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []

        async def recording_receive():
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
            return message

        entry = {
            "method": scope["method"],
            "path": scope["path"],
            "headers": {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]},
        }
        seen_requests.append(entry)

        async def run():
            await self.app(scope, recording_receive, send)

        try:
            await run()
        finally:
            try:
                body = json.loads(b"".join(chunks) or b"null")
                entry["rpc_method"] = body.get("method") if isinstance(body, dict) else None
                entry["tool"] = (body.get("params") or {}).get("name") if isinstance(body, dict) else None
            except ValueError:
                entry["rpc_method"] = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--json-response", action="store_true", help="answer POSTs with application/json instead of SSE")
    parser.add_argument("--stateless", action="store_true", help="no Mcp-Session-Id sessions")
    args = parser.parse_args()

    import uvicorn

    app = server.streamable_http_app(
        json_response=args.json_response,
        stateless_http=args.stateless,
        # The gateway in front rewrites nothing about Host; demo and tests run on loopback only.
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        host=args.host,
    )
    uvicorn.run(RecordRequests(app), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
