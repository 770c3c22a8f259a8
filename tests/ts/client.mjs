// A TypeScript SDK client run by atmost's end-to-end tests: does what a well-behaved agent
// does against one MCP URL and prints a JSON transcript on stdout.
//
//   node client.mjs <url> [permit-token] [idempotency-key]
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';

const [url, token, key] = process.argv.slice(2);
const headers = token ? { 'atmost-permit': token } : {};
const transport = new StreamableHTTPClientTransport(new URL(url), { requestInit: { headers } });
const client = new Client({ name: 'atmost-ts-client', version: '1.0.0' });
const strip = (r) => {
  const { _meta, ...rest } = r;
  return rest;
};

await client.connect(transport);
const out = { protocolVersion: transport.protocolVersion };
out.tools = (await client.listTools()).tools.map((t) => t.name).sort();
out.echo = strip(await client.callTool({ name: 'echo', arguments: { text: 'héllo ✓' } }));
out.resources = (await client.listResources()).resources;
out.templates = (await client.listResourceTemplates()).resourceTemplates;
out.readme = strip(await client.readResource({ uri: 'atmost://example/readme' }));
out.item = strip(await client.readResource({ uri: 'atmost://example/items/widget' }));
out.prompts = (await client.listPrompts()).prompts;
out.prompt = strip(await client.getPrompt({ name: 'summarize', arguments: { topic: 'retries' } }));
const start = Date.now();
const progress = [];
out.count = strip(await client.callTool({ name: 'slow_count', arguments: { n: 3, delay_ms: 400 } }, undefined, {
  onprogress: (p) => progress.push({ progress: p.progress, total: p.total, at: Date.now() - start }),
}));
out.countMs = Date.now() - start;
out.progress = progress;
if (key) {
  // A thrown SDK error is recorded too (the SDK validates structuredContent against a tool's
  // outputSchema even on isError results).
  const pay = (k) => client.callTool({ name: 'pay_invoice', arguments: { invoice: 'ts-1', amount: 5 },
    _meta: { 'dev.atmost/idempotency-key': k } }).catch((e) => ({ thrown: String(e.message) }));
  out.pay = [await pay(key), await pay(key), await pay(`${key}-other`)];
}
await client.close();
process.stdout.write(JSON.stringify(out));
