//! The ledger's two routers, the API listener's and the admin listener's (served over
//! HTTP/1.1 and h2c prior knowledge), and the handlers of the filter's API and the admin API;
//! the credentials and the inbox bring their own, and what every handler shares lies beneath
//! (crate::state, crate::access).

use std::time::{Duration, Instant};

use atmost_protocol::credential::CREDENTIAL_PATH;
use atmost_protocol::ledger_error::LedgerErrorCode;
use atmost_protocol::signature::{Jwks, KEYS_PATH};
use atmost_protocol::{
    AuthorizeAnswer, AuthorizeRequest, AuthorizeResponse, Denial, DenialCode, LimitsRequest,
    AUTHORIZE_PATH, CALLOUT_TIMEOUT_HEADER, LIMITS_PATH, MAX_LIMITS_TOOLS, MAX_RIDING_REPORTS,
    OUTCOMES_PATH,
};
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post, put};
use axum::{Extension, Json, Router};
use serde::Deserialize;
use tracing::{error, info, warn};

use crate::access::{
    admin_elsewhere, bad_request, error_response, internal, json_rejection, permit_of,
    require_admin, require_service,
};
use crate::admins::AuthenticatedAdmin;
use crate::api::{
    self, AttemptListResponse, AttemptResponse, AttemptView, CreatePermitRequest,
    CreatePermitResponse, KeyListResponse, KeyRotateResponse, KeyView, PermitListResponse,
    PermitResponse, PermitShowResponse, PermitView, ReceiptExportResponse, SessionsRevokeResponse,
};
use crate::approvals;
use crate::credentials;
use crate::inbox;
use crate::reports;
use crate::resolution::resolved;
use crate::signer::KeyUnavailable;
use crate::state::{AppState, Shared};
use crate::sweeper::refresh_store_gauges;
use atmost_ledger::clock::Deadline;
use atmost_ledger::decide::{self, Mutation, Notice, ResolveInput};
use atmost_ledger::error::{LedgerError, ResolveError};
use atmost_ledger::keys::PublicSigningKey;
use atmost_ledger::model::{AttemptState, BudgetTotals, GuardMode};
use atmost_ledger::receipts::{sign_receipt, ReceiptClaims};
use atmost_ledger::store::AttemptFilter;
use atmost_ledger::{signing, token};

/// Largest request body accepted (receipts ride in outcome reports).
pub const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;

/// How long a client may keep `GET /v1/keys`'s answer (`cache-control: max-age`). A new key
/// signs as soon as it is made, so a verifier meeting an unknown `keyid` should fetch again.
pub const KEYS_MAX_AGE_S: u64 = 60;

/// The routes of the API listener (`--listen`): the filter's API, `/v1/keys`, `/metrics` and
/// the health checks.
pub fn api_router(state: Shared) -> Router {
    let service = Router::new()
        .route(AUTHORIZE_PATH, post(authorize))
        .route(OUTCOMES_PATH, post(reports::outcomes))
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
        .merge(approvals::routes())
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
            LedgerErrorCode::Draining,
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
        error_response(LedgerErrorCode::StoreUnavailable, None)
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
    let Json(mut req) = match body {
        Ok(b) => b,
        Err(r) => return json_rejection(r),
    };
    if let Err(why) = decide::check_forwarded(&req) {
        return bad_request(why);
    }
    if let Err(e) = signing::check_dispatch(&req) {
        return bad_request(e.to_string());
    }
    if req.reports.len() > MAX_RIDING_REPORTS {
        return bad_request(format!(
            "reports: at most {MAX_RIDING_REPORTS} ride on one authorize"
        ));
    }
    let riding = std::mem::take(&mut req.reports);
    if riding.is_empty() {
        return match decide_call(&state, &req, timeout, deadline).await {
            Ok(decision) => (StatusCode::OK, Json(decision)).into_response(),
            Err(refused) => refused,
        };
    }
    // Side by side: on SQLite both reach the writer's turn and share its commit; on
    // PostgreSQL each goes to its own group. The answer waits for the reports no longer than
    // the decision may take: a decision committed in time is answered in time, without the
    // acks of reports still being applied (the filter sends those again).
    let riders = tokio::time::timeout_at(
        deadline.instant().into(),
        reports::apply_riding(&state, riding),
    );
    let (decided, report_acks) = tokio::join!(decide_call(&state, &req, timeout, deadline), riders);
    let report_acks = report_acks.ok().flatten();
    match decided {
        Ok(decision) => (
            StatusCode::OK,
            Json(AuthorizeAnswer {
                decision,
                report_acks,
            }),
        )
            .into_response(),
        Err(refused) => refused,
    }
}

/// Decides one call and signs its dispatch: the answer, or the error answer that goes
/// instead.
async fn decide_call(
    state: &Shared,
    req: &AuthorizeRequest,
    timeout: Duration,
    deadline: Deadline,
) -> Result<AuthorizeResponse, Response> {
    let started = Instant::now();
    let permit_id = token::permit_id_of(&req.permit_token).unwrap_or("-");
    // The key comes before the decision: a dispatch the ledger cannot sign is never reserved.
    let key = match req.dispatch {
        None => None,
        Some(_) => match state.signer.active(&*state.store).await {
            Ok(key) => Some(key),
            Err(e) => return Err(unsignable(state, permit_id, &req.tool, &e)),
        },
    };
    // Read and opened before the decision: a credential that cannot be sent reserves nothing.
    let credential = match credentials::for_dispatch(state, &req.permit_token).await {
        Ok(c) => c,
        Err(e) => return Err(internal(state, "credential", &e)),
    };
    let (used, credential) = credential.unzip();
    let now = state.clock.now_ms();
    let decision = match state
        .store
        .authorize_with(req, used.clone(), state.leases(), now, deadline)
        .await
    {
        Ok(d) => d,
        Err(LedgerError::DeadlinePassed(why)) => {
            state.metrics.decisions_past_deadline.inc();
            warn!(permit_id, tool = %req.tool, timeout_ms = timeout.as_millis() as u64, why,
                "authorize not committed: the caller's deadline passed (answered 503)");
            return Err(error_response(LedgerErrorCode::StoreUnavailable, None));
        }
        Err(e) => return Err(internal(state, "authorize", &e)),
    };
    // Signed after the store answered: no permit's lock is held while it signs, and only over
    // the body the attempt it wrote records.
    if let Mutation::Reserve(a) = &decision.mutation {
        if a.state == AttemptState::AwaitingApproval {
            info!(permit_id, tool = %req.tool, attempt_id = %a.id, cost = a.cost,
                "approval requested: the call waits for a person, nothing sent");
            let (state, asked) = (state.clone(), a.clone());
            tokio::spawn(async move { approvals::announce(&state, &asked).await });
        }
    }
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
            match signing::sign_answer(req, &mut response, key, now, recorded_body.as_deref()) {
                Ok(true) => {
                    state.metrics.dispatches_signed.inc();
                    Some(key.kid())
                }
                Ok(false) => None,
                Err(e) => return Err(internal(state, "sign", &e)),
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
    Ok(response)
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
            let code = LedgerErrorCode::PermitInvalid;
            info!(permit_id, code = code.as_str(), "limits refused");
            error_response(code, None)
        }
    }
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
        Ok(None) => error_response(LedgerErrorCode::UnknownPermit, None),
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
        Ok(None) => error_response(LedgerErrorCode::UnknownPermit, None),
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
            return error_response(LedgerErrorCode::NoSigningKey, Some(e.to_string()));
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
        Ok(None) => error_response(LedgerErrorCode::UnknownAttempt, None),
        Err(e) => internal(&state, "get_attempt", &e),
    }
}

async fn resolve_attempt(
    State(state): State<Shared>,
    Path(id): Path<String>,
    Extension(admin): Extension<AuthenticatedAdmin>,
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
            resolved(&state, &a, &input, "api", Some(&admin.name));
            Json(AttemptResponse {
                attempt: AttemptView::new(&a, &state.config.redaction),
            })
            .into_response()
        }
        Err(ResolveError::UnknownAttempt) => error_response(LedgerErrorCode::UnknownAttempt, None),
        Err(ResolveError::NotUncertain(s)) => error_response(
            LedgerErrorCode::NotUncertain,
            Some(format!(
                "attempt is {s}; only uncertain attempts can be resolved"
            )),
        ),
        Err(ResolveError::Ledger(e)) => internal(&state, "resolve_attempt", &e),
    }
}
