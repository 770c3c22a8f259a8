// A small MCP server on the TypeScript SDK (@modelcontextprotocol/sdk) for atmost's
// end-to-end interoperability tests. Same tools, resources and prompt as the Python example
// server (pay_invoice, echo, slow_count; atmost://example/readme; summarize).
//
//   node server.mjs --port 8100 [--json-response] [--host 127.0.0.1]
//                   [--tls-cert FILE --tls-key FILE] [--fail-after-call STATUS]
//
// Stateless Streamable HTTP on /mcp (a fresh server per POST); GET /_example/state reports
// executions per tool, POSTs and their body bytes received, and the headers of the latest
// POSTs (`seen`, names as Node received them: a header spelled `Idempotency_Key` shows as
// `idempotency_key`); POST /_example/reset zeroes them.
// --tls-cert/--tls-key serve HTTPS with that certificate (a provider outside the mesh).
// --fail-after-call STATUS: a tools/call still runs its tool, then the answer is replaced by
// an HTTP STATUS error, as when a server fails after the side effect (what a retry on that
// status would send a second time).
// It also speaks MCP over a WebSocket (RFC 6455) on /mcp, as some servers do: each text frame
// is one JSON-RPC message for a server of its own, whose answers go back as text frames, and
// the tools count in the same `executions`; `upgrades` in the state counts the upgrades it
// accepted. Only what an agent needs to reach a tool is implemented: unfragmented frames of up
// to 64 KiB, text, ping and close.
import http from 'node:http';
import https from 'node:https';
import fs from 'node:fs';
import crypto from 'node:crypto';
import { McpServer, ResourceTemplate } from '@modelcontextprotocol/sdk/server/mcp.js';
import { StreamableHTTPServerTransport } from '@modelcontextprotocol/sdk/server/streamableHttp.js';
import { z } from 'zod';

const args = process.argv.slice(2);
const port = Number(args[args.indexOf('--port') + 1] || 8100);
const jsonResponse = args.includes('--json-response');
const option = (name) => (args.includes(name) ? args[args.indexOf(name) + 1] : undefined);
const host = option('--host') || '127.0.0.1';
const tlsCert = option('--tls-cert');
const tlsKey = option('--tls-key');
const failAfterCall = option('--fail-after-call') ? Number(option('--fail-after-call')) : undefined;
// The headers of the latest POSTs to /mcp, newest last.
const SEEN_MAX = 50;
const seen = [];
const executions = {};
// Every POST to /mcp, read or not: a test can tell that nothing reached this server.
let requests = 0;
// Body bytes of those POSTs, counted as they arrive (a body cut short counts what came).
let bodyBytes = 0;
// WebSocket upgrades accepted on /mcp.
let upgrades = 0;
const count = (tool) => (executions[tool] = (executions[tool] || 0) + 1);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function buildServer() {
  const server = new McpServer({ name: 'atmost-example-ts', version: '1.0.0' });
  server.registerTool('pay_invoice', {
    description: 'Pay an invoice (a stand-in for a paid, non-repeatable side effect).',
    inputSchema: { invoice: z.string(), amount: z.number().int() },
  }, async ({ invoice, amount }) => {
    const n = count('pay_invoice');
    return { content: [{ type: 'text', text: `paid invoice ${invoice} amount=${amount} executions=${n}` }] };
  });
  server.registerTool('echo', {
    description: 'Return the text unchanged.',
    inputSchema: { text: z.string() },
  }, async ({ text }) => {
    count('echo');
    return { content: [{ type: 'text', text }] };
  });
  server.registerTool('slow_count', {
    description: 'Count to n slowly, reporting progress at each step.',
    inputSchema: { n: z.number().int(), delay_ms: z.number().int() },
  }, async ({ n, delay_ms }, extra) => {
    count('slow_count');
    const token = extra._meta?.progressToken;
    for (let i = 1; i <= n; i++) {
      await sleep(delay_ms);
      if (token !== undefined) {
        await extra.sendNotification({
          method: 'notifications/progress',
          params: { progressToken: token, progress: i, total: n, message: `step ${i}` },
        });
      }
    }
    return { content: [{ type: 'text', text: `counted ${n}` }] };
  });
  server.registerResource('readme', 'atmost://example/readme', { mimeType: 'text/plain', description: 'What this server is.' },
    async (uri) => ({ contents: [{ uri: uri.href, mimeType: 'text/plain', text: 'atmost example server (TypeScript SDK)' }] }));
  server.registerResource('item', new ResourceTemplate('atmost://example/items/{item}', { list: undefined }),
    { mimeType: 'application/json', description: 'One item, as JSON.' },
    async (uri, { item }) => ({
      contents: [{ uri: uri.href, mimeType: 'application/json', text: JSON.stringify({ item, price: item.length * 100 }) }],
    }));
  server.registerPrompt('summarize', { description: 'Ask for a short summary of a topic.', argsSchema: { topic: z.string() } },
    ({ topic }) => ({ messages: [{ role: 'user', content: { type: 'text', text: `Summarize ${topic} in three sentences.` } }] }));
  return server;
}

async function readBody(req) {
  const chunks = [];
  for await (const c of req) {
    chunks.push(c);
    bodyBytes += c.length;
  }
  return Buffer.concat(chunks).toString('utf8');
}

// Replaces what the SDK answers on `res` with a bare `status` error once it has run the call.
function failAfterAnswer(res, status) {
  const writeHead = res.writeHead.bind(res);
  const end = res.end.bind(res);
  res.writeHead = () => res;
  res.write = () => true;
  res.end = () => {
    writeHead(status, { 'content-type': 'text/plain' });
    return end(`failed after the call (${status})`);
  };
}

async function handle(req, res) {
  try {
    if (req.url === '/_example/state' && req.method === 'GET') {
      res.writeHead(200, { 'content-type': 'application/json' });
      return res.end(JSON.stringify({ executions, requests, body_bytes: bodyBytes, seen, upgrades }));
    }
    if (req.url === '/_example/reset' && req.method === 'POST') {
      for (const k of Object.keys(executions)) delete executions[k];
      requests = 0;
      bodyBytes = 0;
      upgrades = 0;
      seen.length = 0;
      res.writeHead(200, { 'content-type': 'application/json' });
      return res.end('{"ok":true}');
    }
    if (!req.url.startsWith('/mcp')) {
      res.writeHead(404);
      return res.end();
    }
    if (req.method !== 'POST') {
      res.writeHead(405, { allow: 'POST' });
      return res.end();
    }
    requests += 1;
    seen.push(req.headers);
    if (seen.length > SEEN_MAX) seen.shift();
    const raw = await readBody(req);
    let body;
    try {
      body = JSON.parse(raw);
    } catch {
      res.writeHead(400, { 'content-type': 'application/json' });
      return res.end(JSON.stringify({ jsonrpc: '2.0', id: null, error: { code: -32700, message: 'Parse error' } }));
    }
    const server = buildServer();
    const transport = new StreamableHTTPServerTransport({ sessionIdGenerator: undefined, enableJsonResponse: jsonResponse });
    res.on('close', () => {
      transport.close();
      server.close();
    });
    await server.connect(transport);
    if (failAfterCall !== undefined && body && body.method === 'tools/call') failAfterAnswer(res, failAfterCall);
    await transport.handleRequest(req, res, body);
  } catch (e) {
    console.error(e);
    if (!res.headersSent) {
      res.writeHead(500);
      res.end();
    }
  }
}

// One WebSocket frame from the server: FIN set, unmasked.
function frame(opcode, payload) {
  const head = payload.length < 126
    ? Buffer.from([0x80 | opcode, payload.length])
    : Buffer.from([0x80 | opcode, 126, payload.length >> 8, payload.length & 0xff]);
  return Buffer.concat([head, payload]);
}

// The SDK's Transport over one upgraded socket: a text frame in, a text frame out.
class WebSocketTransport {
  constructor(socket) {
    this.socket = socket;
    this.buffered = Buffer.alloc(0);
  }

  async start() {
    this.socket.on('data', (chunk) => this.read(chunk));
    this.socket.on('close', () => this.onclose?.());
    this.socket.on('error', (e) => this.onerror?.(e));
  }

  read(chunk) {
    this.buffered = Buffer.concat([this.buffered, chunk]);
    while (this.buffered.length >= 2) {
      const opcode = this.buffered[0] & 0x0f;
      const masked = (this.buffered[1] & 0x80) !== 0;
      let length = this.buffered[1] & 0x7f;
      let at = 2;
      if (length === 126) {
        if (this.buffered.length < 4) return;
        length = this.buffered.readUInt16BE(2);
        at = 4;
      } else if (length === 127) {
        return this.socket.destroy();
      }
      const mask = masked ? this.buffered.subarray(at, at + 4) : null;
      at += masked ? 4 : 0;
      if (this.buffered.length < at + length) return;
      const payload = Buffer.from(this.buffered.subarray(at, at + length));
      this.buffered = this.buffered.subarray(at + length);
      if (mask) for (let i = 0; i < payload.length; i++) payload[i] ^= mask[i % 4];
      if (opcode === 0x8) return this.socket.end(frame(0x8, Buffer.alloc(0)));
      if (opcode === 0x9) this.socket.write(frame(0xa, payload));
      if (opcode === 0x1) {
        try {
          this.onmessage?.(JSON.parse(payload.toString('utf8')));
        } catch (e) {
          this.onerror?.(e);
        }
      }
    }
  }

  async send(message) {
    this.socket.write(frame(0x1, Buffer.from(JSON.stringify(message), 'utf8')));
  }

  async close() {
    this.socket.end();
  }
}

async function upgrade(req, socket, head) {
  const key = req.headers['sec-websocket-key'];
  if (!req.url.startsWith('/mcp') || (req.headers.upgrade || '').toLowerCase() !== 'websocket' || !key) {
    socket.end('HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n');
    return;
  }
  upgrades += 1;
  const accept = crypto.createHash('sha1').update(key + '258EAFA5-E914-47DA-95CA-C5AB0DC85B11').digest('base64');
  socket.write('HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\n'
    + `sec-websocket-accept: ${accept}\r\n\r\n`);
  const transport = new WebSocketTransport(socket);
  const server = buildServer();
  socket.on('close', () => server.close());
  await server.connect(transport);
  if (head.length) transport.read(head);
}

const listener = tlsCert
  ? https.createServer({ cert: fs.readFileSync(tlsCert), key: fs.readFileSync(tlsKey) }, handle)
  : http.createServer(handle);
listener.on('upgrade', (req, socket, head) => upgrade(req, socket, head).catch((e) => {
  console.error(e);
  socket.destroy();
}));
listener.listen(port, host, () => console.log(`listening on ${host}:${port}${tlsCert ? ' (TLS)' : ''}`));
