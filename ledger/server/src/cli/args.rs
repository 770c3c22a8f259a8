//! The command line as clap parses it: commands, flags and their value parsers.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::api::CreatePermitRequest;
use atmost_ledger::model::{ApprovalRule, AttemptState, CallRules, CostRule, GuardMode};
use atmost_ledger::policy::PolicySpec;

#[derive(Debug, Parser)]
#[command(
    name = "atmost",
    version,
    about = "atmost ledger and admin CLI: at most N dispatches per tool under one permit, one dispatch per idempotency key"
)]
pub struct Cli {
    #[command(flatten)]
    pub client: ClientArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum LogFormat {
    Json,
    Text,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the ledger server.
    // Boxed: its flags outweigh every admin command's, and the enum is as large as its largest.
    Ledger(Box<LedgerArgs>),
    /// Create, show, list and revoke permits (admin API).
    Permit {
        #[command(subcommand)]
        command: PermitCommand,
    },
    /// List and resolve attempts (admin API).
    Attempts {
        #[command(subcommand)]
        command: AttemptsCommand,
    },
    /// List, approve and reject calls waiting for a person's approval (admin API;
    /// docs/approvals.md).
    Approval {
        #[command(subcommand)]
        command: ApprovalCommand,
    },
    /// Register, rotate and list the tool credentials in the ledger's custody (admin API).
    Credential {
        #[command(subcommand)]
        command: CredentialCommand,
    },
    /// List and rotate the ledger's signing keys (admin API).
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
    },
    /// The reconciliation inbox's sessions (admin API).
    Inbox {
        #[command(subcommand)]
        command: InboxCommand,
    },
    /// Check the filter's plugin configuration offline.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// Named admins' tokens, for `atmost ledger --admin-tokens-file` (offline).
    AdminToken {
        #[command(subcommand)]
        command: AdminTokenCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum AdminTokenCommand {
    /// Print the tokens file's line of the admin NAME, `NAME SHA256`: the SHA-256 of the
    /// token read from standard input (one line, at least 32 bytes; `openssl rand -hex 32`
    /// makes one). The line holds no secret; give the token to the admin alone.
    Line {
        /// 1 to 64 bytes of A-Z a-z 0-9 . _ @ - (recorded as the admin's name).
        name: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Check a plugin configuration (JSON; `-` reads standard input) with the filter's own
    /// parser: prints `ok: …` and exits 0, or prints the line Envoy would log and exits 2.
    /// A gateway's configuration is also refused when the ledger's lease does not exceed
    /// `ledger.timeout_ms` plus the MCP route's timeout: a call still running when its lease
    /// ends would be recorded uncertain, and a "not executed" would no longer be safe.
    Check {
        file: std::path::PathBuf,
        /// The ledger's `--lease`.
        #[arg(long, default_value = DEFAULT_LEASE, value_parser = humantime::parse_duration)]
        lease: Duration,
        /// The timeout of the Envoy route the filter governs (the shipped configs' 120 s).
        #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
        route_timeout: Duration,
    },
}

/// The default of `atmost ledger --lease` (and of `atmost config check --lease`).
pub const DEFAULT_LEASE: &str = "300s";

#[derive(Debug, Args)]
pub struct LedgerArgs {
    /// Log format (level via RUST_LOG, default info).
    #[arg(long, value_enum, env = "ATMOST_LOG_FORMAT", default_value = "json")]
    pub log_format: LogFormat,
    /// Address of the filter's API, /v1/keys, /metrics and the health checks (HTTP/1.1 and
    /// h2c; with --tls-cert-file, TLS only). The admin API and the inbox are not served here.
    #[arg(long, env = "ATMOST_LISTEN", default_value = "127.0.0.1:8081")]
    pub listen: SocketAddr,
    /// Address of the admin API and the reconciliation inbox (`/admin/…`), a port of its own
    /// so that a network policy can open it to admins only; the same TLS as --listen. The
    /// default answers on this host only.
    #[arg(long, env = "ATMOST_ADMIN_LISTEN", default_value = "127.0.0.1:8082")]
    pub admin_listen: SocketAddr,
    /// PEM file of the certificate chain the ledger serves TLS with (its own certificate
    /// first), with --tls-key-file: --listen then takes TLS only (ALPN h2 and http/1.1). Both
    /// files are read again when they change; a pair that does not load leaves the previous
    /// one served. Without them, plain HTTP.
    #[arg(long, env = "ATMOST_TLS_CERT_FILE", requires = "tls_key_file")]
    pub tls_cert_file: Option<PathBuf>,
    /// PEM file of the private key of --tls-cert-file's certificate (PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "ATMOST_TLS_KEY_FILE", requires = "tls_cert_file")]
    pub tls_key_file: Option<PathBuf>,
    /// Directory of the embedded store's database file (`--store sqlite`).
    #[arg(long, env = "ATMOST_DATA_DIR", default_value = "./atmost-data")]
    pub data_dir: PathBuf,
    /// Where state lives: `sqlite` (default: one file under --data-dir, one ledger process) or a
    /// PostgreSQL URL `postgres://user:pass@host:5432/db?sslmode=require` (several replicas).
    #[arg(
        long,
        env = "ATMOST_STORE",
        hide_env_values = true,
        default_value = "sqlite"
    )]
    pub store: String,
    /// PostgreSQL: most connections this replica opens.
    #[arg(long, env = "ATMOST_PG_POOL_SIZE", default_value_t = 16)]
    pub pg_pool_size: usize,
    /// PostgreSQL: timeout of connecting and of waiting for a pooled connection.
    #[arg(long, env = "ATMOST_PG_CONNECT_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration)]
    pub pg_connect_timeout: Duration,
    /// PostgreSQL: timeout of one statement (lock waits included), set on the server; a whole
    /// store operation is given the connect timeout plus twice this.
    #[arg(long, env = "ATMOST_PG_STATEMENT_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration)]
    pub pg_statement_timeout: Duration,
    /// PostgreSQL: schema of the ledger's tables (created if missing; default: the server's
    /// search_path, normally `public`).
    #[arg(long, env = "ATMOST_PG_SCHEMA")]
    pub pg_schema: Option<String>,
    /// PostgreSQL: PEM file of the CA certificates to trust with `sslmode=require` (default:
    /// the system's roots).
    #[arg(long, env = "ATMOST_PG_CA_FILE")]
    pub pg_ca_file: Option<PathBuf>,
    /// PostgreSQL: decide a lone new call, and apply a lone report, with one statement on
    /// what this replica last saw of its permit (docs/postgresql.md, "One statement per
    /// decision"); `false` sends every decision and report down the locked path.
    #[arg(long, env = "ATMOST_PG_ONE_STATEMENT", default_value_t = true, action = clap::ArgAction::Set)]
    pub pg_one_statement: bool,
    /// Bearer token the filter presents on /v1/authorize and /v1/outcomes: at least 32 bytes
    /// (`openssl rand -hex 32` makes one).
    #[arg(long, env = "ATMOST_SERVICE_TOKEN", hide_env_values = true)]
    pub service_token: String,
    /// A file of named admins, one `NAME SHA256` a line (the SHA-256 of that admin's token, in
    /// lowercase hex: `atmost admin-token line NAME` makes the line); blank lines and lines
    /// starting with `#` are skipped. Each admin calls the admin API and signs in to the inbox
    /// with its own token (at least 32 bytes), under its name. Read again when it changes; a
    /// file that is refused leaves the admins read before. With --admin-token, which stays
    /// the admin named `admin`; at least one of the two is required.
    #[arg(long, env = "ATMOST_ADMIN_TOKENS_FILE")]
    pub admin_tokens_file: Option<PathBuf>,
    /// How long an in_flight attempt waits for its outcome before it turns uncertain. Keep it
    /// longer than the filter's `ledger.timeout_ms` plus the MCP route's timeout (120 s in the
    /// shipped Envoy config), or a call still running when its lease ends is recorded
    /// uncertain even if its answer then arrives.
    #[arg(long, env = "ATMOST_LEASE", default_value = DEFAULT_LEASE, value_parser = humantime::parse_duration)]
    pub lease: Duration,
    /// How long a call that needs a person's approval waits for the decision, holding its slot
    /// and cost, before it lapses (`approval_expired`); 1 s to 7 days (docs/approvals.md).
    #[arg(long, env = "ATMOST_APPROVAL_WAIT", default_value = "15m", value_parser = humantime::parse_duration)]
    pub approval_wait: Duration,
    /// How long an approval waits for the agent's retry with the same key before it lapses
    /// (`approval_expired`); 1 s to 7 days.
    #[arg(long, env = "ATMOST_APPROVAL_USE_WITHIN", default_value = "10m", value_parser = humantime::parse_duration)]
    pub approval_use_within: Duration,
    /// With --admin-identity-from: the header an authenticating proxy in front of the admin
    /// port names the signed-in person in (e.g. X-Forwarded-Email). Believed only on requests
    /// that authenticate as the admin --admin-identity-from names.
    #[arg(
        long,
        env = "ATMOST_ADMIN_IDENTITY_HEADER",
        requires = "admin_identity_from"
    )]
    pub admin_identity_header: Option<String>,
    /// With --admin-identity-header: the admin (its name in --admin-tokens-file, or `admin`)
    /// whose token the authenticating proxy holds.
    #[arg(
        long,
        env = "ATMOST_ADMIN_IDENTITY_FROM",
        requires = "admin_identity_header"
    )]
    pub admin_identity_from: Option<String>,
    /// How long the filter waits for an authorize, for a filter that does not say so in its
    /// request (a filter sends its `ledger.timeout_ms` in the `atmost-callout-timeout-ms`
    /// header; set this to it for filters older than that header). No decision is
    /// committed after its caller gave up; PostgreSQL sessions keep their statement, lock
    /// and idle-in-transaction timeouts at half of this.
    #[arg(long, env = "ATMOST_CALLOUT_TIMEOUT", default_value = "1s", value_parser = humantime::parse_duration)]
    pub callout_timeout: Duration,
    /// On SIGTERM or Ctrl-C, how long the ledger keeps serving while /readyz answers 503
    /// `draining`, so that health checks and endpoint removal move traffic elsewhere first;
    /// then it stops accepting, finishes what is in flight and exits. A second signal skips
    /// the rest of the delay; 0 stops at once.
    #[arg(long, env = "ATMOST_DRAIN_DELAY", default_value = "5s", value_parser = humantime::parse_duration)]
    pub drain_delay: Duration,
    /// How often the sweeper runs.
    #[arg(long, env = "ATMOST_SWEEP_INTERVAL", default_value = "1s", value_parser = humantime::parse_duration)]
    pub sweep_interval: Duration,
    /// How long after a permit stopped authorizing (it expired, or was revoked) the sweeper
    /// deletes its history: its settled attempts with their idempotency keys and receipts,
    /// then the permit itself once nothing is left under it. Attempts still in flight,
    /// awaiting input or uncertain stay (with their permit) until they settle. A call with a
    /// purged permit's token is denied `permit_invalid`. `off` keeps everything.
    #[arg(long, env = "ATMOST_PURGE_ENDED_PERMITS_AFTER", default_value = "30d", value_parser = purge_delay)]
    pub purge_ended_permits_after: PurgeDelay,
    /// An argument field never shown by the admin API, the CLI or the inbox: a member name
    /// (matched at any depth, ignoring ASCII case) or a JSON Pointer (`/card/number`).
    /// Repeatable; in the environment, comma separated.
    #[arg(long, env = "ATMOST_REDACT_FIELDS", value_delimiter = ',')]
    pub redact_field: Vec<String>,
    /// Reconciliation inbox (`/admin/`): how long a session lasts after sign-in.
    #[arg(long, env = "ATMOST_INBOX_SESSION_TTL", default_value = "1h", value_parser = humantime::parse_duration)]
    pub inbox_session_ttl: Duration,
    /// Reconciliation inbox: list an `awaiting_input` attempt once it has waited this long for
    /// its continuation.
    #[arg(long, env = "ATMOST_INBOX_STUCK_AFTER", default_value = "60s", value_parser = humantime::parse_duration)]
    pub inbox_stuck_after: Duration,
    /// Reconciliation inbox: mark cookies `Secure` on every response (by default only when a
    /// TLS-terminating proxy sends `X-Forwarded-Proto: https` or `Forwarded: proto=https`).
    #[arg(long, env = "ATMOST_INBOX_SECURE_COOKIES")]
    pub inbox_secure_cookies: bool,
    /// Reconciler: a JSON file of rules, each naming a tool, its provider's MCP server and a
    /// lookup tool there; uncertain attempts of those tools are looked up and resolved on a
    /// definite answer (docs/ledger.md, "The reconciler"). A bad file stops the ledger at
    /// start. Without it, nothing is looked up.
    #[arg(long, env = "ATMOST_RECONCILE_RULES")]
    pub reconcile_rules: Option<PathBuf>,
    /// How long this replica signs with the active signing key it read before reading it
    /// again, so a rotation made by another replica is picked up (its own at once).
    #[arg(long, env = "ATMOST_SIGNING_KEY_REFRESH", default_value = "5s", value_parser = humantime::parse_duration)]
    pub signing_key_refresh: Duration,
    /// The `iss` claim of the receipts `atmost attempts export` signs: a name for this ledger
    /// that auditors will recognise.
    #[arg(long, env = "ATMOST_RECEIPT_ISSUER", default_value = "atmost-ledger")]
    pub receipt_issuer: String,
    /// A file of the keys verifiers at the tool prove their refusals with (one secret of at
    /// least 32 bytes a line, as each verifier's `verify.refusal_key`): a dispatch refused
    /// at the tool gives its slot back only with a refusal one of them proves. Without it no
    /// refusal is proven, and a refused dispatch turns uncertain.
    #[arg(long, env = "ATMOST_TOOL_REFUSAL_KEYS")]
    pub tool_refusal_keys: Option<PathBuf>,
    /// Approvals: the http:// or https:// URL each new request for approval and each
    /// decision is POSTed to, as one signed JSON event (docs/approvals.md, "Webhook").
    /// Requires --approval-webhook-secret-file. Without it, nothing is sent.
    #[arg(long, env = "ATMOST_APPROVAL_WEBHOOK", hide_env_values = true)]
    pub approval_webhook: Option<String>,
    /// File holding the secret the approval webhook's events are signed with (HMAC-SHA256,
    /// header `atmost-signature`): its bytes, one trailing newline removed, at least 32
    /// (`openssl rand -hex 32` makes one).
    #[arg(long, env = "ATMOST_APPROVAL_WEBHOOK_SECRET_FILE")]
    pub approval_webhook_secret_file: Option<PathBuf>,
    /// File holding the key (64 hexadecimal digits, `openssl rand -hex 32`) that seals the
    /// tool credentials in the ledger's custody (`atmost credential set`). Every replica on one
    /// store needs the same key. Without a key the ledger keeps no credentials.
    #[arg(long, env = "ATMOST_CREDENTIAL_KEY_FILE")]
    pub credential_key_file: Option<PathBuf>,
    /// The same key given directly (prefer the file: a flag shows in the process list).
    #[arg(long, env = "ATMOST_CREDENTIAL_KEY", hide_env_values = true)]
    pub credential_key: Option<String>,
}

/// `--purge-ended-permits-after`: a delay, or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PurgeDelay {
    Off,
    After(Duration),
}

impl PurgeDelay {
    /// The delay, `None` when the purge is off.
    pub fn delay(self) -> Option<Duration> {
        match self {
            PurgeDelay::Off => None,
            PurgeDelay::After(d) => Some(d),
        }
    }
}

fn purge_delay(s: &str) -> Result<PurgeDelay, String> {
    if s == "off" {
        return Ok(PurgeDelay::Off);
    }
    humantime::parse_duration(s)
        .map(PurgeDelay::After)
        .map_err(|e| format!("{e} (a duration such as 30d or 12h, or off)"))
}

#[derive(Debug, Args)]
pub struct ClientArgs {
    /// Base URL of the ledger's admin listener (`atmost ledger --admin-listen`).
    #[arg(
        long,
        global = true,
        env = "ATMOST_LEDGER_URL",
        default_value = "http://127.0.0.1:8082"
    )]
    pub ledger: String,
    /// Admin bearer token: the admin CLI sends it; `atmost ledger` takes it as the admin named
    /// `admin` (at least 32 bytes, and not the service token), and requires it unless
    /// --admin-tokens-file is given.
    #[arg(
        long,
        global = true,
        env = "ATMOST_ADMIN_TOKEN",
        hide_env_values = true
    )]
    pub admin_token: Option<String>,
    /// PEM file of the CA certificates to trust for an https:// --ledger (default: the
    /// system's roots), e.g. the CA of the ledger's --tls-cert-file.
    #[arg(long, global = true, env = "ATMOST_LEDGER_CA_FILE")]
    pub ledger_ca_file: Option<PathBuf>,
    /// Print the API's JSON instead of text.
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum InboxCommand {
    /// The inbox's signed-in sessions.
    Sessions {
        #[command(subcommand)]
        command: SessionsCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum SessionsCommand {
    /// End inbox sessions on every replica: each person signs in again.
    Revoke {
        /// Every session (the only choice: sessions are not listed).
        #[arg(long, required = true)]
        all: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum CredentialCommand {
    /// Register a credential under NAME, or rotate it (a new version, which the next dispatch
    /// carries). The secret is read from a file or standard input, never from the command
    /// line, and is never shown again.
    Set(CredentialSetArgs),
    /// List the credentials: name, newest version, header, form, route (never the secret).
    List,
}

#[derive(Debug, Args)]
pub struct CredentialSetArgs {
    /// The name permits give (`permit create --credential NAME`): a-z, 0-9, '.', '_', '-'.
    pub name: String,
    /// The request header it goes in (`authorization`, `x-api-key`).
    #[arg(long)]
    pub header: String,
    /// `bearer` (`Bearer <secret>`) or `raw` (the secret as it is).
    #[arg(long)]
    pub form: String,
    /// An Envoy route name (`xds.route_name`) of the tool's requests (repeatable: its POST
    /// route and its GET stream's, say).
    #[arg(long, required = true)]
    pub route: Vec<String>,
    /// File holding the secret ('-' for standard input); one trailing newline is dropped.
    #[arg(long)]
    pub secret_file: PathBuf,
}

#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// List every signing key: its kid, status, when it was made, retired, and until when
    /// `/v1/keys` publishes it.
    List,
    /// Retire the active signing key now and make a new one sign; the retired key stays
    /// published until every signature it made has expired.
    Rotate,
}

#[derive(Debug, Subcommand)]
pub enum PermitCommand {
    /// Create a permit and print its token (shown once).
    // Boxed: its rules outweigh every other permit command's.
    Create(Box<CreateArgs>),
    /// Show a permit with usage per tool, budget and attempt counts.
    Show { id: String },
    /// List permits.
    List,
    /// Revoke a permit: every later call under it is denied permit_invalid.
    Revoke { id: String },
}

pub(super) fn parse_tool_n(s: &str) -> Result<(String, u64), String> {
    let (tool, n) = s
        .split_once('=')
        .ok_or_else(|| format!("expected TOOL=N, got {s:?}"))?;
    let n = n
        .trim()
        .parse::<u64>()
        .map_err(|_| format!("expected a non-negative integer in {s:?}"))?;
    Ok((tool.trim().to_string(), n))
}

pub(super) fn parse_tool_cost(s: &str) -> Result<(String, CostRule), String> {
    let (tool, rule) = s
        .split_once('=')
        .ok_or_else(|| format!("expected TOOL=N or TOOL=/json/pointer, got {s:?}"))?;
    Ok((tool.trim().to_string(), rule.trim().parse()?))
}

#[derive(Debug, Args)]
pub struct CreateArgs {
    /// Human label of the permit.
    #[arg(long)]
    pub label: String,
    /// Expiry: a duration from now (24h, 30m) or an RFC 3339 time.
    #[arg(long)]
    pub expires: String,
    /// Allowed tools, comma separated, or '*' for all (default '*').
    #[arg(long, value_delimiter = ',')]
    pub tools: Vec<String>,
    /// Cap for one tool: TOOL=N (repeatable).
    #[arg(long = "max-calls", value_parser = parse_tool_n)]
    pub max_calls: Vec<(String, u64)>,
    /// Cap for tools without their own --max-calls.
    #[arg(long)]
    pub max_calls_default: Option<u64>,
    /// Budget in integer minor units (no budget limit when omitted).
    #[arg(long)]
    pub budget: Option<u64>,
    /// Cost of one tool's call: TOOL=N or TOOL=/json/pointer into the arguments (repeatable).
    #[arg(long = "cost", value_parser = parse_tool_cost)]
    pub cost: Vec<(String, CostRule)>,
    /// Cost of tools without their own --cost (default 0).
    #[arg(long)]
    pub cost_default: Option<u64>,
    /// Same arguments under a new key: off, log (default) or enforce.
    #[arg(long, value_parser = |s: &str| s.parse::<GuardMode>())]
    pub duplicate_guard: Option<GuardMode>,
    /// How long completed receipts stay replayable (default 7d).
    #[arg(long)]
    pub retention: Option<String>,
    /// The registered credential (`atmost credential set`) the filter sets on this permit's
    /// calls; without it they carry none.
    #[arg(long)]
    pub credential: Option<String>,
    /// A person approves one tool's new calls first: TOOL=always or TOOL=cost-above:N
    /// (repeatable; docs/approvals.md).
    #[arg(long = "approval", value_parser = parse_tool_approval)]
    pub approval: Vec<(String, ApprovalRule)>,
    /// The approval rule of tools without their own --approval: always or cost-above:N.
    #[arg(long, value_parser = |s: &str| s.parse::<ApprovalRule>())]
    pub approval_default: Option<ApprovalRule>,
}

pub(super) fn parse_tool_approval(s: &str) -> Result<(String, ApprovalRule), String> {
    let (tool, rule) = s
        .split_once('=')
        .ok_or_else(|| format!("expected TOOL=always or TOOL=cost-above:N, got {s:?}"))?;
    Ok((tool.trim().to_string(), rule.trim().parse()?))
}

impl CreateArgs {
    /// The flags as the admin API's request; a flag not given leaves the API's default.
    pub fn into_request(self) -> CreatePermitRequest {
        let defaults = CallRules::default();
        CreatePermitRequest {
            label: self.label,
            expires: self.expires,
            policy: PolicySpec {
                rules: CallRules {
                    tools: if self.tools.is_empty() {
                        defaults.tools
                    } else {
                        self.tools
                    },
                    max_calls: self.max_calls.into_iter().collect(),
                    max_calls_default: self.max_calls_default,
                    budget: self.budget,
                    cost: self.cost.into_iter().collect(),
                    cost_default: self.cost_default.unwrap_or(defaults.cost_default),
                    duplicate_guard: self.duplicate_guard.unwrap_or(defaults.duplicate_guard),
                    credential: self.credential,
                    approval: self.approval.into_iter().collect(),
                    approval_default: self.approval_default,
                },
                retention: self.retention,
            },
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum AttemptsCommand {
    /// List attempts, newest first.
    List {
        /// Only this state (in_flight, completed, released, uncertain, resolved_executed, resolved_not_executed).
        #[arg(long, value_parser = |s: &str| s.parse::<AttemptState>())]
        state: Option<AttemptState>,
        /// Only this permit.
        #[arg(long)]
        permit: Option<String>,
        /// At most this many.
        #[arg(long)]
        limit: Option<u32>,
    },
    /// Show one attempt.
    Show { id: String },
    /// Print one signed receipt per attempt, one per line (a compact JWS, EdDSA, checked
    /// against `/v1/keys`), newest first; the same filters as `list`.
    Export {
        /// Only this state.
        #[arg(long, value_parser = |s: &str| s.parse::<AttemptState>())]
        state: Option<AttemptState>,
        /// Only this permit.
        #[arg(long)]
        permit: Option<String>,
        /// At most this many (default 1000).
        #[arg(long)]
        limit: Option<u32>,
    },
    /// Resolve an uncertain attempt after checking the provider.
    Resolve(ResolveArgs),
}

#[derive(Debug, Subcommand)]
pub enum ApprovalCommand {
    /// List calls in an approval state (default: waiting), oldest first.
    List {
        /// awaiting_approval (default), approved, approval_rejected or approval_expired.
        #[arg(long, value_parser = |s: &str| s.parse::<AttemptState>())]
        state: Option<AttemptState>,
        /// Only this permit.
        #[arg(long)]
        permit: Option<String>,
    },
    /// Approve a waiting call: the agent's retry with the same key sends it, once. Recorded
    /// under the admin whose token the CLI uses.
    Approve {
        /// The approval's id (its attempt's id).
        id: String,
        /// Why, for the record.
        #[arg(long)]
        note: Option<String>,
    },
    /// Reject a waiting call: nothing is sent, its slot and cost come back.
    Reject {
        /// The approval's id (its attempt's id).
        id: String,
        /// Why, for the record.
        #[arg(long)]
        note: Option<String>,
    },
}

#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("result").required(true).args(["executed", "not_executed"]))]
pub struct ResolveArgs {
    pub id: String,
    /// The provider did run the call: it keeps its slot and spends its budget.
    #[arg(long)]
    pub executed: bool,
    /// The provider did not run the call: slot and budget come back.
    #[arg(long)]
    pub not_executed: bool,
    /// File holding the provider's JSON-RPC response, replayed for the same key ('-' for stdin).
    #[arg(long, conflicts_with = "not_executed")]
    pub receipt: Option<PathBuf>,
    /// Why: what was checked, where.
    #[arg(long)]
    pub note: Option<String>,
    /// Who resolved it (default $USER, else "cli").
    #[arg(long)]
    pub by: Option<String>,
}
