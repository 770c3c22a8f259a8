//! `atmost ledger`: opens the store and serves the API until a signal stops it.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;

use super::args::LedgerArgs;
use super::{init_logs, CliError};
use crate::admins::{AdminSet, Admins, FixedTokens, TokensFile};
use crate::decision_loop::DecisionLoop;
use crate::metrics::Metrics;
use crate::redact::Redaction;
use crate::server;
use crate::state::{AppState, ApprovalConfig, IdentityProxy, InboxConfig, ServerConfig};
use crate::tls::{self, CertReloader, TlsFiles, TlsListener};
use atmost_ledger::clock::SystemClock;
use atmost_ledger::credentials::CredentialKey;
#[cfg(feature = "postgres")]
use atmost_ledger::store::postgres::{self, PgOptions, PgStore};
#[cfg(feature = "sqlite")]
use atmost_ledger::store::sqlite::SqliteStore;
use atmost_ledger::store::Store;

/// Shortest service or admin token the ledger starts with, in bytes: the filter's
/// configuration refuses a shorter service token by the same figure.
pub const MIN_TOKEN_BYTES: usize = atmost_protocol::MIN_SERVICE_TOKEN_BYTES;

/// Refuses a missing, short or shared token, naming the flag at fault. `admin_token` is
/// `--admin-token` (none when not given or empty); without it, `--admin-tokens-file` must be
/// given (`tokens_file`), whose tokens are checked as it is read (crate::admins).
pub(super) fn check_tokens(
    service_token: &str,
    admin_token: Option<&str>,
    tokens_file: bool,
) -> Result<(), CliError> {
    if service_token.trim().is_empty() {
        return Err(CliError::Usage(
            "--service-token (ATMOST_SERVICE_TOKEN) is required".into(),
        ));
    }
    if admin_token.is_none() && !tokens_file {
        return Err(CliError::Usage(
            "an admin token is required: --admin-token (ATMOST_ADMIN_TOKEN), --admin-tokens-file (ATMOST_ADMIN_TOKENS_FILE), or both"
                .into(),
        ));
    }
    let admin = admin_token.map(|t| ("--admin-token (ATMOST_ADMIN_TOKEN)", t));
    for (flag, token) in [("--service-token (ATMOST_SERVICE_TOKEN)", service_token)]
        .into_iter()
        .chain(admin)
    {
        if token.len() < MIN_TOKEN_BYTES {
            return Err(CliError::Usage(format!(
                "{flag} is {} bytes long; it must be at least {MIN_TOKEN_BYTES} (make one with `openssl rand -hex 32`)",
                token.len()
            )));
        }
    }
    if admin_token == Some(service_token) {
        return Err(CliError::Usage(
            "--admin-token must differ from --service-token".into(),
        ));
    }
    Ok(())
}

/// The admins the ledger starts with (crate::admins): `--admin-token`'s, and the tokens
/// file's, read now (a file that is refused stops the start) and again as it changes.
fn starting_admins(
    args: &LedgerArgs,
    admin_token: Option<String>,
) -> Result<(Arc<Admins>, Option<TokensFile>), CliError> {
    let fixed = FixedTokens {
        admin_token,
        service_token: args.service_token.clone(),
    };
    match &args.admin_tokens_file {
        Some(path) => {
            let file = TokensFile::load(path.clone(), fixed)
                .map_err(|e| CliError::Usage(e.to_string()))?;
            Ok((file.admins(), Some(file)))
        }
        None => {
            let set = AdminSet::parse("", &fixed)
                .map_err(|e| CliError::Usage(format!("--admin-token (ATMOST_ADMIN_TOKEN): {e}")))?;
            Ok((Arc::new(Admins::new(set)), None))
        }
    }
}

pub(super) fn run_ledger(args: LedgerArgs, admin_token: Option<String>) -> Result<(), CliError> {
    let admin_token = admin_token.filter(|t| !t.trim().is_empty());
    check_tokens(
        &args.service_token,
        admin_token.as_deref(),
        args.admin_tokens_file.is_some(),
    )?;
    if args.listen == args.admin_listen {
        return Err(CliError::Usage(format!(
            "--admin-listen must differ from --listen (both are {}): the admin API and the inbox have a port of their own",
            args.listen
        )));
    }
    if args.lease.is_zero() {
        return Err(CliError::Usage("--lease must be positive".into()));
    }
    let approvals = approval_config(&args)?;
    if args.callout_timeout.is_zero() {
        return Err(CliError::Usage("--callout-timeout must be positive".into()));
    }
    let redaction = Redaction::new(&args.redact_field).map_err(CliError::Usage)?;
    if args.inbox_session_ttl.is_zero() {
        return Err(CliError::Usage(
            "--inbox-session-ttl must be positive".into(),
        ));
    }
    let reconcile_rules = args
        .reconcile_rules
        .as_deref()
        .map(|path| crate::reconcile::rules::load(path, &crate::reconcile::rules::ProcessEnv))
        .transpose()
        .map_err(CliError::Usage)?;
    let tool_refusal_keys = args
        .tool_refusal_keys
        .as_deref()
        .map(crate::tool_refusal::RefusalKeys::read)
        .transpose()
        .map_err(CliError::Usage)?
        .unwrap_or_default();
    let tls = tls_files(&args)
        .map(|files| CertReloader::load(files, Arc::new(rustls::crypto::ring::default_provider())))
        .transpose()
        .map_err(|e| CliError::Usage(e.to_string()))?;
    let credential_key = credential_key(&args)?;
    let webhook = crate::webhook::WebhookConfig::from_flags(
        args.approval_webhook.as_deref(),
        args.approval_webhook_secret_file.as_deref(),
    )
    .map_err(CliError::Usage)?;
    let (admins, tokens_file) = starting_admins(&args, admin_token)?;
    init_logs(args.log_format);
    // The admin API, the inbox, the sweeper, the reconciler and /metrics.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    // The filter's requests, from socket to commit (crate::decision_loop).
    let mut decisions = DecisionLoop::start()?;
    let store = rt.block_on(open_store(&args, decisions.handle()))?;
    let mut state = AppState::new(
        store,
        Arc::new(SystemClock),
        ServerConfig {
            service_token: args.service_token,
            admins,
            lease: args.lease,
            callout_timeout: args.callout_timeout,
            redaction,
            inbox: InboxConfig {
                session_ttl: args.inbox_session_ttl,
                stuck_after: args.inbox_stuck_after,
                // Served over the ledger's own TLS, every response is one a browser got over
                // https.
                secure_cookies: args.inbox_secure_cookies || args.tls_cert_file.is_some(),
                lookup_forms: reconcile_rules
                    .iter()
                    .flat_map(|set| &set.rules)
                    .filter_map(|r| Some((r.tool.clone(), r.key_carrier?)))
                    .collect(),
            },
            key_refresh: args.signing_key_refresh,
            receipt_issuer: args.receipt_issuer,
            tool_refusal_keys,
            auth_limit: Default::default(),
            purge_ended_permits_after: args.purge_ended_permits_after.delay(),
            credential_key,
            approvals,
        },
        Arc::new(Metrics::new()?),
    );
    if let Some(config) = webhook {
        let _runtime = rt.enter();
        state.webhook = Some(
            crate::webhook::Webhook::spawn(config, state.metrics.clone(), state.clock.clone())
                .map_err(CliError::Usage)?,
        );
    }
    let state = Arc::new(state);
    // Replicas starting together on one store end with one key, the same for all.
    rt.block_on(state.start_signing())?;
    let decision_loop = &mut decisions;
    rt.block_on(async move {
        let stop_signals = crate::drain::os_stop_signals()?;
        // The first answer of /readyz is a real check; then one a second, in the background.
        crate::readiness::check_once(&state.readiness, &*state.store, &state.metrics).await;
        // Bound here, so that a port in use stops the start; served on the decision loop.
        let listener = std::net::TcpListener::bind(args.listen)?;
        listener.set_nonblocking(true)?;
        let admin_listener = tokio::net::TcpListener::bind(args.admin_listen).await?;
        tracing::info!(listen = %args.listen, admin_listen = %args.admin_listen,
            lease_ms = state.config.lease.as_millis() as u64, tls = tls.is_some(), "ledger listening");
        let sweeper = crate::sweeper::spawn_sweeper(state.clone(), args.sweep_interval);
        let admins_reloader = tokens_file
            .map(|file| crate::admins::spawn_reloader(file, state.metrics.clone()));
        let readiness = crate::readiness::spawn_checks(
            state.readiness.clone(),
            state.store.clone(),
            state.metrics.clone(),
        );
        let reconciler = match reconcile_rules {
            Some(rules) => Some(
                crate::reconcile::spawn(state.clone(), rules)
                    .map_err(std::io::Error::other)?,
            ),
            None => None,
        };
        // Both listeners stop together, after one drain.
        let shutdown = crate::drain::Shutdown::after(crate::drain::drain_then_stop(
            stop_signals,
            state.metrics.clone(),
            args.drain_delay,
        ));
        let metrics = state.metrics.clone();
        let (tls_config, reloader) = match tls {
            Some(reloader) => {
                let provider = Arc::new(rustls::crypto::ring::default_provider());
                let config = tls::server_config(provider, reloader.resolver())
                    .map_err(std::io::Error::other)?;
                (Some(Arc::new(config)), Some(tls::spawn_reloader(reloader, metrics.clone())))
            }
            None => (None, None),
        };
        let api = {
            let (router, tls_config, metrics, stop) =
                (server::api_router(state.clone()), tls_config.clone(), metrics.clone(), shutdown.signal());
            decision_loop.serve(move || async move {
                let listener = tokio::net::TcpListener::from_std(listener)?;
                serve(listener, router, tls_config, metrics, stop).await
            })
        };
        let served = tokio::try_join!(
            api,
            serve(admin_listener, server::admin_router(state), tls_config, metrics, shutdown.signal()),
        );
        if let Some(r) = reloader {
            r.abort();
        }
        sweeper.abort();
        if let Some(r) = admins_reloader {
            r.abort();
        }
        readiness.abort();
        if let Some(r) = reconciler {
            r.abort();
        }
        tracing::info!("ledger stopped");
        served.map(|_| ())
    })?;
    decisions.join()?;
    Ok(())
}

/// Serves `app` on `listener` until `stop` completes, over TLS when `tls` is given; handlers
/// see each connection's peer address (`ConnectInfo`).
async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    metrics: Arc<Metrics>,
    stop: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = app.into_make_service_with_connect_info::<SocketAddr>();
    match tls {
        Some(config) => {
            // Tapped for nothing: axum gives a tapped listener's connections their peer address.
            let listener = axum::serve::ListenerExt::tap_io(
                TlsListener::new(listener, config, metrics)?,
                |_| {},
            );
            axum::serve(listener, app)
                .with_graceful_shutdown(stop)
                .await
        }
        None => {
            // Callouts are small request/response pairs on long-lived connections: without
            // TCP_NODELAY, Nagle's algorithm holds a reply back until the previous one is
            // acked.
            let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
                if let Err(e) = tcp.set_nodelay(true) {
                    tracing::warn!(error = %e, "could not set TCP_NODELAY on an accepted connection");
                }
            });
            axum::serve(listener, app)
                .with_graceful_shutdown(stop)
                .await
        }
    }
}

/// The pair of `--tls-cert-file` and `--tls-key-file` (clap makes either require the other).
fn tls_files(args: &LedgerArgs) -> Option<TlsFiles> {
    match (&args.tls_cert_file, &args.tls_key_file) {
        (Some(cert), Some(key)) => Some(TlsFiles {
            cert: cert.clone(),
            key: key.clone(),
        }),
        _ => None,
    }
}

/// Opens the store `--store` names: the embedded SQLite file, or PostgreSQL (migrations run
/// here, before the ledger listens). A build without one of the stores (cargo features
/// `sqlite`, `postgres`) refuses to name it.
/// `decisions`: the runtime of the decision loop, where SQLite's writer runs (PostgreSQL's
/// workers start on the thread of the request that needs them, which is the loop's).
pub(super) async fn open_store(
    args: &LedgerArgs,
    decisions: &tokio::runtime::Handle,
) -> Result<Arc<dyn Store>, CliError> {
    let spec = args.store.trim();
    if spec.is_empty() || spec == "sqlite" {
        return open_sqlite(args, decisions);
    }
    open_postgres(args, spec).await
}

#[cfg(feature = "sqlite")]
fn open_sqlite(
    args: &LedgerArgs,
    decisions: &tokio::runtime::Handle,
) -> Result<Arc<dyn Store>, CliError> {
    let store = SqliteStore::open_dir_on(&args.data_dir, decisions)?;
    tracing::info!(store = "sqlite", path = %store.path().display(), "store opened");
    Ok(Arc::new(store))
}

#[cfg(not(feature = "sqlite"))]
fn open_sqlite(_: &LedgerArgs, _: &tokio::runtime::Handle) -> Result<Arc<dyn Store>, CliError> {
    Err(CliError::Usage(
        "this atmost is built without the SQLite store (cargo feature `sqlite`): --store must be a postgres:// URL".into(),
    ))
}

#[cfg(feature = "postgres")]
async fn open_postgres(args: &LedgerArgs, spec: &str) -> Result<Arc<dyn Store>, CliError> {
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
        callout_timeout: args.callout_timeout,
        schema: args.pg_schema.clone().filter(|s| !s.is_empty()),
        ca_file: args.pg_ca_file.clone(),
        one_statement_decisions: args.pg_one_statement,
    };
    let store = PgStore::connect(&opts).await?;
    tracing::info!(store = "postgres", database = %store.description(), pool_size = opts.pool_size,
        "store opened, migrations applied");
    Ok(Arc::new(store))
}

#[cfg(not(feature = "postgres"))]
async fn open_postgres(_: &LedgerArgs, _: &str) -> Result<Arc<dyn Store>, CliError> {
    Err(CliError::Usage(
        "this atmost is built without the PostgreSQL store (cargo feature `postgres`): --store must be `sqlite`".into(),
    ))
}

/// The longest `--approval-wait` and `--approval-use-within`: a week.
const MAX_APPROVAL_TIME: Duration = Duration::from_secs(7 * 24 * 3600);

/// The approval settings, checked: each lapse time 1 s to 7 days; a proxy's identity header a
/// valid header name, believed from an admin name that is one.
fn approval_config(args: &LedgerArgs) -> Result<ApprovalConfig, CliError> {
    for (flag, d) in [
        ("--approval-wait", args.approval_wait),
        ("--approval-use-within", args.approval_use_within),
    ] {
        if d < Duration::from_secs(1) || d > MAX_APPROVAL_TIME {
            return Err(CliError::Usage(format!(
                "{flag} must be 1s to 7d, not {}",
                humantime::format_duration(d)
            )));
        }
    }
    let identity = match (&args.admin_identity_header, &args.admin_identity_from) {
        (Some(header), Some(admin)) => {
            let header = axum::http::HeaderName::try_from(header.as_str()).map_err(|_| {
                CliError::Usage(format!(
                    "--admin-identity-header {header:?} is not a header name"
                ))
            })?;
            if !crate::admins::valid_admin_name(admin) {
                return Err(CliError::Usage(format!(
                    "--admin-identity-from {admin:?} is not an admin name (1 to 64 bytes of A-Z a-z 0-9 . _ @ -)"
                )));
            }
            Some(IdentityProxy {
                admin: admin.clone(),
                header,
            })
        }
        _ => None,
    };
    Ok(ApprovalConfig {
        wait: args.approval_wait,
        use_within: args.approval_use_within,
        identity,
    })
}

/// The credential key from `--credential-key-file` or `--credential-key` (at most one may be
/// given); `None` without either: the ledger then keeps no credentials.
fn credential_key(args: &LedgerArgs) -> Result<Option<Arc<CredentialKey>>, CliError> {
    let text = match (&args.credential_key_file, &args.credential_key) {
        (Some(_), Some(_)) => {
            return Err(CliError::Usage(
                "give the credential key once: --credential-key-file or --credential-key".into(),
            ))
        }
        (Some(path), None) => std::fs::read_to_string(path).map_err(|e| {
            CliError::Usage(format!("--credential-key-file {}: {e}", path.display()))
        })?,
        (None, Some(text)) => text.clone(),
        (None, None) => return Ok(None),
    };
    CredentialKey::from_hex(&text)
        .map(|k| Some(Arc::new(k)))
        .map_err(|why| CliError::Usage(format!("credential key: {why}")))
}
