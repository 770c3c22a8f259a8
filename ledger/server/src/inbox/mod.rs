//! The reconciliation inbox: web pages under `/admin/` on the ledger's listener, for people
//! who check uncertain calls with the provider and record what they found.
//!
//! Server-rendered (askama templates in `ledger/server/templates/inbox/`), one stylesheet, no
//! scripts, no third-party host. Sign-in takes the admin token (in a form body, never a URL)
//! and gives a signed session cookie ([`session`]); every form that changes state carries
//! the session's CSRF token; every page is sent with a strict Content-Security-Policy.
//! Resolving goes through the store's one resolve operation, so slots and budget move
//! exactly as for `atmost attempts resolve`.

pub mod figures;
pub mod session;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::time::Duration;

use askama::Template;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use axum_extra::extract::cookie::Key;
use serde::Deserialize;
use tracing::{error, info, warn};

use crate::access::{failed_authentication, Peer};
use crate::api::{key_carriers_text, PermitShowResponse};
use crate::auth_limit::Verdict;
use crate::resolution::resolved;
use crate::state::{AppState, Shared};
use atmost_ledger::clock::{self, Millis};
use atmost_ledger::decide::ResolveInput;
use atmost_ledger::error::ResolveError;
use atmost_ledger::model::{Attempt, AttemptState, KeyCarrier, Permit, ResolutionSource};
use atmost_ledger::token;
use figures::{PermitFigures, Timeline};
use session::{Presented, Session};

/// The pages' Content-Security-Policy: nothing but this origin's stylesheet, no scripts, no
/// frames, forms posting to this origin only.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; style-src 'self'; img-src 'self'; \
     form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// Most open attempts one inbox page lists (oldest first), resolved ones the history lists,
/// and permits the permits page shows.
pub const PAGE_LIMIT: u32 = 200;
/// Longest note accepted with a resolution, in characters.
pub const MAX_NOTE_CHARS: usize = 2000;

/// How a person knows each place a key can go.
fn carrier_label(c: KeyCarrier) -> &'static str {
    match c {
        KeyCarrier::Header => "the Idempotency-Key header",
        KeyCarrier::Meta => "params._meta[\"dev.atmost/idempotency-key\"]",
        KeyCarrier::IdempotencyKeyParam => "params.idempotencyKey",
    }
}

/// What a person reads before choosing "not executed" when the provider could not have seen
/// the call under its forwarded key in the form its lookup searches (`form`): a search there
/// by that value finds nothing whether or not the call ran. `None` when the key reached that
/// form, or no key was forwarded (there is nothing to search by).
pub fn key_warning(a: &Attempt, form: KeyCarrier, from_rule: bool) -> Option<String> {
    a.forwarded_key.as_ref()?;
    if a.forwarded_key_carriers.contains(form) {
        return None;
    }
    let whose = if from_rule {
        " (where this tool's reconcile rule looks it up)"
    } else {
        ""
    };
    let what = if a.forwarded_key_carriers.is_empty() {
        format!(
            "The gateway did not record where this key went, so it may not have reached the provider in {}{whose}",
            carrier_label(form)
        )
    } else {
        format!(
            "The provider received this key only in {}, not in {}{whose}",
            a.forwarded_key_carriers
                .iter()
                .map(carrier_label)
                .collect::<Vec<_>>()
                .join(" and "),
            carrier_label(form)
        )
    };
    Some(format!(
        "{what}: a search there by this value cannot find the call, so \"not found\" does not show that it did not run. Find it by its arguments and the time it was sent before choosing not executed."
    ))
}

fn millis(d: Duration) -> Millis {
    Millis::try_from(d.as_millis()).unwrap_or(Millis::MAX)
}

/// The inbox's routes (merged into the ledger's router, beside `/admin/v1/…`).
pub fn routes() -> Router<Shared> {
    Router::new()
        .route("/admin", get(|| async { Redirect::to("/admin/") }))
        .route("/admin/", get(inbox_page))
        .route("/admin/sign-in", get(sign_in_page).post(sign_in))
        .route("/admin/sign-out", post(sign_out))
        .route("/admin/history", get(history_page))
        .route("/admin/permits", get(permits_page))
        .route("/admin/attempts/{id}", get(attempt_page))
        .route("/admin/attempts/{id}/resolve", post(resolve))
        .route("/admin/inbox.css", get(stylesheet))
        .layer(axum::middleware::map_response(security_headers))
}

async fn security_headers(mut resp: Response) -> Response {
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

async fn stylesheet() -> Response {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        include_str!("inbox.css"),
    )
        .into_response()
}

/// The navigation of a signed-in page (and the sign-out form's CSRF token).
struct Nav {
    here: &'static str,
    name: String,
    csrf: String,
}

impl Nav {
    fn new(here: &'static str, s: &Session) -> Option<Nav> {
        Some(Nav {
            here,
            name: s.name.clone(),
            csrf: s.csrf.clone(),
        })
    }
}

#[derive(Template)]
#[template(path = "inbox/sign_in.html")]
struct SignInPage {
    nav: Option<Nav>,
    message: Option<String>,
    csrf: String,
    name: String,
}

#[derive(Template)]
#[template(path = "inbox/message.html")]
struct MessagePage {
    nav: Option<Nav>,
    heading: String,
    text: String,
}

/// One open attempt as the inbox shows it.
struct OpenItem {
    id: String,
    tool: String,
    permit_id: String,
    permit_label: String,
    /// `uncertain` or `awaiting_input`.
    state: &'static str,
    state_label: &'static str,
    uncertain: bool,
    waiting_for: String,
    since: String,
    sent_at: String,
    lease_ends: String,
    forwarded_key: Option<String>,
    key_went: String,
    key_warning: Option<String>,
    arguments: String,
    reason: Option<String>,
    cost: u64,
    round: u32,
}

#[derive(Template)]
#[template(path = "inbox/inbox.html")]
struct InboxPage {
    nav: Option<Nav>,
    csrf: String,
    message: Option<String>,
    items: Vec<OpenItem>,
    /// The page holds [`PAGE_LIMIT`] items: older ones may wait beyond it.
    more: bool,
}

/// One resolved attempt as the history shows it.
struct ResolvedItem {
    id: String,
    tool: String,
    permit_label: String,
    result: &'static str,
    result_class: &'static str,
    by: String,
    by_reconciler: bool,
    at: String,
    note: Option<String>,
    provider_answer: Option<String>,
    sent_at: String,
    forwarded_key: Option<String>,
    key_went: String,
}

#[derive(Template)]
#[template(path = "inbox/history.html")]
struct HistoryPage {
    nav: Option<Nav>,
    items: Vec<ResolvedItem>,
}

struct PermitItem {
    id: String,
    label: String,
    status: String,
    expires_at: String,
    figures: PermitFigures,
    open: u64,
}

/// One attempt on its own page.
struct AttemptDetail {
    id: String,
    tool: String,
    permit_id: String,
    permit_label: String,
    state: &'static str,
    uncertain: bool,
    sent_at: String,
    cost: u64,
    reason: Option<String>,
    forwarded_key: Option<String>,
    key_went: String,
    arguments: String,
    resolution_note: Option<String>,
}

#[derive(Template)]
#[template(path = "inbox/attempt.html")]
struct AttemptPage {
    nav: Option<Nav>,
    a: AttemptDetail,
    timeline: Timeline,
}

#[derive(Template)]
#[template(path = "inbox/permits.html")]
struct PermitsPage {
    nav: Option<Nav>,
    permits: Vec<PermitItem>,
}

fn html(status: StatusCode, page: &impl Template) -> Response {
    match page.render() {
        Ok(body) => (
            status,
            [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
            body,
        )
            .into_response(),
        Err(e) => {
            error!(error = %e, bug = true, "inbox page failed to render");
            (StatusCode::INTERNAL_SERVER_ERROR, "internal error").into_response()
        }
    }
}

fn message(status: StatusCode, nav: Option<Nav>, heading: &str, text: String) -> Response {
    html(
        status,
        &MessagePage {
            nav,
            heading: heading.into(),
            text,
        },
    )
}

/// The store failed: the page says so (and whether to retry), the log says why.
fn store_failed(state: &AppState, op: &str, e: &atmost_ledger::error::LedgerError) -> Response {
    state.metrics.store_errors.with_label_values(&[op]).inc();
    error!(op, error = %e, "inbox: store operation failed");
    let (status, text) = if e.is_transient() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "The ledger's store is unavailable right now; try again in a moment.",
        )
    } else {
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            "The ledger hit an internal error; its log has the details.",
        )
    };
    message(status, None, "Not available", text.into())
}

fn session_key(state: &AppState) -> Option<Key> {
    let key = session::key(&state.config.admin_token);
    if key.is_none() {
        error!(bug = true, "inbox: no session key could be derived");
    }
    key
}

fn key_failed() -> Response {
    message(
        StatusCode::INTERNAL_SERVER_ERROR,
        None,
        "Not available",
        "The ledger could not set up sessions; its log has the details.".into(),
    )
}

/// The sign-in page, with a fresh CSRF token for its form (and the cookie that holds it).
fn sign_in_form(
    state: &AppState,
    headers: &HeaderMap,
    status: StatusCode,
    message: Option<&str>,
    name: &str,
) -> Response {
    let Some(key) = session_key(state) else {
        return key_failed();
    };
    let csrf = match token::random_hex(32) {
        Ok(c) => c,
        Err(e) => return store_failed(state, "random", &e),
    };
    let secure = session::over_tls(headers, state.config.inbox.secure_cookies);
    let now = state.clock.now_ms();
    let jar = session::jar(&key, vec![session::sign_in_cookie(&csrf, now, secure)]);
    let page = SignInPage {
        nav: None,
        message: message.map(str::to_string),
        csrf,
        name: name.to_string(),
    };
    (jar, html(status, &page)).into_response()
}

/// The signed-in session of a request, or the response that refuses it: the sign-in page
/// (HTTP 401), saying so when the session has expired or was ended. (The refusal is the
/// response itself, returned at once by the handler; boxing it would buy nothing.)
#[allow(clippy::result_large_err)]
async fn signed_in(state: &AppState, headers: &HeaderMap) -> Result<Session, Response> {
    let Some(key) = session_key(state) else {
        return Err(key_failed());
    };
    let now = state.clock.now_ms();
    match session::presented(headers, &key, now) {
        Presented::Valid(s) => match state.store.inbox_session_open(&s.id_hash(), now).await {
            Ok(true) => Ok(s),
            Ok(false) => Err(sign_in_form(
                state,
                headers,
                StatusCode::UNAUTHORIZED,
                Some("Your session has ended: it was signed out or revoked. Sign in again."),
                "",
            )),
            Err(e) => Err(store_failed(state, "inbox_session", &e)),
        },
        Presented::Expired => Err(sign_in_form(
            state,
            headers,
            StatusCode::UNAUTHORIZED,
            Some("Your session has expired. Sign in again."),
            "",
        )),
        Presented::None => Err(sign_in_form(
            state,
            headers,
            StatusCode::UNAUTHORIZED,
            None,
            "",
        )),
    }
}

async fn sign_in_page(State(state): State<Shared>, headers: HeaderMap) -> Response {
    if let Some(key) = session_key(&state) {
        let now = state.clock.now_ms();
        if let Presented::Valid(s) = session::presented(&headers, &key, now) {
            if let Ok(true) = state.store.inbox_session_open(&s.id_hash(), now).await {
                return Redirect::to("/admin/").into_response();
            }
        }
    }
    sign_in_form(&state, &headers, StatusCode::OK, None, "")
}

#[derive(Debug, Deserialize)]
struct SignInForm {
    #[serde(default)]
    name: String,
    #[serde(default)]
    token: String,
    #[serde(default)]
    csrf: String,
}

async fn sign_in(
    State(state): State<Shared>,
    Peer(peer): Peer,
    headers: HeaderMap,
    Form(form): Form<SignInForm>,
) -> Response {
    let Some(key) = session_key(&state) else {
        return key_failed();
    };
    let now = state.clock.now_ms();
    let form_ok = session::sign_in_token(&headers, &key, now)
        .is_some_and(|t| !form.csrf.is_empty() && token::secrets_equal(&form.csrf, &t));
    if !form_ok {
        warn!("inbox: sign-in refused: the form's CSRF token is missing, wrong or expired");
        return sign_in_form(
            &state,
            &headers,
            StatusCode::FORBIDDEN,
            Some("This sign-in form has expired or was not sent from this page. Try again."),
            &form.name,
        );
    }
    if form.token.is_empty() || !token::secrets_equal(&form.token, &state.config.admin_token) {
        warn!("inbox: sign-in refused: wrong admin token");
        return match failed_authentication(&state, "inbox", peer) {
            Verdict::Refuse => sign_in_form(
                &state,
                &headers,
                StatusCode::UNAUTHORIZED,
                Some("That is not the admin token."),
                &form.name,
            ),
            Verdict::TooMany { retry_after_s } => {
                let mut page = sign_in_form(
                    &state,
                    &headers,
                    StatusCode::TOO_MANY_REQUESTS,
                    Some(&format!(
                        "Too many failed sign-ins from this address. Try again in {retry_after_s} seconds."
                    )),
                    &form.name,
                );
                page.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from(retry_after_s));
                page
            }
        };
    }
    let Some(name) = session::valid_name(&form.name) else {
        return sign_in_form(
            &state,
            &headers,
            StatusCode::BAD_REQUEST,
            Some("Give your name (1 to 64 characters): it is recorded with what you resolve."),
            "",
        );
    };
    let (csrf, id) = match (token::random_hex(32), token::random_hex(32)) {
        (Ok(c), Ok(i)) => (c, i),
        (Err(e), _) | (_, Err(e)) => return store_failed(&state, "random", &e),
    };
    let s = Session {
        name,
        id,
        csrf,
        expires_at_ms: now.saturating_add(millis(state.config.inbox.session_ttl)),
    };
    if let Err(e) = state
        .store
        .open_inbox_session(&s.id_hash(), now, s.expires_at_ms)
        .await
    {
        return store_failed(&state, "inbox_session", &e);
    }
    let secure = session::over_tls(&headers, state.config.inbox.secure_cookies);
    info!(by = %s.name, expires_at = %clock::rfc3339(s.expires_at_ms), "inbox: signed in");
    let jar = session::jar(
        &key,
        vec![
            session::session_cookie(&s, now, secure),
            session::removal(session::SIGN_IN_COOKIE, secure),
        ],
    );
    (jar, Redirect::to("/admin/")).into_response()
}

#[derive(Debug, Deserialize)]
struct CsrfForm {
    #[serde(default)]
    csrf: String,
}

/// The session of a form that changes state, or the refusal: the sign-in page (HTTP 401)
/// without a valid session, HTTP 403 when the form does not carry the session's CSRF token.
#[allow(clippy::result_large_err)]
async fn signed_in_form(
    state: &AppState,
    headers: &HeaderMap,
    csrf: &str,
) -> Result<Session, Response> {
    let s = signed_in(state, headers).await?;
    if s.csrf_matches(csrf) {
        return Ok(s);
    }
    warn!(by = %s.name, "inbox: form refused: its CSRF token is missing or not the session's");
    Err(message(
        StatusCode::FORBIDDEN,
        Nav::new("inbox", &s),
        "Refused",
        "This form did not carry this session's CSRF token, so nothing was changed. Reload the page and try again.".into(),
    ))
}

async fn sign_out(
    State(state): State<Shared>,
    headers: HeaderMap,
    Form(form): Form<CsrfForm>,
) -> Response {
    let s = match signed_in_form(&state, &headers, &form.csrf).await {
        Ok(s) => s,
        Err(refused) => return refused,
    };
    let Some(key) = session_key(&state) else {
        return key_failed();
    };
    // Ended in the store first: the cookie is no good anywhere from now on, even a copy.
    if let Err(e) = state.store.end_inbox_session(&s.id_hash()).await {
        return store_failed(&state, "inbox_session", &e);
    }
    let secure = session::over_tls(&headers, state.config.inbox.secure_cookies);
    info!(by = %s.name, "inbox: signed out");
    let jar = session::jar(
        &key,
        vec![session::removal(session::SESSION_COOKIE, secure)],
    );
    (jar, Redirect::to("/admin/sign-in")).into_response()
}

/// Permit labels by id, for the pages that name an attempt's permit.
async fn labels(state: &AppState) -> Result<BTreeMap<String, Permit>, Response> {
    match state.store.list_permits().await {
        Ok(ps) => Ok(ps.into_iter().map(|p| (p.id.clone(), p)).collect()),
        Err(e) => Err(store_failed(state, "list_permits", &e)),
    }
}

fn label_of(permits: &BTreeMap<String, Permit>, id: &str) -> String {
    permits
        .get(id)
        .map(|p| p.label.clone())
        .unwrap_or_else(|| id.to_string())
}

/// A span of time as people read it: `3m 12s`, `2h 5m` (whole seconds).
fn span(ms: Millis) -> String {
    let secs = u64::try_from(ms.max(0) / 1000).unwrap_or(0);
    humantime::format_duration(Duration::from_secs(secs)).to_string()
}

fn open_item(
    a: &Attempt,
    state: &AppState,
    permits: &BTreeMap<String, Permit>,
    now: Millis,
) -> OpenItem {
    let uncertain = a.state == AttemptState::Uncertain;
    OpenItem {
        id: a.id.clone(),
        tool: a.tool.clone(),
        permit_id: a.permit_id.clone(),
        permit_label: label_of(permits, &a.permit_id),
        state: a.state.as_str(),
        state_label: if uncertain {
            "uncertain"
        } else {
            "waiting for input"
        },
        uncertain,
        waiting_for: span(now.saturating_sub(a.updated_at_ms)),
        since: clock::rfc3339(a.updated_at_ms),
        sent_at: clock::rfc3339(a.created_at_ms),
        lease_ends: clock::rfc3339(a.lease_expires_at_ms),
        forwarded_key: a.forwarded_key.clone(),
        key_went: key_carriers_text(a.forwarded_key.as_deref(), a.forwarded_key_carriers),
        key_warning: match state.config.inbox.lookup_forms.get(&a.tool) {
            Some(form) => key_warning(a, *form, true),
            None => key_warning(a, KeyCarrier::Header, false),
        },
        arguments: shown_arguments(a, state),
        reason: a.reason.clone(),
        cost: a.cost,
        round: a.round,
    }
}

/// An attempt's arguments as a page shows them: redacted as configured, indented.
fn shown_arguments(a: &Attempt, state: &AppState) -> String {
    match a.arguments.as_deref() {
        Some(text) => {
            let shown = state.config.redaction.show(text);
            serde_json::to_string_pretty(&shown).unwrap_or_else(|_| shown.to_string())
        }
        None => "(not kept)".into(),
    }
}

#[derive(Debug, Deserialize)]
struct InboxQuery {
    resolved: Option<String>,
}

async fn inbox_page(
    State(state): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<InboxQuery>,
) -> Response {
    let s = match signed_in(&state, &headers).await {
        Ok(s) => s,
        Err(refused) => return refused,
    };
    let now = state.clock.now_ms();
    let stuck_since = now.saturating_sub(millis(state.config.inbox.stuck_after));
    let open = match state.store.open_attempts(stuck_since, PAGE_LIMIT).await {
        Ok(o) => o,
        Err(e) => return store_failed(&state, "open_attempts", &e),
    };
    let permits = match labels(&state).await {
        Ok(p) => p,
        Err(r) => return r,
    };
    let message = q
        .resolved
        .filter(|id| !id.is_empty())
        .map(|id| format!("Resolved {id}: it is in the history."));
    let page = InboxPage {
        nav: Nav::new("inbox", &s),
        csrf: s.csrf.clone(),
        message,
        more: open.len() >= usize::try_from(PAGE_LIMIT).unwrap_or(usize::MAX),
        items: open
            .iter()
            .map(|a| open_item(a, &state, &permits, now))
            .collect(),
    };
    html(StatusCode::OK, &page)
}

async fn history_page(State(state): State<Shared>, headers: HeaderMap) -> Response {
    let s = match signed_in(&state, &headers).await {
        Ok(s) => s,
        Err(refused) => return refused,
    };
    let resolved = match state.store.resolved_attempts(PAGE_LIMIT).await {
        Ok(r) => r,
        Err(e) => return store_failed(&state, "resolved_attempts", &e),
    };
    let permits = match labels(&state).await {
        Ok(p) => p,
        Err(r) => return r,
    };
    let items = resolved
        .iter()
        .filter_map(|a| {
            let r = a.resolution.as_ref()?;
            Some(ResolvedItem {
                id: a.id.clone(),
                tool: a.tool.clone(),
                permit_label: label_of(&permits, &a.permit_id),
                result: if r.executed {
                    "executed"
                } else {
                    "not executed"
                },
                result_class: if r.executed {
                    "executed"
                } else {
                    "not_executed"
                },
                by: r.by.clone(),
                by_reconciler: matches!(r.source, ResolutionSource::Reconciler { .. }),
                at: clock::rfc3339(r.at_ms),
                note: r.note.clone(),
                provider_answer: r.source.provider_answer().map(str::to_string),
                sent_at: clock::rfc3339(a.created_at_ms),
                forwarded_key: a.forwarded_key.clone(),
                key_went: key_carriers_text(a.forwarded_key.as_deref(), a.forwarded_key_carriers),
            })
        })
        .collect();
    html(
        StatusCode::OK,
        &HistoryPage {
            nav: Nav::new("history", &s),
            items,
        },
    )
}

async fn permits_page(State(state): State<Shared>, headers: HeaderMap) -> Response {
    let s = match signed_in(&state, &headers).await {
        Ok(s) => s,
        Err(refused) => return refused,
    };
    let now = state.clock.now_ms();
    let mut list = match state.store.list_permits().await {
        Ok(l) => l,
        Err(e) => return store_failed(&state, "list_permits", &e),
    };
    // The newest first; active ones before expired and revoked ones.
    list.sort_by(|a, b| {
        (
            a.status(now) != "active",
            std::cmp::Reverse(a.created_at_ms),
            &a.id,
        )
            .cmp(&(
                b.status(now) != "active",
                std::cmp::Reverse(b.created_at_ms),
                &b.id,
            ))
    });
    let mut permits = Vec::new();
    for p in list
        .iter()
        .take(usize::try_from(PAGE_LIMIT).unwrap_or(usize::MAX))
    {
        let detail = match state.store.permit_detail(&p.id).await {
            Ok(Some(d)) => d,
            Ok(None) => continue,
            Err(e) => return store_failed(&state, "permit_detail", &e),
        };
        let shown = PermitShowResponse::new(&detail, now);
        let open = [AttemptState::Uncertain, AttemptState::AwaitingInput]
            .iter()
            .map(|st| detail.attempts_by_state.get(st).copied().unwrap_or(0))
            .sum();
        permits.push(PermitItem {
            id: shown.permit.id.clone(),
            label: shown.permit.label.clone(),
            status: shown.permit.status.clone(),
            expires_at: shown.permit.expires_at.clone(),
            figures: PermitFigures::new(&shown),
            open,
        });
    }
    html(
        StatusCode::OK,
        &PermitsPage {
            nav: Nav::new("permits", &s),
            permits,
        },
    )
}

async fn attempt_page(
    State(state): State<Shared>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let s = match signed_in(&state, &headers).await {
        Ok(s) => s,
        Err(refused) => return refused,
    };
    let a = match state.store.get_attempt(&id).await {
        Ok(Some(a)) => a,
        Ok(None) => {
            return message(
                StatusCode::NOT_FOUND,
                Nav::new("attempt", &s),
                "Not found",
                format!("No attempt has the id {id}."),
            )
        }
        Err(e) => return store_failed(&state, "get_attempt", &e),
    };
    let permit_label = match state.store.get_permit(&a.permit_id).await {
        Ok(p) => p.map_or_else(|| a.permit_id.clone(), |p| p.label),
        Err(e) => return store_failed(&state, "get_permit", &e),
    };
    let now = state.clock.now_ms();
    let detail = AttemptDetail {
        id: a.id.clone(),
        tool: a.tool.clone(),
        permit_id: a.permit_id.clone(),
        permit_label,
        state: a.state.as_str(),
        uncertain: a.state == AttemptState::Uncertain,
        sent_at: clock::rfc3339(a.created_at_ms),
        cost: a.cost,
        reason: a.reason.clone(),
        forwarded_key: a.forwarded_key.clone(),
        key_went: key_carriers_text(a.forwarded_key.as_deref(), a.forwarded_key_carriers),
        arguments: shown_arguments(&a, &state),
        resolution_note: a.resolution.as_ref().and_then(|r| r.note.clone()),
    };
    html(
        StatusCode::OK,
        &AttemptPage {
            nav: Nav::new("attempt", &s),
            timeline: Timeline::new(&a, now),
            a: detail,
        },
    )
}

#[derive(Debug, Deserialize)]
struct ResolveForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    result: String,
    #[serde(default)]
    note: String,
}

async fn resolve(
    State(state): State<Shared>,
    Path(id): Path<String>,
    headers: HeaderMap,
    Form(form): Form<ResolveForm>,
) -> Response {
    let s = match signed_in_form(&state, &headers, &form.csrf).await {
        Ok(s) => s,
        Err(refused) => return refused,
    };
    let bad = |text: &str| {
        message(
            StatusCode::BAD_REQUEST,
            Nav::new("inbox", &s),
            "Not resolved",
            text.into(),
        )
    };
    let executed = match form.result.as_str() {
        "executed" => true,
        "not_executed" => false,
        _ => return bad("Choose \"executed\" or \"not executed\"."),
    };
    let note = form.note.trim();
    if note.is_empty() || note.chars().count() > MAX_NOTE_CHARS {
        return bad("Say what you checked at the provider (a note of 1 to 2000 characters).");
    }
    let input = ResolveInput {
        executed,
        receipt: None,
        note: Some(note.to_string()),
        by: s.name.clone(),
        source: ResolutionSource::Person,
    };
    let now = state.clock.now_ms();
    match state.store.resolve_attempt(&id, &input, now).await {
        Ok(a) => {
            resolved(&state, &a, &input, "inbox");
            Redirect::to(&format!("/admin/?resolved={}", a.id)).into_response()
        }
        Err(ResolveError::UnknownAttempt) => message(
            StatusCode::NOT_FOUND,
            Nav::new("inbox", &s),
            "Not resolved",
            format!("No attempt has the id {id}."),
        ),
        Err(ResolveError::NotUncertain(st)) => message(
            StatusCode::CONFLICT,
            Nav::new("inbox", &s),
            "Not resolved",
            format!("The attempt is {st}: only uncertain attempts can be resolved (someone may have resolved it already)."),
        ),
        Err(ResolveError::Ledger(e)) => store_failed(&state, "resolve_attempt", &e),
    }
}
