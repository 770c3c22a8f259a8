//! The answers every handler shares (errors, refusals) and who may call: the service token and
//! the admins' (crate::admins), the failure limiter, the caller's address, the permit a token names.

use std::net::SocketAddr;
use std::time::Instant;

use axum::extract::rejection::JsonRejection;
use axum::extract::{ConnectInfo, FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use tracing::{error, info};

use crate::auth_limit::Verdict;
use crate::state::{AppState, Shared};
use atmost_ledger::error::LedgerError;
use atmost_ledger::token;
use atmost_protocol::ledger_error::{LedgerErrorBody, LedgerErrorCode};

/// The error answer `code` names, at the status it is sent with: every error answer of the
/// ledger is built here, so none can pair a code with another status or spell it another way.
pub(crate) fn error_response(code: LedgerErrorCode, message: Option<String>) -> Response {
    // Every status of the set is a valid one; a 500 stands in should one ever not be.
    let status =
        StatusCode::from_u16(code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        status,
        Json(LedgerErrorBody {
            error: code,
            message,
        }),
    )
        .into_response()
}

pub(crate) fn bad_request(message: impl Into<String>) -> Response {
    error_response(LedgerErrorCode::BadRequest, Some(message.into()))
}

/// A store failure. A transient one (the store is down, timed out, read-only, full or failing
/// over: [`LedgerError::is_transient`]) answers 503 `store_unavailable`, which the filter turns
/// into `gateway_unavailable`, so nothing is dispatched on a decision that was not committed.
/// Anything else is a bug or bad data, not an outage: 500 `internal`, logged as such.
pub(crate) fn internal(state: &AppState, op: &str, e: &LedgerError) -> Response {
    state.metrics.store_errors.with_label_values(&[op]).inc();
    if e.is_transient() {
        error!(op, error = %e, "store unavailable");
        return error_response(LedgerErrorCode::StoreUnavailable, None);
    }
    error!(op, error = %e, bug = true, "store operation failed on a broken invariant");
    error_response(LedgerErrorCode::Internal, None)
}

pub(crate) fn json_rejection(r: JsonRejection) -> Response {
    bad_request(r.body_text())
}

pub(crate) fn bearer(headers: &HeaderMap) -> Option<&str> {
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
        LedgerErrorCode::TooManyFailures,
        Some(format!(
            "too many failed authentications from this address; retry after {retry_after_s} s"
        )),
    );
    resp.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(retry_after_s));
    resp
}

pub(crate) fn unauthorized(state: &AppState, api: &str, peer: Option<SocketAddr>) -> Response {
    match failed_authentication(state, api, peer) {
        Verdict::Refuse => error_response(LedgerErrorCode::Unauthorized, None),
        Verdict::TooMany { retry_after_s } => too_many_failures(retry_after_s),
    }
}

pub(crate) async fn require_service(
    State(state): State<Shared>,
    req: Request,
    next: Next,
) -> Response {
    match bearer(req.headers()) {
        Some(t) if token::secrets_equal(t, &state.config.service_token) => next.run(req).await,
        _ => unauthorized(&state, "service", peer(&req)),
    }
}

/// Lets through a request whose bearer token is an admin's, with that admin
/// ([`crate::admins::AuthenticatedAdmin`]) among its extensions, and logs it under the admin's name once
/// answered: what each admin did is in the log whichever handler served it.
pub(crate) async fn require_admin(
    State(state): State<Shared>,
    mut req: Request,
    next: Next,
) -> Response {
    let Some(admin) = bearer(req.headers()).and_then(|t| state.config.admins.authenticate(t))
    else {
        return unauthorized(&state, "admin", peer(&req));
    };
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    req.extensions_mut().insert(admin.clone());
    let resp = next.run(req).await;
    info!(admin = %admin.name, method = %method, path = %path, status = resp.status().as_u16(),
        "admin request");
    resp
}

/// What the API listener answers under `/admin`: the admin API and the inbox are served on the
/// admin listener only (`--admin-listen`).
pub(crate) async fn admin_elsewhere() -> Response {
    error_response(
        LedgerErrorCode::AdminElsewhere,
        Some("the admin API and the inbox answer on the ledger's admin listener (--admin-listen), not on this one".into()),
    )
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
