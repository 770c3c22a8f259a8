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
import http from 'node:http';
import https from 'node:https';
import fs from 'node:fs';
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
      return res.end(JSON.stringify({ executions, requests, body_bytes: bodyBytes, seen }));
    }
    if (req.url === '/_example/reset' && req.method === 'POST') {
      for (const k of Object.keys(executions)) delete executions[k];
      requests = 0;
      bodyBytes = 0;
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

const listener = tlsCert
  ? https.createServer({ cert: fs.readFileSync(tlsCert), key: fs.readFileSync(tlsKey) }, handle)
  : http.createServer(handle);
listener.listen(port, host, () => console.log(`listening on ${host}:${port}${tlsCert ? ' (TLS)' : ''}`));
