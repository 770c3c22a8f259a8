"""Parser differentials: the gateway must read a body exactly as every upstream will.

Go's encoding/json matches object keys to struct fields ignoring case (Unicode simple case
folding: `ſ` is `s`, the Kelvin sign is `k`) and the last match wins; Python's and
JavaScript's parsers match exactly. A body declared in another charset, or sent with a
Content-Encoding, may be decoded otherwise upstream. One corpus of such bodies goes through
the real gateway to three real upstreams (a Go encoding/json server, the Python SDK server,
the TypeScript SDK server): every one is refused with HTTP 400 before any decision, and no
upstream sees it. Positive controls show the Go server really executes what the corpus aims
at when it gets the body directly, and that well-formed calls still pass to every upstream.
"""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import uuid
from dataclasses import dataclass, field

import httpx
import pytest

from tests.support.stack import ROOT, BODY_HOLD_FORMS, Envoy, ExampleServer, GoUpstream, TsServer, go_upstream_binary

# Versions before 2026-07-28 do not mirror the method into headers, so the body alone says
# what the message is: the case a parser differential exploits.
PROTOCOL_VERSION = "2025-11-25"
PAY = '"name":"pay_invoice","arguments":{"invoice":"inv-1","amount":1}'
PAY_BIG = '"name":"pay_invoice","arguments":{"invoice":"inv-1","amount":99999}'


def _call(params: str, after: str = "") -> bytes:
    """A tools/call with `params`; `after` follows them, so a shadowing member comes last and
    wins where the last match wins."""
    return ('{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{' + params + "}" + after + "}").encode()


@dataclass
class Case:
    name: str
    body: bytes
    headers: dict = field(default_factory=dict)
    # JSON-RPC code of the gateway's refusal.
    code: int = -32700
    # The body names its idempotency key in params._meta, so none goes in the header.
    meta_key: bool = False


SHADOWED_METHOD = b'{"jsonrpc":"2.0","id":1,"method":"tools/list","Method":"tools/call","params":{' + PAY.encode() + b"}}"

CORPUS = [
    # A message the gateway reads as tools/list and a Go upstream runs as tools/call.
    Case("method/Method", SHADOWED_METHOD),
    Case("method/METHOD", b'{"jsonrpc":"2.0","id":1,"method":"tools/list","METHOD":"tools/call","params":{'
         + PAY.encode() + b"}}"),
    Case("method/Method in a batch", b"[" + SHADOWED_METHOD + b"]"),
    Case("id/ID", b'{"jsonrpc":"2.0","id":1,"ID":2,"method":"tools/call","params":{' + PAY.encode() + b"}}"),
    # Another tool's slot spent, or a call governed as echo run as pay_invoice.
    Case("params/Params", _call('"name":"echo","arguments":{"text":"hi"}', ',"Params":{' + PAY_BIG + "}")),
    Case("params/paramſ (U+017F)", _call('"name":"echo","arguments":{"text":"hi"}',
                                         ',"param\u017f":{' + PAY_BIG + "}")),
    Case("name/Name", _call('"name":"echo","Name":"pay_invoice","arguments":{"text":"hi","invoice":"inv-1","amount":1}')),
    Case("name/NAME", _call('"name":"echo","NAME":"pay_invoice","arguments":{"text":"hi","invoice":"inv-1","amount":1}')),
    # Cost rules and fingerprints read one set of arguments, the tool another.
    Case("arguments/ARGUMENTS", _call(PAY + ',"ARGUMENTS":{"invoice":"inv-1","amount":99999}')),
    Case("arguments/argumentſ (escaped U+017F)",
         _call(PAY + ',"argument\\u017f":{"invoice":"inv-1","amount":99999}')),
    Case("amount/Amount", _call('"name":"pay_invoice","arguments":{"invoice":"inv-1","amount":1,"Amount":99999}')),
    Case("amount/AMOUNT", _call('"name":"pay_invoice","arguments":{"invoice":"inv-1","amount":1,"AMOUNT":99999}')),
    Case("kind/Kelvin-sign kind (nested)",
         _call('"name":"pay_invoice","arguments":{"invoice":"inv-1","amount":1,"options":{"kind":"a","\u212aind":"b"}}')),
    Case("sku/SKU in an array", _call('"name":"pay_invoice","arguments":{"invoice":"inv-1","amount":1,'
                                       '"lines":[{"sku":"a","SKU":"b"}]}')),
    # The idempotency key: one read by the gateway, another by the upstream.
    Case("_meta/_META", _call(PAY + ',"_meta":{"dev.atmost/idempotency-key":"k-a"},'
                                    '"_META":{"dev.atmost/idempotency-key":"k-b"}'), meta_key=True),
    Case("_meta/_Meta", _call(PAY + ',"_meta":{"dev.atmost/idempotency-key":"k-a"},'
                                    '"_Meta":{"dev.atmost/idempotency-key":"k-b"}'), meta_key=True),
    Case("idempotency-key/Kelvin-sign key in _meta",
         _call(PAY + ',"_meta":{"dev.atmost/idempotency-key":"k-a","dev.atmost/idempotency-\u212aey":"k-b"}'),
         meta_key=True),
    # A lone member in another case: no twin to collide with, but the gateway (matching
    # exactly) and a Go upstream (folding) still read different messages.
    Case("lone Method beside result", b'{"jsonrpc":"2.0","id":1,"result":{},"Method":"tools/call","params":{'
         + PAY.encode() + b"}}", code=-32600),
    Case("lone METHOD in a batch", b'[{"jsonrpc":"2.0","id":1,"METHOD":"tools/call","params":{'
         + PAY.encode() + b"}}]", code=-32600),
    Case("lone ARGUMENTS", _call('"name":"pay_invoice","ARGUMENTS":{"invoice":"inv-1","amount":99999}'),
         code=-32600),
    Case("lone Name", _call('"Name":"pay_invoice","arguments":{"invoice":"inv-1","amount":1}'), code=-32600),
    # Another charset: in UTF-7, `+AG0-ethod` is `method`.
    Case("charset=utf-7", b'{"jsonrpc":"2.0","id":1,"method":"tools/list","+AG0-ethod":"tools/call","params":{'
         + PAY.encode() + b"}}", {"content-type": "application/json; charset=utf-7"}, code=-32600),
    Case("charset=utf-16", _call(PAY), {"content-type": "application/json; charset=utf-16"}, code=-32600),
    Case("charset=ISO-8859-1", _call(PAY), {"content-type": "application/json;charset=ISO-8859-1"}, code=-32600),
    Case("charset twice", _call(PAY), {"content-type": "application/json; charset=utf-8; charset=utf-7"},
         code=-32600),
    # A Content-Encoding the gateway does not decode.
    Case("content-encoding gzip, plain body", _call(PAY), {"content-encoding": "gzip"}, code=-32600),
    Case("content-encoding br, plain body", _call(PAY), {"content-encoding": "br"}, code=-32600),
    Case("content-encoding identity, gzip", _call(PAY), {"content-encoding": "identity, gzip"}, code=-32600),
    Case("content-encoding gzip, gzipped body", gzip.compress(_call(PAY), mtime=0), {"content-encoding": "gzip"},
         code=-32600),
]


class Upstream:
    """What one upstream has seen, in one shape: every message it ran, and tools/call per tool."""

    def __init__(self, kind: str, server):
        self.kind = kind
        self.server = server

    def seen(self):
        """(body bytes received, what ran, POSTs received): the first two equal before and after a
        request mean nothing of it arrived but perhaps its start; the third, not even that."""
        if self.kind == "go":
            log = self.server.log()
            return (log["body_bytes"], [(e["method"], e.get("tool"), e.get("amount")) for e in log["entries"]],
                    log["requests"])
        if self.kind == "python":
            state = self.server.state()
            return (sum(q["body_bytes"] for q in state["requests"]), sorted(state["executions"].items()),
                    len(state["requests"]))
        state = json.loads(httpx.get(self.server.url + "/_example/state").text)
        return (state["body_bytes"], sorted(state["executions"].items()), state["requests"])

    def executions(self, tool: str) -> int:
        if self.kind == "go":
            return sum(1 for e in self.server.entries() if e["method"] == "tools/call" and e.get("tool") == tool)
        return self.server.executions(tool)


@pytest.fixture(scope="module")
def upstreams(log_dir, ledger):
    """kind → (Upstream, gateway Envoy) for the Go, Python SDK and TypeScript SDK servers."""
    servers = {
        "go": GoUpstream(log_dir, go_upstream_binary()),
        "python": ExampleServer(log_dir, json_response=True, stateless=True, name="mcp-server-py-differentials"),
        "typescript": TsServer(log_dir, json_response=True, name="mcp-server-ts-differentials"),
    }
    out, envoys = {}, []
    try:
        for kind, server in servers.items():
            server.start()
            gateway = Envoy(log_dir, server.port, [ledger.port], name=f"envoy-differentials-{kind}", concurrency=1,
                            plugin_overrides={"ledger": {"service_token": ledger.service_token}})
            envoys.append(gateway)
            gateway.start()
            out[kind] = (Upstream(kind, server), gateway)
        yield out
    finally:
        for e in envoys:
            e.stop()
        for s in servers.values():
            s.stop()


def _permit(ledger) -> dict:
    return ledger.create_permit("--tools", "pay_invoice,echo", "--max-calls", "pay_invoice=100",
                                "--max-calls", "echo=100", "--budget", "1000000", "--cost", "pay_invoice=/amount")


def _headers(token: str | None, case: Case | None = None) -> dict:
    headers = {"content-type": "application/json", "accept": "application/json, text/event-stream",
               "mcp-protocol-version": PROTOCOL_VERSION}
    if token is not None:
        headers["atmost-permit"] = token
    if case is None or not case.meta_key:
        headers["idempotency-key"] = f'"{uuid.uuid4()}"'
    return {**headers, **(case.headers if case else {})}


def _calls_decided(ledger, permit: dict) -> dict:
    shown = ledger.cli_json("permit", "show", permit["id"])
    return {tool: u.get("calls_made", u) for tool, u in (shown.get("usage") or {}).items()}


@pytest.mark.parametrize("kind", ["go", "python", "typescript"])
def test_every_hostile_body_is_refused_before_any_upstream(upstreams, ledger, kind):
    upstream, gateway = upstreams[kind]
    permit = _permit(ledger)
    through = []
    with httpx.Client(timeout=30) as http:
        for case in CORPUS:
            before = upstream.seen()
            # Fresh keys, so no case is answered as a replay of an earlier one.
            body = case.body.replace(b"k-a", str(uuid.uuid4()).encode()).replace(b"k-b", str(uuid.uuid4()).encode())
            r = http.post(gateway.url, content=body, headers=_headers(permit["token"], case))
            after = upstream.seen()
            if gateway.deployment_form in BODY_HOLD_FORMS:
                # The request's headers went first (request_hold: body): a start may arrive.
                before, after = before[:2], after[:2]
            try:
                answer = r.json()
            except ValueError:
                answer = {}
            code = (answer.get("error") or {}).get("code") if isinstance(answer, dict) else None
            if r.status_code != 400 or code != case.code or after != before:
                denied = ((answer.get("result") or {}).get("structuredContent") or {}).get("error", {}).get("code") \
                    if isinstance(answer, dict) else None
                through.append(f"{case.name}: HTTP {r.status_code} code {code} denial {denied}; "
                               f"upstream before {before}, after {after}")
    assert not through, f"{kind}: {len(through)} of {len(CORPUS)} got past the gateway:\n" + "\n".join(through)
    # The ledger decided nothing: no call was counted under the permit.
    assert not any(_calls_decided(ledger, permit).values()), ledger.cli_json("permit", "show", permit["id"])


def test_the_go_upstream_executes_what_the_corpus_aims_at(upstreams):
    """Sent straight to the Go server (no gateway), the shadowed fields win: so the corpus can fail."""
    upstream, _ = upstreams["go"]
    url = upstream.server.url + "/mcp"
    expect = {
        "method/Method": ("tools/call", "pay_invoice", 1),
        "method/Method in a batch": ("tools/call", "pay_invoice", 1),
        "params/paramſ (U+017F)": ("tools/call", "pay_invoice", 99999),
        "name/Name": ("tools/call", "pay_invoice", 1),
        "arguments/argumentſ (escaped U+017F)": ("tools/call", "pay_invoice", 99999),
        "amount/Amount": ("tools/call", "pay_invoice", 99999),
        "lone Method beside result": ("tools/call", "pay_invoice", 1),
        "lone ARGUMENTS": ("tools/call", "pay_invoice", 99999),
        "charset=utf-7": ("tools/list", None, None),
    }
    by_name = {c.name: c for c in CORPUS}
    with httpx.Client(timeout=30) as http:
        for name, want in expect.items():
            upstream.server.reset()
            r = http.post(url, content=by_name[name].body, headers={"content-type": "application/json"})
            assert r.status_code == 200, (name, r.text)
            bytes_in, ran, posts = upstream.seen()
            assert (posts, ran) == (1, [want]), name
            assert bytes_in == len(by_name[name].body), name


@pytest.mark.parametrize("kind", ["go", "python", "typescript"])
def test_well_formed_calls_still_pass_to_every_upstream(upstreams, ledger, kind):
    upstream, gateway = upstreams[kind]
    permit = _permit(ledger)
    allowed = [
        {},
        {"content-type": 'application/json; charset="UTF-8"', "content-encoding": "identity"},
        {"content-type": "application/json;charset=utf-8"},
    ]
    with httpx.Client(timeout=30) as http:
        for i, extra in enumerate(allowed, start=1):
            before = upstream.executions("pay_invoice")
            body = _call(PAY)
            r = http.post(gateway.url, content=body, headers={**_headers(permit["token"]), **extra})
            assert r.status_code == 200, (extra, r.text[:300])
            assert "isError" not in r.text or '"isError":false' in r.text.replace(" ", ""), r.text[:300]
            assert upstream.executions("pay_invoice") == before + 1, extra
    assert _calls_decided(ledger, permit).get("pay_invoice") == len(allowed), \
        ledger.cli_json("permit", "show", permit["id"])


def test_the_folding_table_agrees_with_go():
    """The filter's table (src/parse/fold_table.rs, from Unicode's CaseFolding.txt) against
    Go's unicode.SimpleFold orbits, rune by rune over all of Unicode. Where they differ the
    table may only know characters Go's Unicode version has not assigned yet."""
    table = (ROOT / "src" / "parse" / "fold_table.rs").read_text()
    pairs = re.findall(r"\(0x([0-9A-F]+), 0x([0-9A-F]+)\)", table)
    assert len(pairs) > 1000, "the table looks truncated"
    result = subprocess.run([str(go_upstream_binary()), "-fold-check"], input="\n".join(f"{a} {b}" for a, b in pairs),
                            capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(result.stdout)
    assert report["table_size"] == len(pairs)
    unexplained = [m for m in report["mismatches"] if not m["newer_unicode"]]
    assert not unexplained, f"Go {report['unicode_version']}: {unexplained[:20]}"
