// An MCP upstream that speaks HTTP/2 without TLS (prior knowledge, h2c), on Node's built-in
// http2 module, for atmost's fault tests. Over HTTP/2 an upstream can reset one stream
// (RST_STREAM) and keep its connection: Envoy reports that as UR. Over HTTP/1 a reset can only
// cut the connection, which Envoy reports as UC.
//
//   node h2_upstream.mjs --port 8300 [--reset TOOL]... [--sse-trailers TOOL]...
//
// Every tools/call is recorded before anything else happens (its side effect has happened):
// one line on standard output, {"execution": {n, nonce, tool, arguments, upstream_key, id}}.
// A call to a tool named by --reset then has its stream reset (INTERNAL_ERROR) without an
// answer; any other tools/call is answered "<tool> executed #<n> nonce=<nonce>". Other
// messages get an empty result, anything off POST /mcp a 404. Listens on 127.0.0.1 only;
// prints {"listening": port} once it does.
//
// A call to a tool named by --sse-trailers is answered as an SSE stream that ends with HTTP
// trailers (`x-upstream-status: done`): a progress notification and the first part of the
// answer's event in one write, the rest of that event in a second write 100 ms later, so the
// answer's event reaches the proxy split over DATA frames, none of which ends the stream.
// With `arguments.unfinished` true the answer's event never gets its closing blank line.
// Every byte of the stream is printed once it is sent: {"sse_sent": {id, stream}}.
import crypto from 'node:crypto';
import http2 from 'node:http2';

const args = process.argv.slice(2);
const port = Number(args[args.indexOf('--port') + 1]);
const named = (flag) => new Set(args.flatMap((a, i) => (a === flag ? [args[i + 1]] : [])));
const resetTools = named('--reset');
const sseTrailerTools = named('--sse-trailers');
let executed = 0;

function answer(stream, status, body) {
  stream.respond({ ':status': status, 'content-type': 'application/json' });
  stream.end(JSON.stringify(body));
}

function answerSseWithTrailers(stream, id, result, unfinished) {
  const progress = { jsonrpc: '2.0', method: 'notifications/progress', params: { progressToken: 1, progress: 1 } };
  const event = `event: message\ndata: ${JSON.stringify({ jsonrpc: '2.0', id, result })}\n${unfinished ? '' : '\n'}`;
  const cut = Math.floor(event.length / 2);
  const writes = [`event: message\ndata: ${JSON.stringify(progress)}\n\n${event.slice(0, cut)}`, event.slice(cut)];
  stream.respond({ ':status': 200, 'content-type': 'text/event-stream' }, { waitForTrailers: true });
  stream.on('wantTrailers', () => stream.sendTrailers({ 'x-upstream-status': 'done' }));
  stream.write(writes[0]);
  setTimeout(() => {
    stream.end(writes[1]);
    process.stdout.write(`${JSON.stringify({ sse_sent: { id, stream: writes.join('') } })}\n`);
  }, 100);
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
    if (sseTrailerTools.has(params.name)) {
      const result = { content: [{ type: 'text', text }], isError: false };
      answerSseWithTrailers(stream, msg.id, result, params.arguments?.unfinished === true);
      return;
    }
    answer(stream, 200, { jsonrpc: '2.0', id: msg.id, result: { content: [{ type: 'text', text }], isError: false } });
  });
});
server.listen(port, '127.0.0.1', () => process.stdout.write(`${JSON.stringify({ listening: port })}\n`));
