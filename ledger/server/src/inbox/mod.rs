//! The reconciliation inbox: web pages under `/admin/` on the ledger's listener, for people
//! who check uncertain calls with the provider and record what they found.
//!
//! Server-rendered (askama templates in `ledger/server/templates/inbox/`), one stylesheet, no
//! scripts, no third-party host. Sign-in takes an admin's token (in a form body, never a
//! URL; crate::admins) and gives a signed session cookie ([`session`]) under that admin's
//! name (with the shared `--admin-token`, under the name typed beside it); every form that changes state carries
//! the session's CSRF token; every page is sent with a strict Content-Security-Policy.
//! Resolving goes through the store's one resolve operation, so slots and budget move
//! exactly as for `atmost attempts resolve`.
//!
//! Here: the routes and the pages' handlers. [`sign_in`] signs people in and out and is the
//! gate every other page passes; [`pages`] is what the pages show and how they are rendered;
//! [`figures`] draws the bars and the timeline; [`session`] is the cookies; [`approvals`] is
//! the page where people decide the calls waiting for approval.

mod approvals;
pub mod figures;
mod pages;
pub mod session;
mod sign_in;
#[cfg(test)]
pub(crate) mod tests;

use std::collections::BTreeMap;

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use serde::Deserialize;

use crate::api::{key_carriers_text, PermitShowResponse};
use crate::resolution::resolved;
use crate::state::{AppState, Shared};
use atmost_ledger::clock;
use atmost_ledger::decide::ResolveInput;
use atmost_ledger::error::ResolveError;
use atmost_ledger::model::{AttemptState, Permit, ResolutionSource};
use figures::{PermitFigures, Timeline};
use pages::{
    html, label_of, message, open_item, shown_arguments, store_failed, AttemptDetail, AttemptPage,
    HistoryPage, InboxPage, Nav, PermitItem, PermitsPage, ResolvedItem,
};
use sign_in::{signed_in, signed_in_form};

/// The pages' Content-Security-Policy: nothing but this origin's stylesheet, no scripts, no
/// frames, forms posting to this origin only.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; style-src 'self'; img-src 'self'; \
     form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// Most open attempts one inbox page lists (oldest first), resolved ones the history lists,
/// and permits the permits page shows.
pub const PAGE_LIMIT: u32 = 200;
/// Longest note accepted with a resolution, in characters.
pub const MAX_NOTE_CHARS: usize = 2000;

/// The inbox's routes (merged into the ledger's router, beside `/admin/v1/…`).
pub fn routes() -> Router<Shared> {
    Router::new()
        .route("/admin", get(|| async { Redirect::to("/admin/") }))
        .route("/admin/", get(inbox_page))
        .route("/admin/history", get(history_page))
        .route("/admin/permits", get(permits_page))
        .route("/admin/attempts/{id}", get(attempt_page))
        .route("/admin/attempts/{id}/resolve", post(resolve))
        .route("/admin/inbox.css", get(stylesheet))
        .merge(approvals::routes())
        .merge(sign_in::routes())
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

/// Permit labels by id, for the pages that name an attempt's permit.
async fn labels(state: &AppState) -> Result<BTreeMap<String, Permit>, Response> {
    match state.store.list_permits().await {
        Ok(ps) => Ok(ps.into_iter().map(|p| (p.id.clone(), p)).collect()),
        Err(e) => Err(store_failed(state, "list_permits", &e)),
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
    let stuck_since = now.saturating_sub(session::millis(state.config.inbox.stuck_after));
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
        nav: approvals::nav(&state, "inbox", &s).await,
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
            nav: approvals::nav(&state, "history", &s).await,
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
            nav: approvals::nav(&state, "permits", &s).await,
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
            nav: approvals::nav(&state, "attempt", &s).await,
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
            resolved(&state, &a, &input, "inbox", Some(&s.admin));
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
