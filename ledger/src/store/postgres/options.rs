//! How to reach the database: the store options, the URL helpers and the connection config.

use std::path::PathBuf;
use std::time::Duration;

use tokio_postgres::config::SslMode;

use crate::clock;
use crate::error::LedgerError;

/// How to reach the database and how long to wait for it.
#[derive(Clone)]
pub struct PgOptions {
    /// `postgres://…` or `postgresql://…` (libpq URL; `sslmode=require` turns TLS on).
    pub url: String,
    /// Most connections this replica opens.
    pub pool_size: usize,
    /// Connecting (TCP, TLS, authentication) and waiting for a pooled connection.
    pub connect_timeout: Duration,
    /// One statement, server side; the whole operation gets `connect_timeout` + 2× this.
    /// Every connection's session runs under [`session_bound`] instead when that is shorter;
    /// the reads that may take long (the admin API's, the sweep's search) get this.
    pub statement_timeout: Duration,
    /// How long the filter waits for an authorize (its `ledger.timeout_ms`), when its
    /// request does not say: the session timeouts are kept below it (see [`session_bound`]).
    pub callout_timeout: Duration,
    /// Schema for the tables (created if missing); `None`: the server's `search_path`.
    pub schema: Option<String>,
    /// PEM file of CA certificates to trust for TLS instead of the system's roots.
    pub ca_file: Option<PathBuf>,
    /// Whether a lone new call may be decided with one statement on what this replica last
    /// saw of its permit (docs/postgresql.md, "One statement per decision"); off, every
    /// decision takes the locked path. On by default; the tests run the store both ways.
    pub one_statement_decisions: bool,
}

impl std::fmt::Debug for PgOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgOptions")
            .field("url", &redact_url(&self.url))
            .field("pool_size", &self.pool_size)
            .field("connect_timeout", &self.connect_timeout)
            .field("statement_timeout", &self.statement_timeout)
            .field("callout_timeout", &self.callout_timeout)
            .field("schema", &self.schema)
            .field("ca_file", &self.ca_file)
            .field("one_statement_decisions", &self.one_statement_decisions)
            .finish()
    }
}

impl PgOptions {
    pub fn new(url: impl Into<String>) -> Self {
        PgOptions {
            url: url.into(),
            pool_size: 16,
            connect_timeout: Duration::from_secs(5),
            statement_timeout: Duration::from_secs(5),
            callout_timeout: DEFAULT_CALLOUT_TIMEOUT,
            schema: None,
            ca_file: None,
            one_statement_decisions: true,
        }
    }
}

/// The filter's default `ledger.timeout_ms`.
pub const DEFAULT_CALLOUT_TIMEOUT: Duration = Duration::from_millis(1000);

/// Every connection's `idle_in_transaction_session_timeout`: half the callout timeout. A
/// backend whose ledger went silent mid-transaction (a partition, a replica stopped) is
/// ended, and the permit locks it holds freed, well before the filter has given up on the
/// decisions queued behind them. Never below 1 ms (0 would turn the timeout off).
pub fn session_bound(opts: &PgOptions) -> Duration {
    (opts.callout_timeout / 2).max(Duration::from_millis(1))
}

/// Every connection's `statement_timeout` and `lock_timeout`: the time a decision has (the
/// callout timeout less the answer's way back, [`clock::decision_window`]), or
/// `--pg-statement-timeout` if shorter. A statement or lock wait past it could not serve its
/// caller; one within it is left to finish (a lock held briefly by a migration, a slow
/// moment of the disk) rather than cut at half the time and the call denied.
pub fn statement_bound(opts: &PgOptions) -> Duration {
    opts.statement_timeout
        .min(clock::decision_window(opts.callout_timeout))
        .max(Duration::from_millis(1))
}

/// True for a `--store` value that names PostgreSQL.
pub fn is_postgres_url(s: &str) -> bool {
    s.starts_with("postgres://") || s.starts_with("postgresql://")
}

/// The URL without its password, for logs.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "<unparsable url>".into();
    };
    let (authority, tail) = match rest.find(['/', '?']) {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{scheme}://{user}:***@{host}{tail}")
        }
        None => url.to_string(),
    }
    .split("password=")
    .next()
    .unwrap_or("")
    .to_string()
}

pub(super) fn valid_schema_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && s.len() <= 63
}

/// The connection config: the URL plus timeouts, keepalives and the session settings.
pub(super) fn pg_config(opts: &PgOptions) -> Result<tokio_postgres::Config, LedgerError> {
    // tokio-postgres knows disable/prefer/require; this store always verifies the server's
    // certificate and host name, so libpq's stricter modes mean the same here.
    let url = opts
        .url
        .replace("sslmode=verify-full", "sslmode=require")
        .replace("sslmode=verify-ca", "sslmode=require");
    let mut config: tokio_postgres::Config = url.parse().map_err(|e| {
        LedgerError::Invalid(format!("bad PostgreSQL URL {}: {e}", redact_url(&opts.url)))
    })?;
    // libpq's default `prefer` would try TLS and fall back silently: here TLS is on only when
    // asked for (`sslmode=require`), and then it is verified.
    if config.get_ssl_mode() == SslMode::Prefer {
        config.ssl_mode(SslMode::Disable);
    }
    if config.get_application_name().is_none() {
        config.application_name("atmost-ledger");
    }
    config.connect_timeout(opts.connect_timeout);
    config.keepalives(true);
    config.keepalives_idle(Duration::from_secs(10));
    let stmt_ms = statement_bound(opts).as_millis();
    let idle_tx_ms = session_bound(opts).as_millis();
    let mut options = config.get_options().unwrap_or("").to_string();
    options.push_str(&format!(
        " -c statement_timeout={stmt_ms} -c lock_timeout={stmt_ms} \
         -c idle_in_transaction_session_timeout={idle_tx_ms} -c default_transaction_isolation=read\\ committed"
    ));
    if let Some(s) = opts.schema.as_deref() {
        options.push_str(&format!(" -c search_path={s}"));
    }
    config.options(options.trim());
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session_options(opts: &PgOptions) -> String {
        pg_config(opts)
            .map(|c| c.get_options().unwrap_or_default().to_string())
            .unwrap_or_default()
    }

    #[test]
    fn sessions_end_idle_transactions_at_half_the_callout_and_statements_at_its_window() {
        let opts = PgOptions::new("postgres://atmost@127.0.0.1:5432/atmost");
        let options = session_options(&opts);
        for setting in [
            "statement_timeout=900",
            "lock_timeout=900",
            "idle_in_transaction_session_timeout=500",
        ] {
            assert!(options.contains(setting), "{setting} in {options}");
        }
        let short = PgOptions {
            statement_timeout: Duration::from_millis(300),
            callout_timeout: Duration::from_secs(5),
            ..opts
        };
        let options = session_options(&short);
        for setting in [
            "statement_timeout=300",
            "lock_timeout=300",
            "idle_in_transaction_session_timeout=2500",
        ] {
            assert!(options.contains(setting), "{setting} in {options}");
        }
    }
}
