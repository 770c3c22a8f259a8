"""Example MCP server for atmost demos and end-to-end tests.

Built on the Python MCP SDK (`mcp` on PyPI). Tools:
- `pay_invoice(invoice: str, amount: int)`: stands in for a paid side effect. Its result
  text says how many times it has really executed so far, as `executions=N`.
- `echo(text: str)`: returns the text.
- `slow_count(n: int, delay_ms: int)`: counts to n, sending a progress notification (when the
  client asked for progress) and sleeping `delay_ms` before each step; returns `counted n`
  (`executions["slow_count_finished"]` counts the calls that returned).
- `approve_payment(invoice: str, amount: int)`: asks the user to approve before "paying": on
  MCP 2026-07-28 it answers `input_required` (an elicitation) and finishes on the client's
  continuation; on older versions it sends `elicitation/create` mid-call. `executions=N`
  counts real payments.
- `pause_stream(text: str)`: (with `--event-store`) closes its POST SSE stream early, waits,
  and answers on the stream the client resumes with GET + Last-Event-ID.
- `lookup_payment(idempotency_key: str)`: the provider's payment lookup, as a reconciler asks
  it: `structuredContent: {"status": "executed"}` when a `pay_invoice` call carrying that
  `Idempotency-Key` header ran here, else `{"status": "not_found"}`.
Resources: `atmost://example/readme` (text) and the template `atmost://example/items/{item}`.
Prompt: `summarize(topic: str)`.

Besides `/mcp`, it serves a small inspection surface for tests and demos:
- `GET /_example/state`: executions per tool and the headers (and body size) of the last requests seen.
- `POST /_example/config`: `{"pay_delay_ms": N}` makes `pay_invoice` take N ms;
  `{"lookup_mode": M}` makes `lookup_payment` answer as usual (`answer`), fail (`error`:
  `isError`), stall for `lookup_delay_ms` (`slow`), wait until the mode changes again, at
  most 30 s (`hold`: lookups seen started, then all answered at once), answer a status it does not document
  (`unknown`: `pending`) or leave the status out (`missing`).
- `POST /_example/reset`: zeroes the counters and forgets the seen requests.

Options besides `--host` / `--port`: `--json-response`, `--stateless`, `--event-store` (see
`--help`), and `--tls-cert FILE --tls-key FILE` (always together): serve HTTPS instead of
plain HTTP, with the PEM certificate chain in the first file and its private key in the
second. It then stands for a provider outside the mesh that a gateway reaches over TLS
(envoy/atmost-external-provider.yaml); the inspection routes above are served over HTTPS too.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json

import itertools

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.streamable_http import EventStore
from mcp.server.transport_security import TransportSecuritySettings
from mcp_types import CallToolResult, ElicitRequest, ElicitRequestFormParams, InputRequiredResult, TextContent
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse

SEEN_LIMIT = 200

executions: collections.Counter[str] = collections.Counter()
seen_requests: collections.deque[dict] = collections.deque(maxlen=SEEN_LIMIT)
DEFAULT_SETTINGS = {"pay_delay_ms": 0, "pause_ms": 500, "lookup_mode": "answer", "lookup_delay_ms": 5000}
LOOKUP_MODES = ("answer", "error", "slow", "hold", "unknown", "missing")
settings = dict(DEFAULT_SETTINGS)
# The Idempotency-Key header of each pay_invoice call that ran: what lookup_payment searches.
paid_keys: set[str] = set()

server = MCPServer("atmost-example", version="1.0.0")


@server.tool()
async def pay_invoice(invoice: str, amount: int, ctx: Context) -> str:
    """Pay an invoice (a stand-in for a paid, non-repeatable side effect)."""
    executions["pay_invoice"] += 1
    request = ctx.request_context.request
    key = request.headers.get("idempotency-key") if request is not None else None
    if key:
        paid_keys.add(key)
    count = executions["pay_invoice"]
    if settings["pay_delay_ms"]:
        await asyncio.sleep(settings["pay_delay_ms"] / 1000)
    return f"paid invoice {invoice} amount={amount} executions={count}"


@server.tool()
async def lookup_payment(idempotency_key: str) -> CallToolResult:
    """Look a payment up by the Idempotency-Key its pay_invoice call carried."""
    executions["lookup_payment"] += 1
    mode = settings["lookup_mode"]
    if mode == "error":
        return CallToolResult(content=[TextContent(type="text", text="payments search is down")], is_error=True)
    if mode == "slow":
        await asyncio.sleep(settings["lookup_delay_ms"] / 1000)
    for _ in range(600):
        if settings["lookup_mode"] != "hold":
            break
        await asyncio.sleep(0.05)
    mode = settings["lookup_mode"]
    status = "executed" if idempotency_key in paid_keys else "not_found"
    answer: dict = {"idempotency_key": idempotency_key}
    if mode == "unknown":
        answer["status"] = "pending"
    elif mode != "missing":
        answer["status"] = status
    return CallToolResult(content=[TextContent(type="text", text=json.dumps(answer))], structured_content=answer)


@server.tool()
async def echo(text: str) -> str:
    """Return the text unchanged."""
    executions["echo"] += 1
    return text


@server.tool()
async def slow_count(n: int, delay_ms: int, ctx: Context) -> str:
    """Count to n slowly, reporting progress at each step."""
    executions["slow_count"] += 1
    for i in range(1, n + 1):
        await asyncio.sleep(delay_ms / 1000)
        await ctx.report_progress(i, n, f"step {i}")
    # Lets a client tell a progress notification sent mid-call from one held back to the end.
    executions["slow_count_finished"] += 1
    return f"counted {n}"


class Approval(BaseModel):
    approve: bool


APPROVAL_SCHEMA = {"type": "object", "properties": {"approve": {"type": "boolean"}}, "required": ["approve"]}


@server.tool()
async def approve_payment(invoice: str, amount: int, ctx: Context) -> str | InputRequiredResult:
    """Pay an invoice after the user approves it."""
    if (ctx.protocol_version or "") >= "2026-07-28":
        answer = (ctx.input_responses or {}).get("approval")
        if answer is None:
            executions["approve_payment_asked"] += 1
            return InputRequiredResult(
                input_requests={"approval": ElicitRequest(params=ElicitRequestFormParams(
                    message=f"Pay {amount} for {invoice}?", requested_schema=APPROVAL_SCHEMA))},
                request_state=f"approve:{invoice}",
            )
        approved = getattr(answer, "action", None) == "accept" and bool((answer.content or {}).get("approve"))
    else:
        executions["approve_payment_asked"] += 1
        result = await ctx.elicit(f"Pay {amount} for {invoice}?", Approval)
        approved = result.action == "accept" and result.data.approve
    if not approved:
        return f"not approved: invoice {invoice}"
    executions["approve_payment"] += 1
    return f"paid invoice {invoice} amount={amount} approved executions={executions['approve_payment']}"


@server.tool()
async def pause_stream(text: str, ctx: Context) -> str:
    """Close this call's SSE stream early, then answer on the resumed stream."""
    executions["pause_stream"] += 1
    await ctx.report_progress(1, 2, "before the pause")
    await ctx.close_sse_stream()
    await asyncio.sleep(settings["pause_ms"] / 1000)
    return f"resumed: {text}"


@server.resource("atmost://example/readme", mime_type="text/plain")
def readme() -> str:
    """What this example server is."""
    return "atmost example server: pay_invoice, echo, slow_count, approve_payment, pause_stream, lookup_payment"


@server.resource("atmost://example/items/{item}", mime_type="application/json")
def item(item: str) -> str:
    """One item, as JSON."""
    return json.dumps({"item": item, "price": len(item) * 100})


@server.prompt()
def summarize(topic: str) -> str:
    """Ask for a short summary of a topic."""
    return f"Summarize {topic} in three sentences."


class MemoryEventStore(EventStore):
    """Keeps every SSE event in memory so a client can resume a stream (tests and demos only)."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._events: list[tuple[str, str, object]] = []

    async def store_event(self, stream_id, message):
        event_id = f"ev-{next(self._ids)}"
        self._events.append((event_id, stream_id, message))
        return event_id

    async def replay_events_after(self, last_event_id, send_callback):
        from mcp.server.streamable_http import EventMessage

        index = next((i for i, e in enumerate(self._events) if e[0] == last_event_id), None)
        if index is None:
            return None
        stream_id = self._events[index][1]
        for event_id, sid, message in self._events[index + 1:]:
            if sid == stream_id and message is not None:
                await send_callback(EventMessage(message, event_id))
        return stream_id


@server.custom_route("/_example/state", methods=["GET"])
async def state(_: Request) -> JSONResponse:
    return JSONResponse({"executions": dict(executions), "requests": list(seen_requests)})


@server.custom_route("/_example/config", methods=["POST"])
async def configure(request: Request) -> JSONResponse:
    body = await request.json()
    for name in ("pay_delay_ms", "pause_ms", "lookup_delay_ms"):
        if name in body:
            settings[name] = int(body[name])
    if "lookup_mode" in body:
        if body["lookup_mode"] not in LOOKUP_MODES:
            return JSONResponse({"error": f"lookup_mode must be one of {', '.join(LOOKUP_MODES)}"}, status_code=400)
        settings["lookup_mode"] = body["lookup_mode"]
    return JSONResponse(settings)


@server.custom_route("/_example/reset", methods=["POST"])
async def reset(_: Request) -> JSONResponse:
    executions.clear()
    seen_requests.clear()
    paid_keys.clear()
    settings.update(DEFAULT_SETTINGS)
    return JSONResponse({"ok": True})


class RecordRequests:
    """ASGI middleware: remembers method, path, headers, body size and JSON-RPC method of each MCP request."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/mcp"):
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []

        entry = {
            "method": scope["method"],
            "path": scope["path"],
            "headers": {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]},
            # Body bytes received so far: a request whose body never came stays at 0.
            "body_bytes": 0,
        }

        async def recording_receive():
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                entry["body_bytes"] += len(chunks[-1])
            return message

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
    parser.add_argument("--event-store", action="store_true",
                        help="keep SSE events in memory so clients can resume streams (enables pause_stream)")
    parser.add_argument("--tls-cert", metavar="FILE", help="serve HTTPS with this PEM certificate (chain); needs --tls-key")
    parser.add_argument("--tls-key", metavar="FILE", help="the PEM private key of --tls-cert")
    args = parser.parse_args()
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")

    import uvicorn

    app = server.streamable_http_app(
        json_response=args.json_response,
        stateless_http=args.stateless,
        event_store=MemoryEventStore() if args.event_store else None,
        retry_interval=100 if args.event_store else None,
        # The gateway in front rewrites nothing about Host; demo and tests run on loopback only.
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        host=args.host,
    )
    uvicorn.run(RecordRequests(app), host=args.host, port=args.port, log_level="warning",
                ssl_certfile=args.tls_cert, ssl_keyfile=args.tls_key)


if __name__ == "__main__":
    main()
