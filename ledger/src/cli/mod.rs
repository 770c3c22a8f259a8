//! Command line of the `atmost` binary: the ledger server and the admin client.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use serde::de::DeserializeOwned;
use serde::Serialize;
use thiserror::Error;

use crate::api::{
    AttemptListResponse, AttemptResponse, AttemptView, CreatePermitRequest, CreatePermitResponse,
    ErrorBody, PermitListResponse, PermitResponse, PermitShowResponse, PermitView,
};
use crate::clock::SystemClock;
use crate::decide::ResolveInput;
use crate::error::LedgerError;
use crate::metrics::Metrics;
use crate::model::{AttemptState, CostRule, GuardMode};
use crate::server::{self, AppState, ServerConfig};
use crate::store::postgres::{self, PgOptions, PgStore};
use crate::store::sqlite::SqliteStore;
use crate::store::Store;

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
    Ledger(LedgerArgs),
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
    /// Check the filter's plugin configuration offline.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Check a plugin configuration (JSON; `-` reads standard input) with the filter's own
    /// parser: prints `ok: …` and exits 0, or prints the line Envoy would log and exits 2.
    Check { file: std::path::PathBuf },
}

#[derive(Debug, Args)]
pub struct LedgerArgs {
    /// Log format (level via RUST_LOG, default info).
    #[arg(long, value_enum, env = "ATMOST_LOG_FORMAT", default_value = "json")]
    pub log_format: LogFormat,
    /// Address to listen on (HTTP/1.1 and h2c).
    #[arg(long, env = "ATMOST_LISTEN", default_value = "127.0.0.1:8081")]
    pub listen: SocketAddr,
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
    /// Bearer token the filter presents on /v1/authorize and /v1/outcomes.
    #[arg(long, env = "ATMOST_SERVICE_TOKEN", hide_env_values = true)]
    pub service_token: String,
    /// How long an in_flight attempt waits for its outcome before it turns uncertain. Keep it
    /// longer than the filter's `ledger.timeout_ms` plus the MCP route's timeout (120 s in the
    /// shipped Envoy config), or a call still running when its lease ends is recorded
    /// uncertain even if its answer then arrives.
    #[arg(long, env = "ATMOST_LEASE", default_value = "300s", value_parser = humantime::parse_duration)]
    pub lease: Duration,
    /// How often the sweeper runs.
    #[arg(long, env = "ATMOST_SWEEP_INTERVAL", default_value = "1s", value_parser = humantime::parse_duration)]
    pub sweep_interval: Duration,
}

#[derive(Debug, Args)]
pub struct ClientArgs {
    /// Base URL of the ledger.
    #[arg(
        long,
        global = true,
        env = "ATMOST_LEDGER_URL",
        default_value = "http://127.0.0.1:8081"
    )]
    pub ledger: String,
    /// Admin bearer token: the admin CLI sends it; `atmost ledger` requires it (it must differ
    /// from the service token).
    #[arg(
        long,
        global = true,
        env = "ATMOST_ADMIN_TOKEN",
        hide_env_values = true
    )]
    pub admin_token: Option<String>,
    /// Print the API's JSON instead of text.
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum PermitCommand {
    /// Create a permit and print its token (shown once).
    Create(CreateArgs),
    /// Show a permit with usage per tool, budget and attempt counts.
    Show { id: String },
    /// List permits.
    List,
    /// Revoke a permit: every later call under it is denied permit_invalid.
    Revoke { id: String },
}

fn parse_tool_n(s: &str) -> Result<(String, u64), String> {
    let (tool, n) = s
        .split_once('=')
        .ok_or_else(|| format!("expected TOOL=N, got {s:?}"))?;
    let n = n
        .trim()
        .parse::<u64>()
        .map_err(|_| format!("expected a non-negative integer in {s:?}"))?;
    Ok((tool.trim().to_string(), n))
}

fn parse_tool_cost(s: &str) -> Result<(String, CostRule), String> {
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
    /// Resolve an uncertain attempt after checking the provider.
    Resolve(ResolveArgs),
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

#[derive(Debug, Error)]
pub enum CliError {
    #[error("{0}")]
    Usage(String),
    #[error("cannot reach the ledger: {0}")]
    Http(String),
    #[error("ledger answered {status}: {error}{}", message.as_deref().map(|m| format!(" ({m})")).unwrap_or_default())]
    Api {
        status: u16,
        error: String,
        message: Option<String>,
    },
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    /// A refused plugin configuration: the filter's own error line.
    #[error("{0}")]
    Config(String),
}

/// Runs the parsed command line.
pub fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Ledger(args) => {
            let admin_token = cli.client.admin_token.clone().unwrap_or_default();
            run_ledger(args, admin_token)
        }
        Command::Permit { command } => {
            run_permit(&Client::new(&cli.client)?, cli.client.json, command)
        }
        Command::Attempts { command } => {
            run_attempts(&Client::new(&cli.client)?, cli.client.json, command)
        }
        Command::Config {
            command: ConfigCommand::Check { file },
        } => match crate::config_check::check_file(&file) {
            Ok(summary) => {
                println!("{summary}");
                Ok(())
            }
            Err(line) => Err(CliError::Config(line)),
        },
    }
}

fn init_logs(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
        LogFormat::Text => builder.try_init(),
    };
}

fn run_ledger(args: LedgerArgs, admin_token: String) -> Result<(), CliError> {
    if args.service_token.trim().is_empty() || admin_token.trim().is_empty() {
        return Err(CliError::Usage(
            "--service-token (ATMOST_SERVICE_TOKEN) and --admin-token (ATMOST_ADMIN_TOKEN) are required"
                .into(),
        ));
    }
    if args.service_token == admin_token {
        return Err(CliError::Usage(
            "--admin-token must differ from --service-token".into(),
        ));
    }
    if args.lease.is_zero() {
        return Err(CliError::Usage("--lease must be positive".into()));
    }
    init_logs(args.log_format);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let store = rt.block_on(open_store(&args))?;
    let state = Arc::new(AppState {
        store,
        clock: Arc::new(SystemClock),
        config: ServerConfig {
            service_token: args.service_token,
            admin_token,
            lease: args.lease,
        },
        metrics: Arc::new(Metrics::new()?),
    });
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(args.listen).await?;
        tracing::info!(listen = %args.listen, lease_ms = state.config.lease.as_millis() as u64, "ledger listening");
        let sweeper = server::spawn_sweeper(state.clone(), args.sweep_interval);
        let app = server::router(state);
        // Callouts are small request/response pairs on long-lived connections: without
        // TCP_NODELAY, Nagle's algorithm holds a reply back until the previous one is acked.
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::warn!(error = %e, "could not set TCP_NODELAY on an accepted connection");
            }
        });
        let served = axum::serve(listener, app).with_graceful_shutdown(shutdown_signal()).await;
        sweeper.abort();
        tracing::info!("ledger stopped");
        served
    })?;
    Ok(())
}

/// Opens the store `--store` names: the embedded SQLite file, or PostgreSQL (migrations run
/// here, before the ledger listens).
async fn open_store(args: &LedgerArgs) -> Result<Arc<dyn Store>, CliError> {
    let spec = args.store.trim();
    if spec.is_empty() || spec == "sqlite" {
        let store = SqliteStore::open_dir(&args.data_dir)?;
        tracing::info!(store = "sqlite", path = %store.path().display(), "store opened");
        return Ok(Arc::new(store));
    }
    if !postgres::is_postgres_url(spec) {
        return Err(CliError::Usage(format!(
            "--store must be `sqlite` or a postgres:// / postgresql:// URL, not {}",
            postgres::redact_url(spec)
        )));
    }
    if args.pg_connect_timeout.is_zero() || args.pg_statement_timeout.is_zero() {
        return Err(CliError::Usage(
            "--pg-connect-timeout and --pg-statement-timeout must be positive".into(),
        ));
    }
    let opts = PgOptions {
        url: spec.to_string(),
        pool_size: args.pg_pool_size,
        connect_timeout: args.pg_connect_timeout,
        statement_timeout: args.pg_statement_timeout,
        schema: args.pg_schema.clone().filter(|s| !s.is_empty()),
        ca_file: args.pg_ca_file.clone(),
    };
    let store = PgStore::connect(&opts).await?;
    tracing::info!(store = "postgres", database = %store.description(), pool_size = opts.pool_size,
        "store opened, migrations applied");
    Ok(Arc::new(store))
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                    return;
                }
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// A blocking client of the admin API.
pub struct Client {
    base: String,
    token: String,
    http: reqwest::blocking::Client,
}

impl Client {
    pub fn new(args: &ClientArgs) -> Result<Self, CliError> {
        let token = args
            .admin_token
            .clone()
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                CliError::Usage(
                    "the admin token is required: --admin-token or ATMOST_ADMIN_TOKEN".into(),
                )
            })?;
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| CliError::Http(e.to_string()))?;
        Ok(Client {
            base: args.ledger.trim_end_matches('/').to_string(),
            token,
            http,
        })
    }

    fn send<T: DeserializeOwned>(
        &self,
        rb: reqwest::blocking::RequestBuilder,
    ) -> Result<(T, serde_json::Value), CliError> {
        let resp = rb
            .bearer_auth(&self.token)
            .send()
            .map_err(|e| CliError::Http(e.to_string()))?;
        let status = resp.status();
        let text = resp.text().map_err(|e| CliError::Http(e.to_string()))?;
        if !status.is_success() {
            let body: Option<ErrorBody> = serde_json::from_str(&text).ok();
            return Err(CliError::Api {
                status: status.as_u16(),
                error: body
                    .as_ref()
                    .map(|b| b.error.clone())
                    .unwrap_or_else(|| text.clone()),
                message: body.and_then(|b| b.message),
            });
        }
        let raw: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| CliError::Http(format!("bad JSON from ledger: {e}")))?;
        let typed = serde_json::from_value(raw.clone())
            .map_err(|e| CliError::Http(format!("unexpected answer: {e}")))?;
        Ok((typed, raw))
    }

    pub fn get<T: DeserializeOwned>(
        &self,
        path: &str,
        query: &[(&str, String)],
    ) -> Result<(T, serde_json::Value), CliError> {
        let mut url = format!("{}{}", self.base, path);
        if !query.is_empty() {
            let qs: Vec<String> = query
                .iter()
                .map(|(k, v)| format!("{k}={}", urlencode(v)))
                .collect();
            url.push('?');
            url.push_str(&qs.join("&"));
        }
        self.send(self.http.get(url))
    }

    pub fn post<B: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<(T, serde_json::Value), CliError> {
        self.send(self.http.post(format!("{}{}", self.base, path)).json(body))
    }
}

fn urlencode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn print_json(v: &serde_json::Value) -> Result<(), CliError> {
    println!(
        "{}",
        serde_json::to_string_pretty(v).map_err(LedgerError::from)?
    );
    Ok(())
}

fn opt<T: std::fmt::Display>(v: Option<T>, none: &str) -> String {
    v.map(|x| x.to_string()).unwrap_or_else(|| none.to_string())
}

fn print_permit(p: &PermitView) {
    println!("permit     {}", p.id);
    println!("label      {}", p.label);
    println!("status     {}", p.status);
    println!("created    {}", p.created_at);
    println!("expires    {}", p.expires_at);
    if let Some(r) = &p.revoked_at {
        println!("revoked    {r}");
    }
    println!("tools      {}", p.tools.join(","));
    let caps: Vec<String> = p
        .max_calls
        .iter()
        .map(|(t, n)| format!("{t}={n}"))
        .collect();
    println!(
        "max calls  {} (default {})",
        if caps.is_empty() {
            "-".to_string()
        } else {
            caps.join(" ")
        },
        opt(p.max_calls_default, "none")
    );
    println!("budget     {}", opt(p.budget, "no limit"));
    let costs: Vec<String> = p
        .cost
        .iter()
        .map(|(t, c)| match c {
            CostRule::Fixed(n) => format!("{t}={n}"),
            CostRule::Pointer(ptr) => format!("{t}={ptr}"),
        })
        .collect();
    println!(
        "cost       {} (default {})",
        if costs.is_empty() {
            "-".to_string()
        } else {
            costs.join(" ")
        },
        p.cost_default
    );
    println!("dup guard  {}", p.duplicate_guard.as_str());
    println!(
        "retention  {}",
        humantime::format_duration(Duration::from_secs(p.retention_secs))
    );
}

fn print_attempt_row(a: &AttemptView) {
    println!(
        "{:<37} {:<28} {:<22} {:<24} {:>6} {}",
        a.id,
        a.permit_id,
        a.state.as_str(),
        a.tool,
        a.cost,
        a.created_at
    );
}

fn run_permit(c: &Client, json: bool, cmd: PermitCommand) -> Result<(), CliError> {
    match cmd {
        PermitCommand::Create(a) => {
            let req = CreatePermitRequest {
                label: a.label,
                expires: a.expires,
                tools: if a.tools.is_empty() {
                    None
                } else {
                    Some(a.tools)
                },
                max_calls: a.max_calls.into_iter().collect::<BTreeMap<_, _>>(),
                max_calls_default: a.max_calls_default,
                budget: a.budget,
                cost: a.cost.into_iter().collect::<BTreeMap<_, _>>(),
                cost_default: a.cost_default,
                duplicate_guard: a.duplicate_guard,
                retention: a.retention,
            };
            let (resp, raw): (CreatePermitResponse, _) =
                c.post(crate::api::ADMIN_PERMITS_PATH, &req)?;
            if json {
                return print_json(&raw);
            }
            print_permit(&resp.permit);
            println!();
            println!("token (shown once; store it now, the ledger keeps only its hash):");
            println!("{}", resp.token);
        }
        PermitCommand::Show { id } => {
            let (resp, raw): (PermitShowResponse, _) =
                c.get(&format!("/admin/v1/permits/{}", urlencode(&id)), &[])?;
            if json {
                return print_json(&raw);
            }
            print_permit(&resp.permit);
            println!();
            println!("usage per tool:");
            if resp.usage.is_empty() {
                println!("  (no calls)");
            }
            for (tool, u) in &resp.usage {
                println!(
                    "  {tool:<30} calls_made {:<6} limit {}",
                    u.calls_made,
                    opt(u.limit, "none")
                );
            }
            let b = &resp.budget;
            println!(
                "budget: budget {}  spent {}  reserved {}  left {}",
                opt(b.budget, "none"),
                b.spent,
                b.reserved,
                opt(b.left, "unlimited")
            );
            let counts: Vec<String> = resp
                .attempts
                .iter()
                .map(|(s, n)| format!("{s}={n}"))
                .collect();
            println!("attempts: {}", counts.join(" "));
        }
        PermitCommand::List => {
            let (resp, raw): (PermitListResponse, _) =
                c.get(crate::api::ADMIN_PERMITS_PATH, &[])?;
            if json {
                return print_json(&raw);
            }
            println!("{:<28} {:<8} {:<26} LABEL", "ID", "STATUS", "EXPIRES");
            for p in &resp.permits {
                println!(
                    "{:<28} {:<8} {:<26} {}",
                    p.id, p.status, p.expires_at, p.label
                );
            }
        }
        PermitCommand::Revoke { id } => {
            let (resp, raw): (PermitResponse, _) = c.post(
                &format!("/admin/v1/permits/{}/revoke", urlencode(&id)),
                &serde_json::json!({}),
            )?;
            if json {
                return print_json(&raw);
            }
            println!(
                "permit {} revoked at {}",
                resp.permit.id,
                resp.permit.revoked_at.unwrap_or_default()
            );
        }
    }
    Ok(())
}

fn run_attempts(c: &Client, json: bool, cmd: AttemptsCommand) -> Result<(), CliError> {
    match cmd {
        AttemptsCommand::List {
            state,
            permit,
            limit,
        } => {
            let mut q = Vec::new();
            if let Some(s) = state {
                q.push(("state", s.as_str().to_string()));
            }
            if let Some(p) = permit {
                q.push(("permit", p));
            }
            if let Some(l) = limit {
                q.push(("limit", l.to_string()));
            }
            let (resp, raw): (AttemptListResponse, _) =
                c.get(crate::api::ADMIN_ATTEMPTS_PATH, &q)?;
            if json {
                return print_json(&raw);
            }
            println!(
                "{:<37} {:<28} {:<22} {:<24} {:>6} CREATED",
                "ID", "PERMIT", "STATE", "TOOL", "COST"
            );
            for a in &resp.attempts {
                print_attempt_row(a);
            }
        }
        AttemptsCommand::Show { id } => {
            let (resp, raw): (AttemptResponse, _) =
                c.get(&format!("/admin/v1/attempts/{}", urlencode(&id)), &[])?;
            if json {
                return print_json(&raw);
            }
            print_attempt(&resp.attempt);
        }
        AttemptsCommand::Resolve(a) => {
            let receipt = match a.receipt.as_ref() {
                None => None,
                Some(p) if p.as_os_str() == "-" => {
                    let mut s = String::new();
                    std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)?;
                    Some(s)
                }
                Some(p) => Some(std::fs::read_to_string(p)?),
            };
            let by =
                a.by.or_else(|| std::env::var("USER").ok().filter(|u| !u.is_empty()))
                    .unwrap_or_else(|| "cli".to_string());
            let input = ResolveInput {
                executed: a.executed,
                receipt,
                note: a.note,
                by,
            };
            let (resp, raw): (AttemptResponse, _) = c.post(
                &format!("/admin/v1/attempts/{}/resolve", urlencode(&a.id)),
                &input,
            )?;
            if json {
                return print_json(&raw);
            }
            println!("attempt {} is now {}", resp.attempt.id, resp.attempt.state);
            print_attempt(&resp.attempt);
        }
    }
    Ok(())
}

fn print_attempt(a: &AttemptView) {
    println!("attempt    {}", a.id);
    println!("permit     {}", a.permit_id);
    println!("tool       {}", a.tool);
    println!("state      {}", a.state);
    println!("cost       {}", a.cost);
    println!("created    {}", a.created_at);
    println!("updated    {}", a.updated_at);
    println!("lease      {}", a.lease_expires_at);
    if let Some(r) = &a.reason {
        println!("reason     {r}");
    }
    println!(
        "receipt    {}",
        if a.has_receipt {
            "stored"
        } else if a.pruned_at.is_some() {
            "pruned"
        } else {
            "none"
        }
    );
    println!("replays    {}", a.replay_count);
    if let Some(r) = &a.resolution {
        println!(
            "resolved   {} by {} at {}{}",
            if r.executed {
                "executed"
            } else {
                "not executed"
            },
            r.by,
            r.at,
            r.note
                .as_deref()
                .map(|n| format!(" — {n}"))
                .unwrap_or_default()
        );
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn global_client_flags_go_before_or_after_the_command() {
        let cli = Cli::try_parse_from([
            "atmost",
            "--ledger",
            "http://127.0.0.1:1",
            "--json",
            "permit",
            "create",
            "--label",
            "x",
            "--expires",
            "1h",
            "--tools",
            "a,b",
            "--max-calls",
            "a=1",
            "--max-calls",
            "b=2",
            "--cost",
            "a=/amount",
            "--cost",
            "b=3",
            "--duplicate-guard",
            "enforce",
        ])
        .unwrap();
        assert!(cli.client.json);
        let Command::Permit {
            command: PermitCommand::Create(c),
        } = cli.command
        else {
            panic!("not create")
        };
        assert_eq!(c.tools, vec!["a", "b"]);
        assert_eq!(
            c.max_calls,
            vec![("a".to_string(), 1), ("b".to_string(), 2)]
        );
        assert_eq!(c.cost[0].1, CostRule::Pointer("/amount".into()));
        assert_eq!(c.cost[1].1, CostRule::Fixed(3));
        assert_eq!(c.duplicate_guard, Some(GuardMode::Enforce));

        let cli = Cli::try_parse_from([
            "atmost",
            "attempts",
            "list",
            "--state",
            "uncertain",
            "--json",
        ])
        .unwrap();
        assert!(cli.client.json);
        assert!(Cli::try_parse_from(["atmost", "attempts", "resolve", "att_1"]).is_err());
        assert!(Cli::try_parse_from([
            "atmost",
            "attempts",
            "resolve",
            "att_1",
            "--executed",
            "--not-executed"
        ])
        .is_err());
        assert!(Cli::try_parse_from([
            "atmost",
            "attempts",
            "resolve",
            "att_1",
            "--not-executed",
            "--receipt",
            "f"
        ])
        .is_err());
        assert!(Cli::try_parse_from([
            "atmost",
            "permit",
            "create",
            "--label",
            "x",
            "--expires",
            "1h",
            "--max-calls",
            "a"
        ])
        .is_err());
    }
}
