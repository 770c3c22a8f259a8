//! What the PostgreSQL tests share, this crate's and the server's: the server they run against
//! (`DATABASE_URL`; they never skip, so without one they fail), a fresh schema per test and
//! its removal at the end.

use std::time::Duration;

use tokio_postgres::config::SslMode;

use super::options::pg_config;
use super::tls::RustlsMakeTls;
use super::PgOptions;
use crate::error::LedgerError;
use crate::token;

/// The server the PostgreSQL tests use, or what to do to have one.
pub fn database_url() -> Result<String, String> {
    match std::env::var("DATABASE_URL") {
        Ok(u) if !u.trim().is_empty() => Ok(u),
        _ => Err(
            "DATABASE_URL is not set. The PostgreSQL store tests need a server and never skip: \
             `make test` finds or starts one (scripts/with-postgres); by hand, e.g. \
             DATABASE_URL=postgres://postgres@127.0.0.1:5432/test \
             cargo test --workspace --features atmost-ledger/postgres-tests,atmost-ledger-server/postgres-tests"
                .into(),
        ),
    }
}

/// The host and port the URL names (the first of each; a socket path or none counts as
/// 127.0.0.1, no port as 5432), for a relay put in front of the server.
pub fn server_address(url: &str) -> Result<(String, u16), String> {
    let config: tokio_postgres::Config = url.parse().map_err(|e| format!("{e}"))?;
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        _ => "127.0.0.1".to_string(),
    };
    Ok((host, config.get_ports().first().copied().unwrap_or(5432)))
}

/// A schema name no other test uses.
pub fn new_schema() -> Result<String, LedgerError> {
    Ok(format!("atmost_test_{}", token::random_hex(6)?))
}

/// The store options of the tests: their schema, room for the races, deadlines no healthy
/// database comes near.
pub fn options(url: &str, schema: &str) -> PgOptions {
    PgOptions {
        pool_size: 8,
        connect_timeout: Duration::from_secs(10),
        statement_timeout: Duration::from_secs(15),
        // Session timeouts of 15 s, as the statement's.
        callout_timeout: Duration::from_secs(30),
        schema: Some(schema.to_string()),
        ..PgOptions::new(url)
    }
}

/// A plain client on the database (no schema), for set-up and clean-up.
pub async fn raw_client(url: &str) -> Result<tokio_postgres::Client, String> {
    let config = pg_config(&PgOptions::new(url)).map_err(|e| e.to_string())?;
    let tls = if config.get_ssl_mode() == SslMode::Disable {
        RustlsMakeTls::disabled()
    } else {
        RustlsMakeTls::new(None).map_err(|e| e.to_string())?
    };
    let (client, conn) = config
        .connect(tls)
        .await
        .map_err(|e| format!("cannot connect to DATABASE_URL: {e}"))?;
    tokio::spawn(conn);
    Ok(client)
}

/// Drops a test schema, from any context (also from `Drop` inside a runtime); a schema that
/// cannot be dropped is left behind.
pub fn drop_schema(url: String, schema: String) {
    let _ = std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        rt.block_on(async {
            if let Ok(c) = raw_client(&url).await {
                let _ = c
                    .batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
                    .await;
            }
        });
    })
    .join();
}

/// Drops the schema (database URL, schema) when the test ends, however it ends.
pub struct Cleanup(pub String, pub String);

impl Drop for Cleanup {
    fn drop(&mut self) {
        drop_schema(self.0.clone(), self.1.clone());
    }
}
