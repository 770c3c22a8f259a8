// An MCP upstream that speaks HTTP/2 without TLS (prior knowledge, h2c), on Node's built-in
// http2 module, for atmost's fault tests. Over HTTP/2 an upstream can reset one stream
// (RST_STREAM) and keep its connection: Envoy reports that as UR. Over HTTP/1 a reset can only
// cut the connection, which Envoy reports as UC.
//
//   node h2_upstream.mjs --port 8300 [--reset TOOL]...
//
// Every tools/call is recorded before anything else happens (its side effect has happened):
// one line on standard output, {"execution": {n, nonce, tool, arguments, upstream_key, id}}.
// A call to a tool named by --reset then has its stream reset (INTERNAL_ERROR) without an
// answer; any other tools/call is answered "<tool> executed #<n> nonce=<nonce>". Other
// messages get an empty result, anything off POST /mcp a 404. Listens on 127.0.0.1 only;
// prints {"listening": port} once it does.
import crypto from 'node:crypto';
import http2 from 'node:http2';

const args = process.argv.slice(2);
const port = Number(args[args.indexOf('--port') + 1]);
const resetTools = new Set(args.flatMap((a, i) => (a === '--reset' ? [args[i + 1]] : [])));
let executed = 0;

function answer(stream, status, body) {
  stream.respond({ ':status': status, 'content-type': 'application/json' });
  stream.end(JSON.stringify(body));
}

const server = http2.createServer();
server.on('stream', (stream, headers) => {
  // Resetting a stream makes Node report an error on it: expected here, never fatal.
  stream.on('error', () => {});
  const chunks = [];
  stream.on('data', (chunk) => chunks.push(chunk));
  stream.on('end', () => {
    let msg = null;
    try {
      msg = JSON.parse(Buffer.concat(chunks).toString('utf8'));
    } catch {
      msg = null;
    }
    if (headers[':method'] !== 'POST' || headers[':path'] !== '/mcp' || !msg || typeof msg !== 'object'
        || Array.isArray(msg)) {
      answer(stream, 404, { error: 'not found' });
      return;
    }
    if (msg.method !== 'tools/call') {
      answer(stream, 200, { jsonrpc: '2.0', id: msg.id ?? null, result: {} });
      return;
    }
    const params = msg.params || {};
    executed += 1;
    const execution = {
      n: executed,
      nonce: crypto.randomBytes(6).toString('hex'),
      tool: params.name,
      arguments: params.arguments,
      upstream_key: headers['idempotency-key'] ?? null,
      id: msg.id,
    };
    process.stdout.write(`${JSON.stringify({ execution })}\n`);
    if (resetTools.has(params.name)) {
      stream.close(http2.constants.NGHTTP2_INTERNAL_ERROR);
      return;
    }
    const text = `${params.name} executed #${execution.n} nonce=${execution.nonce}`;
    answer(stream, 200, { jsonrpc: '2.0', id: msg.id, result: { content: [{ type: 'text', text }], isError: false } });
  });
});
server.listen(port, '127.0.0.1', () => process.stdout.write(`${JSON.stringify({ listening: port })}\n`));
