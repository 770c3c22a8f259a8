// One POST over HTTP/2 without TLS (prior knowledge, h2c), on Node's built-in http2 module:
// a client that receives a response's trailers, which HTTP/1.1 clients of the suites do not.
//
//   node h2_client.mjs URL < request.json
//
// request.json: {"headers": {name: value}, "body": "..."}. Prints one JSON line once the
// response has ended: {status, headers, body, trailers} (the body as UTF-8 text, `trailers`
// null when none came).
import http2 from 'node:http2';

const url = new URL(process.argv[2]);
const input = [];
for await (const chunk of process.stdin) input.push(chunk);
const request = JSON.parse(Buffer.concat(input).toString('utf8'));

const session = http2.connect(url.origin);
session.on('error', (e) => {
  process.stderr.write(`session: ${e.message}\n`);
  process.exit(1);
});
const req = session.request({ ':method': 'POST', ':path': url.pathname, ...request.headers });
const out = { status: null, headers: {}, body: '', trailers: null };
const chunks = [];
req.on('response', (headers) => {
  out.status = headers[':status'];
  for (const [name, value] of Object.entries(headers)) if (!name.startsWith(':')) out.headers[name] = value;
});
req.on('trailers', (trailers) => {
  out.trailers = { ...trailers };
});
req.on('data', (chunk) => chunks.push(chunk));
req.on('end', () => {
  out.body = Buffer.concat(chunks).toString('utf8');
  process.stdout.write(`${JSON.stringify(out)}\n`);
  session.close();
});
req.on('error', (e) => {
  process.stderr.write(`stream: ${e.message}\n`);
  process.exit(1);
});
req.end(request.body);
