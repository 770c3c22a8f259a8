//! The ledger's HTTP server (HTTP/1.1 and h2c prior knowledge) and its sweeper.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use atmost_protocol::credential::CREDENTIAL_PATH;
use atmost_protocol::signature::{Jwks, KEYS_PATH};
use atmost_protocol::{
    AuthorizeRequest, AuthorizeResponse, Denial, DenialCode, LimitsRequest, Outcome, OutcomeAck,
    OutcomesRequest, OutcomesResponse, AUTHORIZE_PATH, CALLOUT_TIMEOUT_HEADER, LIMITS_PATH,
    MAX_LIMITS_TOOLS, OUTCOMES_PATH,
};
use axum::extract::rejection::JsonRejection;
use axum::extract::{ConnectInfo, FromRequestParts, Path, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post, put};
use axum::{Json, Router};
use serde::Deserialize;
use tracing::{error, info, warn};

use crate::api::{
    self, AttemptListResponse, AttemptResponse, AttemptView, CreatePermitRequest,
    CreatePermitResponse, ErrorBody, KeyListResponse, KeyRotateResponse, KeyView,
    PermitListResponse, PermitResponse, PermitShowResponse, PermitView, ReceiptExportResponse,
    SessionsRevokeResponse,
};
use crate::auth_limit::{AuthLimit, FailureLimiter, Verdict};
use crate::credentials;
use crate::inbox::{self, InboxConfig};
use crate::metrics::Metrics;
use crate::readiness::Readiness;
use crate::redact::Redaction;
use crate::signer::{KeyUnavailable, Signer};
use atmost_ledger::clock::{Clock, Deadline};
use atmost_ledger::credentials::CredentialKey;
use atmost_ledger::decide::{self, Mutation, Notice, ResolveInput};
use atmost_ledger::error::{LedgerError, ResolveError};
use atmost_ledger::keys::PublicSigningKey;
use atmost_ledger::model::{Attempt, AttemptState, BudgetTotals, GuardMode};
use atmost_ledger::receipts::{sign_receipt, ReceiptClaims};
use atmost_ledger::store::purge::PURGE_PER_SWEEP;
use atmost_ledger::store::{AttemptFilter, Store};
use atmost_ledger::{signing, token};

/// Largest request body accepted (receipts ride in outcome reports).
pub const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;

/// How long a client may keep `GET /v1/keys`'s answer (`cache-control: max-age`). A new key
/// signs as soon as it is made, so a verifier meeting an unknown `keyid` should fetch again.
pub const KEYS_MAX_AGE_S: u64 = 60;

/// Secrets and timings of a running ledger.
#[derive(Clone)]
pub struct ServerConfig {
    pub service_token: String,
    pub admin_token: String,
    pub lease: Duration,
    /// How long a filter that does not send [`CALLOUT_TIMEOUT_HEADER`] waits for an
    /// authorize (`--callout-timeout`).
    pub callout_timeout: Duration,
    /// Argument fields never shown (admin API, CLI, inbox).
    pub redaction: Redaction,
    pub inbox: InboxConfig,
    /// How long a replica signs with the active key it read before reading it again.
    pub key_refresh: Duration,
    /// The `iss` of the receipts it signs.
    pub receipt_issuer: String,
    /// The keys verifiers at the tool prove their refusals with (`--tool-refusal-keys`).
    pub tool_refusal_keys: crate::tool_refusal::RefusalKeys,
    /// Failed authentications per source before 429 (crate::auth_limit).
    pub auth_limit: AuthLimit,
    /// How long after a permit stopped authorizing the sweeper purges its history; `None`
    /// keeps everything (docs/design.md#purging-ended-permits).
    pub purge_ended_permits_after: Option<Duration>,
    /// The key the credentials in the ledger's custody are sealed under
    /// (`--credential-key-file`, `ATMOST_CREDENTIAL_KEY`); without it the ledger keeps none.
    pub credential_key: Option<Arc<CredentialKey>>,
}

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConfig")
            .field("service_token", &"<redacted>")
            .field("admin_token", &"<redacted>")
            .field("lease", &self.lease)
            .field("callout_timeout", &self.callout_timeout)
            .field("redaction", &self.redaction)
            .field("inbox", &self.inbox)
            .field("key_refresh", &self.key_refresh)
            .field("receipt_issuer", &self.receipt_issuer)
            .field("tool_refusal_keys", &self.tool_refusal_keys)
            .field("auth_limit", &self.auth_limit)
            .field("purge_ended_permits_after", &self.purge_ended_permits_after)
            .field("credential_key", &self.credential_key)
            .finish()
    }
}

pub struct AppState {
    pub store: Arc<dyn Store>,
    pub clock: Arc<dyn Clock>,
    pub config: ServerConfig,
    pub metrics: Arc<Metrics>,
    /// The active signing key as this replica holds it.
    pub signer: Signer,
    /// The latest background store check, which `/readyz` answers from.
    pub readiness: Readiness,
    /// Failed authentications per source (bearer tokens, inbox sign-ins).
    pub auth_failures: FailureLimiter,
    /// When the gauges read from the store were last read (see [`refresh_store_gauges`]).
    store_gauges_read_at: tokio::sync::Mutex<Option<Instant>>,
    /// Which credential each permit names (crate::credentials).
    pub custody: crate::credentials::Custody,
}

impl AppState {
    /// The state of a ledger on `store`; its signer holds no key until
    /// [`Signer::start`] (the ledger calls it before it listens).
    pub fn new(
        store: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
        config: ServerConfig,
        metrics: Arc<Metrics>,
    ) -> Self {
        let signer = Signer::new(config.key_refresh);
        let auth_failures = FailureLimiter::new(config.auth_limit);
        AppState {
            store,
            clock,
            config,
            metrics,
            signer,
            readiness: Readiness::default(),
            auth_failures,
            store_gauges_read_at: tokio::sync::Mutex::new(None),
            custody: Default::default(),
        }
    }

    /// Makes sure the store has an active signing key and holds it.
    pub async fn start_signing(&self) -> Result<(), LedgerError> {
        let key = self.signer.start(&*self.store, self.clock.now_ms()).await?;
        info!(kid = key.kid(), "signing key ready");
        Ok(())
    }

    fn lease_ms(&self) -> u64 {
        u64::try_from(self.config.lease.as_millis()).unwrap_or(u64::MAX)
    }
}

pub type Shared = Arc<AppState>;

pub(crate) fn error_response(status: StatusCode, error: &str, message: Option<String>) -> Response {
    (
        status,
        Json(ErrorBody {
            error: error.to_string(),
            message,
        }),
    )
        .into_response()
}

fn bad_request(message: impl Into<String>) -> Response {
    error_response(StatusCode::BAD_REQUEST, "bad_request", Some(message.into()))
}

fn not_found(what: &str) -> Response {
    error_response(StatusCode::NOT_FOUND, what, None)
}

/// A store failure. A transient one (the store is down, timed out, read-only, full or failing
/// over: [`LedgerError::is_transient`]) answers 503 `store_unavailable`, which the filter turns
/// into `gateway_unavailable`, so nothing is dispatched on a decision that was not committed.
/// Anything else is a bug or bad data, not an outage: 500 `internal`, logged as such.
pub(crate) fn internal(state: &AppState, op: &str, e: &LedgerError) -> Response {
    state.metrics.store_errors.with_label_values(&[op]).inc();
    if e.is_transient() {
        error!(op, error = %e, "store unavailable");
        return error_response(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable", None);
    }
    error!(op, error = %e, bug = true, "store operation failed on a broken invariant");
    error_response(StatusCode::INTERNAL_SERVER_ERROR, "internal", None)
}

fn json_rejection(r: JsonRejection) -> Response {
    bad_request(r.body_text())
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, rest) = v.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    Some(rest.trim())
}

/// The address a request came from, as the listener saw it (none for a router served without
/// connection info: nothing is then counted per source).
pub fn peer(req: &Request) -> Option<SocketAddr> {
    req.extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0)
}

/// [`peer`] as a handler's extractor.
pub struct Peer(pub Option<SocketAddr>);

impl<S: Send + Sync> FromRequestParts<S> for Peer {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(Peer(
            parts
                .extensions
                .get::<ConnectInfo<SocketAddr>>()
                .map(|c| c.0),
        ))
    }
}

/// Counts a failed authentication of `api` from `peer`: what to answer it with
/// ([`crate::auth_limit`]).
pub fn failed_authentication(state: &AppState, api: &str, peer: Option<SocketAddr>) -> Verdict {
    state.metrics.unauthorized.with_label_values(&[api]).inc();
    let verdict = match peer {
        Some(p) => state.auth_failures.fail(p.ip(), Instant::now()),
        None => Verdict::Refuse,
    };
    if let Verdict::TooMany { .. } = verdict {
        state.metrics.auth_limited.with_label_values(&[api]).inc();
    }
    verdict
}

/// HTTP 429 `too_many_failures` with `Retry-After`.
pub fn too_many_failures(retry_after_s: u64) -> Response {
    let mut resp = error_response(
        StatusCode::TOO_MANY_REQUESTS,
        "too_many_failures",
        Some(format!(
            "too many failed authentications from this address; retry after {retry_after_s} s"
        )),
    );
    resp.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(retry_after_s));
    resp
}

fn unauthorized(state: &AppState, api: &str, peer: Option<SocketAddr>) -> Response {
    match failed_authentication(state, api, peer) {
        Verdict::Refuse => error_response(StatusCode::UNAUTHORIZED, "unauthorized", None),
        Verdict::TooMany { retry_after_s } => too_many_failures(retry_after_s),
    }
}

async fn require_service(State(state): State<Shared>, req: Request, next: Next) -> Response {
    match bearer(req.headers()) {
        Some(t) if token::secrets_equal(t, &state.config.service_token) => next.run(req).await,
        _ => unauthorized(&state, "service", peer(&req)),
    }
}

async fn require_admin(State(state): State<Shared>, req: Request, next: Next) -> Response {
    match bearer(req.headers()) {
        Some(t) if token::secrets_equal(t, &state.config.admin_token) => next.run(req).await,
        _ => unauthorized(&state, "admin", peer(&req)),
    }
}

/// What the API listener answers under `/admin`: the admin API and the inbox are served on the
/// admin listener only (`--admin-listen`).
async fn admin_elsewhere() -> Response {
    error_response(
        StatusCode::NOT_FOUND,
        "admin_elsewhere",
        Some("the admin API and the inbox answer on the ledger's admin listener (--admin-listen), not on this one".into()),
    )
}

/// The routes of the API listener (`--listen`): the filter's API, `/v1/keys`, `/metrics` and
/// the health checks.
pub fn api_router(state: Shared) -> Router {
    let service = Router::new()
        .route(AUTHORIZE_PATH, post(authorize))
        .route(OUTCOMES_PATH, post(outcomes))
        .route(LIMITS_PATH, post(limits))
        .route(CREDENTIAL_PATH, post(credentials::fetch))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_service,
        ));
    Router::new()
        .route("/healthz", get(healthz))
        .route(KEYS_PATH, get(published_keys))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/admin", any(admin_elsewhere))
        .route("/admin/", any(admin_elsewhere))
        .route("/admin/{*rest}", any(admin_elsewhere))
        .merge(service)
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// The routes of the admin listener (`--admin-listen`): the admin API and the inbox.
pub fn admin_router(state: Shared) -> Router {
    Router::new()
        .route(
            api::ADMIN_PERMITS_PATH,
            post(create_permit).get(list_permits),
        )
        .route("/admin/v1/permits/{id}", get(show_permit))
        .route("/admin/v1/permits/{id}/revoke", post(revoke_permit))
        .route(api::ADMIN_ATTEMPTS_PATH, get(list_attempts))
        .route(api::ADMIN_ATTEMPTS_EXPORT_PATH, get(export_attempts))
        .route("/admin/v1/attempts/{id}", get(show_attempt))
        .route("/admin/v1/attempts/{id}/resolve", post(resolve_attempt))
        .route(api::ADMIN_KEYS_PATH, get(list_keys))
        .route(
            api::ADMIN_CREDENTIALS_PATH,
            get(credentials::list_credentials),
        )
        .route(
            "/admin/v1/credentials/{name}",
            put(credentials::put_credential),
        )
        .route(api::ADMIN_KEYS_ROTATE_PATH, post(rotate_key))
        .route(
            api::ADMIN_INBOX_SESSIONS_REVOKE_PATH,
            post(revoke_inbox_sessions),
        )
        .route_layer(middleware::from_fn_with_state(state.clone(), require_admin))
        .merge(inbox::routes())
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

async fn healthz() -> Response {
    (StatusCode::OK, Json(serde_json::json!({"status": "ok"}))).into_response()
}

async fn readyz(State(state): State<Shared>) -> Response {
    if state.metrics.is_draining() {
        return error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "draining",
            Some(
                "the ledger is draining before it stops; every other request is still served"
                    .into(),
            ),
        );
    }
    // The background check's answer (crate::readiness): a probe never reaches the store.
    if state.readiness.store_ready(Instant::now()) {
        (StatusCode::OK, Json(serde_json::json!({"status": "ready"}))).into_response()
    } else {
        error_response(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable", None)
    }
}

async fn metrics(State(state): State<Shared>) -> Response {
    refresh_store_gauges(&state).await;
    match state.metrics.render() {
        Ok(text) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(e) => internal(&state, "metrics", &e),
    }
}

/// How long the caller of a callout waits for its answer: its [`CALLOUT_TIMEOUT_HEADER`], or
/// `--callout-timeout` for a filter that does not send one. `Err` for a value that is not a
/// positive integer.
fn callout_timeout(state: &AppState, headers: &HeaderMap) -> Result<Duration, String> {
    let Some(value) = headers.get(CALLOUT_TIMEOUT_HEADER) else {
        return Ok(state.config.callout_timeout);
    };
    match value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
    {
        Some(ms) if ms > 0 => Ok(Duration::from_millis(ms)),
        _ => Err(format!(
            "{CALLOUT_TIMEOUT_HEADER}: a positive integer of milliseconds"
        )),
    }
}

async fn authorize(
    State(state): State<Shared>,
    headers: HeaderMap,
    body: Result<Json<AuthorizeRequest>, JsonRejection>,
) -> Response {
    // Stamped before anything else: the caller's clock started before this one did.
    let arrival = Instant::now();
    let timeout = match callout_timeout(&state, &headers) {
        Ok(t) => t,
        Err(why) => return bad_request(why),
    };
    let deadline = Deadline::of_callout(arrival, timeout);
    let Json(req) = match body {
        Ok(b) => b,
        Err(r) => return json_rejection(r),
    };
    if let Err(why) = decide::check_forwarded(&req) {
        return bad_request(why);
    }
    if let Err(e) = signing::check_dispatch(&req) {
        return bad_request(e.to_string());
    }
    let started = Instant::now();
    let permit_id = token::permit_id_of(&req.permit_token).unwrap_or("-");
    // The key comes before the decision: a dispatch the ledger cannot sign is never reserved.
    let key = match req.dispatch {
        None => None,
        Some(_) => match state.signer.active(&*state.store).await {
            Ok(key) => Some(key),
            Err(e) => return unsignable(&state, permit_id, &req.tool, &e),
        },
    };
    // Read and opened before the decision: a credential that cannot be sent reserves nothing.
    let credential = match credentials::for_dispatch(&state, &req.permit_token).await {
        Ok(c) => c,
        Err(e) => return internal(&state, "credential", &e),
    };
    let (used, credential) = credential.unzip();
    let now = state.clock.now_ms();
    let decision = match state
        .store
        .authorize_with(&req, used.clone(), state.lease_ms(), now, deadline)
        .await
    {
        Ok(d) => d,
        Err(LedgerError::DeadlinePassed(why)) => {
            state.metrics.decisions_past_deadline.inc();
            warn!(permit_id, tool = %req.tool, timeout_ms = timeout.as_millis() as u64, why,
                "authorize not committed: the caller's deadline passed (answered 503)");
            return error_response(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable", None);
        }
        Err(e) => return internal(&state, "authorize", &e),
    };
    // Signed after the store answered: no permit's lock is held while it signs, and only over
    // the body the attempt it wrote records.
    let recorded_body = match &decision.mutation {
        Mutation::Reserve(a) | Mutation::Update(a) => a.dispatch_body_sha256.clone(),
        Mutation::None => None,
    };
    let mut response = decision.response;
    if let AuthorizeResponse::Dispatch { credential: c, .. } = &mut response {
        *c = credential;
    }
    let signed_by = match key.as_deref() {
        Some(key) => {
            match signing::sign_answer(&req, &mut response, key, now, recorded_body.as_deref()) {
                Ok(true) => {
                    state.metrics.dispatches_signed.inc();
                    Some(key.kid())
                }
                Ok(false) => None,
                Err(e) => return internal(&state, "sign", &e),
            }
        }
        None => None,
    };
    state
        .metrics
        .authorize_seconds
        .observe(started.elapsed().as_secs_f64());
    if let Some(headroom) = &decision.headroom {
        state.metrics.observe_headroom(headroom);
    }
    for n in &decision.notices {
        match n {
            Notice::DuplicateLogged { earlier_attempt_id } => {
                state
                    .metrics
                    .duplicates
                    .with_label_values(&[GuardMode::Log.as_str()])
                    .inc();
                warn!(permit_id, tool = %req.tool, earlier_attempt_id = %earlier_attempt_id,
                    "duplicate request suspected: new key, same fingerprint as a recent attempt; dispatching (guard=log)");
            }
            Notice::DuplicateDenied { earlier_attempt_id } => {
                state
                    .metrics
                    .duplicates
                    .with_label_values(&[GuardMode::Enforce.as_str()])
                    .inc();
                warn!(permit_id, tool = %req.tool, earlier_attempt_id = %earlier_attempt_id,
                    "duplicate request suspected: denied (guard=enforce)");
            }
        }
    }
    match &response {
        AuthorizeResponse::Dispatch { attempt_id, .. } => {
            state
                .metrics
                .authorize
                .with_label_values(&["dispatch", "none"])
                .inc();
            let (credential, version) = used
                .as_ref()
                .map_or(("-", 0), |u| (u.name.as_str(), u.version));
            info!(permit_id, tool = %req.tool, attempt_id = %attempt_id, decision = "dispatch",
                kid = signed_by.unwrap_or("-"), credential, credential_version = version, "authorize");
        }
        AuthorizeResponse::Replay { attempt_id, .. } => {
            state
                .metrics
                .authorize
                .with_label_values(&["replay", "none"])
                .inc();
            info!(permit_id, tool = %req.tool, attempt_id = %attempt_id, decision = "replay", "authorize");
        }
        AuthorizeResponse::Deny(d) => {
            state
                .metrics
                .authorize
                .with_label_values(&["deny", d.code.as_str()])
                .inc();
            info!(permit_id, tool = %req.tool, decision = "deny", code = d.code.as_str(), "authorize");
        }
    }
    (StatusCode::OK, Json(response)).into_response()
}

/// The answer to a call that names a dispatch target when no key can sign: denied
/// `gateway_unavailable`, as when the store is down, before anything is decided or written.
fn unsignable(state: &AppState, permit_id: &str, tool: &str, e: &KeyUnavailable) -> Response {
    state
        .metrics
        .store_errors
        .with_label_values(&["signing_key"])
        .inc();
    state
        .metrics
        .authorize
        .with_label_values(&["deny", DenialCode::GatewayUnavailable.as_str()])
        .inc();
    error!(permit_id, tool, error = %e,
        "no signing key can be read: call denied gateway_unavailable, nothing reserved");
    let denial = Denial::new(
        DenialCode::GatewayUnavailable,
        "the ledger cannot sign a dispatch now; nothing was reserved or sent",
    );
    (StatusCode::OK, Json(AuthorizeResponse::Deny(denial))).into_response()
}

/// `GET /v1/keys`: the public keys of every published signing key, as a JWK Set. No
/// authentication: a verifier needs nothing but this.
async fn published_keys(State(state): State<Shared>) -> Response {
    let now = state.clock.now_ms();
    let keys = match state.store.published_signing_keys(now).await {
        Ok(k) => k,
        Err(e) => return internal(&state, "published_keys", &e),
    };
    let jwks = match keys.iter().map(PublicSigningKey::jwk).collect() {
        Ok(keys) => Jwks { keys },
        Err(e) => return internal(&state, "published_keys", &e),
    };
    let body = match serde_json::to_vec(&jwks) {
        Ok(b) => b,
        Err(e) => return internal(&state, "published_keys", &LedgerError::from(e)),
    };
    (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "application/jwk-set+json".to_string()),
            (header::CACHE_CONTROL, format!("max-age={KEYS_MAX_AGE_S}")),
        ],
        body,
    )
        .into_response()
}

async fn list_keys(State(state): State<Shared>) -> Response {
    let now = state.clock.now_ms();
    match state.store.signing_keys().await {
        Ok(keys) => Json(KeyListResponse {
            keys: keys.iter().map(|k| KeyView::new(k, now)).collect(),
        })
        .into_response(),
        Err(e) => internal(&state, "signing_keys", &e),
    }
}

async fn rotate_key(State(state): State<Shared>) -> Response {
    let now = state.clock.now_ms();
    match state.signer.rotate(&*state.store, now).await {
        Ok((key, retired)) => {
            state.metrics.key_rotations.inc();
            info!(
                kid = key.kid(),
                retired_kid = retired.as_ref().map_or("-", |r| r.kid.as_str()),
                "signing key rotated"
            );
            Json(KeyRotateResponse {
                key: KeyView::new(key.public(), now),
                retired: retired.as_ref().map(|r| KeyView::new(r, now)),
            })
            .into_response()
        }
        Err(e) => internal(&state, "rotate_key", &e),
    }
}

/// `POST /admin/v1/inbox/sessions/revoke`: ends every inbox session, on every replica (the
/// store holds them); each person signs in again.
async fn revoke_inbox_sessions(State(state): State<Shared>) -> Response {
    let now = state.clock.now_ms();
    match state.store.end_all_inbox_sessions(now).await {
        Ok(revoked) => {
            info!(revoked, "inbox sessions revoked");
            Json(SessionsRevokeResponse { revoked }).into_response()
        }
        Err(e) => internal(&state, "inbox_sessions_revoke", &e),
    }
}

/// `POST /v1/limits`: what the permit still allows for each tool a `tools/list` answer names.
/// Read-only; the figures are the stored counters at the moment of the call. A token that
/// does not authenticate is answered 403 `permit_invalid`.
async fn limits(
    State(state): State<Shared>,
    body: Result<Json<LimitsRequest>, JsonRejection>,
) -> Response {
    let Json(req) = match body {
        Ok(b) => b,
        Err(r) => return json_rejection(r),
    };
    if req.tools.len() > MAX_LIMITS_TOOLS {
        return bad_request(format!(
            "at most {MAX_LIMITS_TOOLS} tools per request, not {}",
            req.tools.len()
        ));
    }
    let now = state.clock.now_ms();
    let permit_id = token::permit_id_of(&req.permit_token);
    let permit = match permit_of(&state, &req.permit_token).await {
        Ok(p) => p,
        Err(e) => return internal(&state, "limits", &e),
    };
    let counters = match permit.as_ref() {
        Some(p) if decide::authenticate(&req.permit_token, Some(p)).is_some() => {
            match state.store.permit_counters(&p.id).await {
                Ok(c) => c.unwrap_or_default(),
                Err(e) => return internal(&state, "limits", &e),
            }
        }
        _ => Default::default(),
    };
    let count = |n: i64| u64::try_from(n).unwrap_or(0);
    let answer = decide::limits_answer(
        &req,
        permit.as_ref(),
        |tool| count(counters.slots_held.get(tool).copied().unwrap_or(0)),
        BudgetTotals {
            reserved: count(counters.reserved),
            spent: count(counters.spent),
        },
        now,
    );
    let permit_id = permit_id.unwrap_or("-");
    match answer {
        Some(answer) => {
            info!(permit_id, tools = req.tools.len(), "limits");
            (StatusCode::OK, Json(answer)).into_response()
        }
        None => {
            info!(permit_id, code = "permit_invalid", "limits refused");
            error_response(StatusCode::FORBIDDEN, "permit_invalid", None)
        }
    }
}

/// The permit whose id the token names (authenticated or not), `None` when it names none.
pub(crate) async fn permit_of(
    state: &AppState,
    permit_token: &str,
) -> Result<Option<atmost_ledger::model::Permit>, LedgerError> {
    match token::permit_id_of(permit_token) {
        Some(id) => state.store.get_permit(id).await,
        None => Ok(None),
    }
}

async fn outcomes(
    State(state): State<Shared>,
    body: Result<Json<OutcomesRequest>, JsonRejection>,
) -> Response {
    let Json(mut req) = match body {
        Ok(b) => b,
        Err(r) => return json_rejection(r),
    };
    // Whether a verifier's refusal is proven is the keys' to say, never the report's.
    state
        .config
        .tool_refusal_keys
        .check_reports(&mut req.reports);
    let mut acks = Vec::with_capacity(req.reports.len());
    // Every report of the request in one store call (one transaction where the store can).
    let now = state.clock.now_ms();
    let results = match state.store.record_outcomes(&req.reports, now).await {
        Ok(r) if r.len() == req.reports.len() => r,
        Ok(_) => {
            let e =
                LedgerError::Invariant("the store answered a different number of reports".into());
            return internal(&state, "outcome", &e);
        }
        Err(e) => return internal(&state, "outcome", &e),
    };
    for (report, result) in req.reports.iter().zip(results) {
        let kind = report.outcome.kind();
        state
            .metrics
            .outcomes
            .with_label_values(&[kind, result.ack.as_str()])
            .inc();
        let reason = match &report.outcome {
            Outcome::Released { reason } | Outcome::Uncertain { reason } => reason.as_str(),
            Outcome::RefusedAtTool { refusal, .. } => refusal.as_str(),
            Outcome::Completed { .. }
            | Outcome::InputRequired { .. }
            | Outcome::Accepted { .. } => "",
        };
        match result.ack {
            OutcomeAck::Conflict => warn!(
                attempt_id = %report.attempt_id, reported = kind,
                current = result.previous.map(AttemptState::as_str).unwrap_or("-"),
                reason, "outcome conflicts with the attempt's state; state kept"
            ),
            OutcomeAck::UnknownAttempt => {
                warn!(attempt_id = %report.attempt_id, reported = kind, "outcome for unknown attempt")
            }
            OutcomeAck::Refused => {
                state
                    .metrics
                    .outcomes_refused
                    .with_label_values(&[kind])
                    .inc();
                // The capability is a secret: never logged.
                warn!(attempt_id = %report.attempt_id, reported = kind, round = report.round,
                    "outcome refused: no capability for the attempt's current round; state kept")
            }
            OutcomeAck::StaleRound => info!(
                attempt_id = %report.attempt_id, reported = kind, round = report.round,
                "outcome for an earlier round of the attempt; state kept"
            ),
            _ => {
                info!(attempt_id = %report.attempt_id, outcome = kind, reason, ack = result.ack.as_str(), "outcome")
            }
        }
        acks.push(result.ack);
    }
    (StatusCode::OK, Json(OutcomesResponse { acks })).into_response()
}

async fn create_permit(
    State(state): State<Shared>,
    body: Result<Json<CreatePermitRequest>, JsonRejection>,
) -> Response {
    let Json(req) = match body {
        Ok(b) => b,
        Err(r) => return json_rejection(r),
    };
    if let Some(name) = req.policy.rules.credential.as_deref() {
        if let Err(refused) = credentials::check_named(&state, name).await {
            return refused;
        }
    }
    let now = state.clock.now_ms();
    let (permit, tok) = match req.issue(now) {
        Ok(p) => p,
        Err(e) => return bad_request(e.to_string()),
    };
    if let Err(e) = state.store.create_permit(&permit).await {
        return internal(&state, "create_permit", &e);
    }
    state.metrics.permits_created.inc();
    info!(permit_id = %permit.id, label = %permit.label, "permit created");
    (
        StatusCode::CREATED,
        Json(CreatePermitResponse {
            permit: PermitView::new(&permit, now),
            token: tok,
        }),
    )
        .into_response()
}

async fn list_permits(State(state): State<Shared>) -> Response {
    let now = state.clock.now_ms();
    match state.store.list_permits().await {
        Ok(ps) => Json(PermitListResponse {
            permits: ps.iter().map(|p| PermitView::new(p, now)).collect(),
        })
        .into_response(),
        Err(e) => internal(&state, "list_permits", &e),
    }
}

async fn show_permit(State(state): State<Shared>, Path(id): Path<String>) -> Response {
    let now = state.clock.now_ms();
    match state.store.permit_detail(&id).await {
        Ok(Some(d)) => Json(PermitShowResponse::new(&d, now)).into_response(),
        Ok(None) => not_found("unknown_permit"),
        Err(e) => internal(&state, "permit_detail", &e),
    }
}

async fn revoke_permit(State(state): State<Shared>, Path(id): Path<String>) -> Response {
    let now = state.clock.now_ms();
    match state.store.revoke_permit(&id, now).await {
        Ok(Some(p)) => {
            state.metrics.permits_revoked.inc();
            info!(permit_id = %p.id, "permit revoked");
            Json(PermitResponse {
                permit: PermitView::new(&p, now),
            })
            .into_response()
        }
        Ok(None) => not_found("unknown_permit"),
        Err(e) => internal(&state, "revoke_permit", &e),
    }
}

#[derive(Debug, Deserialize)]
struct AttemptQuery {
    state: Option<String>,
    permit: Option<String>,
    limit: Option<u32>,
}

impl AttemptQuery {
    /// The filter the query names; the message of a bad `state`.
    fn filter(self) -> Result<AttemptFilter, String> {
        let st = match self
            .state
            .as_deref()
            .filter(|s| !s.is_empty())
            .map(str::parse::<AttemptState>)
        {
            None => None,
            Some(Ok(s)) => Some(s),
            Some(Err(m)) => return Err(m),
        };
        Ok(AttemptFilter {
            state: st,
            permit_id: self.permit.filter(|p| !p.is_empty()),
            limit: self.limit,
        })
    }
}

async fn list_attempts(State(state): State<Shared>, Query(q): Query<AttemptQuery>) -> Response {
    let filter = match q.filter() {
        Ok(f) => f,
        Err(m) => return bad_request(m),
    };
    match state.store.list_attempts(&filter).await {
        Ok(list) => Json(AttemptListResponse {
            attempts: list
                .iter()
                .map(|a| AttemptView::new(a, &state.config.redaction))
                .collect(),
        })
        .into_response(),
        Err(e) => internal(&state, "list_attempts", &e),
    }
}

/// `GET /admin/v1/attempts/export`: the attempts [`list_attempts`] would list, each as a
/// receipt signed by the active key.
async fn export_attempts(State(state): State<Shared>, Query(q): Query<AttemptQuery>) -> Response {
    let filter = match q.filter() {
        Ok(f) => f,
        Err(m) => return bad_request(m),
    };
    let key = match state.signer.active(&*state.store).await {
        Ok(k) => k,
        Err(KeyUnavailable::Store(e)) => return internal(&state, "export_attempts", &e),
        Err(e @ KeyUnavailable::NoActiveKey) => {
            error!(error = %e, "receipts cannot be signed");
            return error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "no_signing_key",
                Some(e.to_string()),
            );
        }
    };
    let attempts = match state.store.list_attempts(&filter).await {
        Ok(list) => list,
        Err(e) => return internal(&state, "export_attempts", &e),
    };
    let now = state.clock.now_ms();
    let mut receipts = Vec::with_capacity(attempts.len());
    for a in &attempts {
        let claims = ReceiptClaims::new(a, &state.config.receipt_issuer, now);
        match sign_receipt(&key, &claims) {
            Ok(jws) => receipts.push(jws),
            Err(e) => return internal(&state, "export_attempts", &e),
        }
    }
    info!(
        count = receipts.len(),
        kid = key.kid(),
        "attempts exported as signed receipts"
    );
    Json(ReceiptExportResponse {
        kid: key.kid().to_string(),
        receipts,
    })
    .into_response()
}

async fn show_attempt(State(state): State<Shared>, Path(id): Path<String>) -> Response {
    match state.store.get_attempt(&id).await {
        Ok(Some(a)) => Json(AttemptResponse {
            attempt: AttemptView::new(&a, &state.config.redaction),
        })
        .into_response(),
        Ok(None) => not_found("unknown_attempt"),
        Err(e) => internal(&state, "get_attempt", &e),
    }
}

async fn resolve_attempt(
    State(state): State<Shared>,
    Path(id): Path<String>,
    body: Result<Json<ResolveInput>, JsonRejection>,
) -> Response {
    let Json(input) = match body {
        Ok(b) => b,
        Err(r) => return json_rejection(r),
    };
    if let Err(e) = input.check() {
        return bad_request(e.to_string());
    }
    let now = state.clock.now_ms();
    match state.store.resolve_attempt(&id, &input, now).await {
        Ok(a) => {
            resolved(&state, &a, &input, "api");
            Json(AttemptResponse {
                attempt: AttemptView::new(&a, &state.config.redaction),
            })
            .into_response()
        }
        Err(ResolveError::UnknownAttempt) => not_found("unknown_attempt"),
        Err(ResolveError::NotUncertain(s)) => error_response(
            StatusCode::CONFLICT,
            "not_uncertain",
            Some(format!(
                "attempt is {s}; only uncertain attempts can be resolved"
            )),
        ),
        Err(ResolveError::Ledger(e)) => internal(&state, "resolve_attempt", &e),
    }
}

/// Counts and logs a resolution the store applied; `via` names the way it came (`api`,
/// `inbox`).
pub fn resolved(state: &AppState, a: &Attempt, input: &ResolveInput, via: &str) {
    let result = if input.executed {
        "executed"
    } else {
        "not_executed"
    };
    state.metrics.resolutions.with_label_values(&[result]).inc();
    info!(attempt_id = %a.id, permit_id = %a.permit_id, result, by = %input.by,
        source = input.source.as_str(), via, "attempt resolved");
}

/// Counts and logs a failed store operation of the sweeper (`op`: `sweep`, `purge`); the next
/// sweep tries again.
fn sweeper_failed(state: &AppState, op: &str, e: &LedgerError) {
    state.metrics.store_errors.with_label_values(&[op]).inc();
    error!(error = %e, op, "sweeper store operation failed");
}

/// One sweep: expired leases → uncertain, old receipts → tombstones, the history of permits
/// ended long enough ago purged.
pub async fn sweep_once(state: &AppState) {
    let now = state.clock.now_ms();
    state.metrics.sweeps.inc();
    match state.store.sweep(now).await {
        Ok(r) => {
            state.metrics.leases_expired.inc_by(r.leases_expired);
            state.metrics.receipts_pruned.inc_by(r.receipts_pruned);
            if r.leases_expired > 0 || r.receipts_pruned > 0 {
                info!(
                    leases_expired = r.leases_expired,
                    receipts_pruned = r.receipts_pruned,
                    "sweep"
                );
            }
        }
        Err(e) => sweeper_failed(state, "sweep", &e),
    }
    if let Some(after) = state.config.purge_ended_permits_after {
        let after_ms = i64::try_from(after.as_millis()).unwrap_or(i64::MAX);
        match state
            .store
            .purge(now.saturating_sub(after_ms), PURGE_PER_SWEEP)
            .await
        {
            Ok(r) => {
                state.metrics.attempts_purged.inc_by(r.attempts_purged);
                state.metrics.permits_purged.inc_by(r.permits_purged);
                if r.attempts_purged > 0 || r.permits_purged > 0 {
                    info!(
                        attempts_purged = r.attempts_purged,
                        permits_purged = r.permits_purged,
                        "purge"
                    );
                }
            }
            Err(e) => sweeper_failed(state, "purge", &e),
        }
    }
}

/// How often, at most, a scrape of `/metrics` reads the store's gauges: however many
/// scrapers (or callers: `/metrics` needs no token), one read a second per replica.
const STORE_GAUGES_MIN_INTERVAL: Duration = Duration::from_secs(1);

/// Reads the gauges that come from the store (`atmost_attempts{state}`,
/// `atmost_uncertain_oldest_seconds`) when `/metrics` is scraped, instead of on every sweep.
/// Their reads grow with the store: on PostgreSQL the attempts per state are summed over one
/// row per permit and state, 28 ms at 10^5 permits. Read once a second whatever the load, that
/// was the largest cost PostgreSQL paid per call as permits piled up (docs/performance.md);
/// read when scraped it costs nothing when nobody scrapes, and one read per scrape interval
/// when Prometheus does. A scrape that finds the store failing serves the values last read
/// and counts `atmost_store_errors_total{op}`.
async fn refresh_store_gauges(state: &AppState) {
    let mut read_at = state.store_gauges_read_at.lock().await;
    if read_at.is_some_and(|at| at.elapsed() < STORE_GAUGES_MIN_INTERVAL) {
        return;
    }
    *read_at = Some(Instant::now());
    read_store_gauges(state).await;
}

/// Reads the store's gauges now (see [`refresh_store_gauges`], which calls it).
pub async fn read_store_gauges(state: &AppState) {
    let now = state.clock.now_ms();
    match state.store.attempt_counts().await {
        Ok(counts) => {
            for (s, n) in counts {
                state
                    .metrics
                    .attempts
                    .with_label_values(&[s.as_str()])
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
            }
        }
        Err(e) => {
            state
                .metrics
                .store_errors
                .with_label_values(&["attempt_counts"])
                .inc();
            error!(error = %e, "attempt counts failed");
        }
    }
    match state.store.oldest_uncertain().await {
        Ok(oldest) => {
            let ms = oldest.map_or(0, |t| now.saturating_sub(t).max(0));
            state
                .metrics
                .uncertain_oldest_seconds
                .set(ms as f64 / 1000.0);
        }
        Err(e) => {
            state
                .metrics
                .store_errors
                .with_label_values(&["oldest_uncertain"])
                .inc();
            error!(error = %e, "oldest uncertain attempt could not be read");
        }
    }
}

/// Runs the sweeper every `interval` until the task is dropped.
pub fn spawn_sweeper(state: Shared, interval: Duration) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval.max(Duration::from_millis(10)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            sweep_once(&state).await;
        }
    })
}
