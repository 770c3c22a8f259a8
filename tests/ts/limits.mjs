// A TypeScript SDK client that reads what its permit still allows, as an agent planning its
// calls would: the figures under each tool's _meta in tools/list, and under _meta of each
// tools/call result (or error.data of an error answer). Prints a JSON transcript on stdout.
//
//   node limits.mjs <url> <permit-token> <idempotency-key>
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';

const FIGURES = 'dev.atmost/permit';
const [url, token, key] = process.argv.slice(2);
const transport = new StreamableHTTPClientTransport(new URL(url), {
  requestInit: { headers: { 'atmost-permit': token } },
});
const client = new Client({ name: 'atmost-ts-limits', version: '1.0.0' });

const listed = async () => Object.fromEntries(
  (await client.listTools()).tools.map((t) => [t.name, t._meta?.[FIGURES] ?? null]));

const pay = (k, amount) => client.callTool({
  name: 'pay_invoice',
  arguments: { invoice: `ts-${k}`, amount },
  _meta: { 'dev.atmost/idempotency-key': k },
}).then((r) => ({
  isError: r.isError ?? false,
  replayed: r._meta?.['dev.atmost/replayed'] ?? false,
  figures: r._meta?.[FIGURES] ?? null,
  code: r.structuredContent?.error?.code ?? null,
})).catch((e) => ({ thrown: String(e.message), code: e.data?.code ?? null, figures: e.data?.[FIGURES] ?? null }));

await client.connect(transport);
const out = { before: await listed() };
out.calls = [await pay(key, 100), await pay(key, 100), await pay(`${key}-2`, 150), await pay(`${key}-3`, 1)];
out.after = await listed();
await client.close();
process.stdout.write(JSON.stringify(out));
