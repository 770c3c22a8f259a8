//! The inbox's Approvals page (docs/approvals.md#deciding): the calls waiting for a person's
//! approval, with what a person needs to judge each (the arguments, the cost, what the permit
//! has left, the agent's recent calls under it), and the Approve and Reject forms.
//!
//! A decision goes through [`crate::approvals::decide`], the admin API's own path, so the
//! inbox cannot count, log or announce a decision differently from `atmost approval approve`.

use std::collections::BTreeMap;

use askama::Template;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use serde::Deserialize;
use tracing::warn;

use super::figures::span;
use super::pages::{html, label_of, message, shown_arguments, store_failed, Nav};
use super::session::Session;
use super::sign_in::{signed_in, signed_in_form};
use super::{labels, PAGE_LIMIT};
use crate::approvals::{checked_note, decide};
use crate::state::{AppState, Shared};
use atmost_ledger::clock::{self, Millis};
use atmost_ledger::decide::permit_limits;
use atmost_ledger::error::ApprovalError;
use atmost_ledger::model::{Attempt, AttemptState, Permit, PermitDetail};
use atmost_ledger::store::AttemptFilter;

/// How many of a permit's latest calls each request shows beside it.
const EARLIER_CALLS: u32 = 5;

pub(super) fn routes() -> Router<Shared> {
    Router::new()
        .route("/admin/approvals", get(approvals_page))
        .route("/admin/approvals/{id}/approve", post(decided::<true>))
        .route("/admin/approvals/{id}/reject", post(decided::<false>))
}

/// The navigation with the number of calls waiting for approval beside its link. Counting
/// is no reason to fail a page: when the store cannot say, the link shows no number.
pub(super) async fn nav(state: &AppState, here: &'static str, s: &Session) -> Option<Nav> {
    let mut nav = Nav::new(here, s)?;
    match state.store.awaiting_approval().await {
        Ok((waiting, _)) => nav.waiting = Some(waiting),
        Err(e) => warn!(error = %e, "inbox: the calls waiting for approval were not counted"),
    }
    Some(nav)
}

/// One of the permit's recent calls, as listed under a request.
pub(super) struct EarlierCall {
    pub(super) id: String,
    pub(super) tool: String,
    pub(super) state: &'static str,
    pub(super) sent_at: String,
    pub(super) cost: u64,
}

/// One call waiting for approval as the page shows it.
pub(super) struct ApprovalItem {
    pub(super) id: String,
    pub(super) tool: String,
    pub(super) permit_id: String,
    pub(super) permit_label: String,
    pub(super) cost: u64,
    pub(super) arguments: String,
    pub(super) asked_at: String,
    pub(super) waiting_for: String,
    pub(super) lapses_at: String,
    pub(super) lapses_in: String,
    /// Calls of this tool the permit still allows (this one's slot already held); `None`:
    /// no cap.
    pub(super) calls_left: Option<u64>,
    /// The permit's budget left (this call's cost already reserved); `None`: no budget.
    pub(super) budget_left: Option<u64>,
    pub(super) earlier: Vec<EarlierCall>,
}

#[derive(Template)]
#[template(path = "inbox/approvals.html")]
pub(super) struct ApprovalsPage {
    pub(super) nav: Option<Nav>,
    pub(super) csrf: String,
    pub(super) message: Option<String>,
    pub(super) items: Vec<ApprovalItem>,
    /// The page holds [`PAGE_LIMIT`] requests: more may wait beyond them.
    pub(super) more: bool,
}

#[derive(Debug, Deserialize)]
struct ApprovalsQuery {
    approved: Option<String>,
    rejected: Option<String>,
}

/// What the page reads once per permit, however many of its calls wait.
struct PermitFacts {
    detail: Option<PermitDetail>,
    recent: Vec<Attempt>,
}

async fn permit_facts(state: &AppState, permit_id: &str) -> Result<PermitFacts, Response> {
    let detail = match state.store.permit_detail(permit_id).await {
        Ok(d) => d,
        Err(e) => return Err(store_failed(state, "permit_detail", &e)),
    };
    // One more than shown: the list may hold the waiting call itself, which is left out.
    let filter = AttemptFilter {
        state: None,
        permit_id: Some(permit_id.to_string()),
        limit: Some(EARLIER_CALLS + 1),
    };
    match state.store.list_attempts(&filter).await {
        Ok(recent) => Ok(PermitFacts { detail, recent }),
        Err(e) => Err(store_failed(state, "list_attempts", &e)),
    }
}

fn approval_item(
    a: &Attempt,
    state: &AppState,
    permits: &BTreeMap<String, Permit>,
    facts: &PermitFacts,
    now: Millis,
) -> ApprovalItem {
    let (calls_left, budget_left) = match &facts.detail {
        Some(d) => {
            let made = d.usage.get(&a.tool).map_or(0, |u| u.calls_made);
            let l = permit_limits(&d.permit, &a.tool, made, d.budget, now);
            (l.calls_left, l.budget_left)
        }
        None => (Some(0), Some(0)),
    };
    let asked = a
        .approval
        .as_ref()
        .map_or(a.created_at_ms, |x| x.requested_at_ms);
    ApprovalItem {
        id: a.id.clone(),
        tool: a.tool.clone(),
        permit_id: a.permit_id.clone(),
        permit_label: label_of(permits, &a.permit_id),
        cost: a.cost,
        arguments: shown_arguments(a, state),
        asked_at: clock::rfc3339(asked),
        waiting_for: span(now.saturating_sub(asked)),
        lapses_at: clock::rfc3339(a.lease_expires_at_ms),
        lapses_in: span(a.lease_expires_at_ms.saturating_sub(now)),
        calls_left,
        budget_left,
        earlier: facts
            .recent
            .iter()
            .filter(|e| e.id != a.id)
            .take(usize::try_from(EARLIER_CALLS).unwrap_or(usize::MAX))
            .map(|e| EarlierCall {
                id: e.id.clone(),
                tool: e.tool.clone(),
                state: e.state.as_str(),
                sent_at: clock::rfc3339(e.created_at_ms),
                cost: e.cost,
            })
            .collect(),
    }
}

async fn approvals_page(
    State(state): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<ApprovalsQuery>,
) -> Response {
    let s = match signed_in(&state, &headers).await {
        Ok(s) => s,
        Err(refused) => return refused,
    };
    let filter = AttemptFilter {
        state: Some(AttemptState::AwaitingApproval),
        permit_id: None,
        limit: Some(PAGE_LIMIT),
    };
    // Newest first from the store; a person decides the oldest first, as the API lists them.
    let mut waiting = match state.store.list_attempts(&filter).await {
        Ok(w) => w,
        Err(e) => return store_failed(&state, "list_attempts", &e),
    };
    waiting.reverse();
    let permits = match labels(&state).await {
        Ok(p) => p,
        Err(r) => return r,
    };
    let mut facts: BTreeMap<String, PermitFacts> = BTreeMap::new();
    for a in &waiting {
        if !facts.contains_key(&a.permit_id) {
            match permit_facts(&state, &a.permit_id).await {
                Ok(f) => facts.insert(a.permit_id.clone(), f),
                Err(r) => return r,
            };
        }
    }
    let now = state.clock.now_ms();
    let items: Vec<ApprovalItem> = waiting
        .iter()
        .filter_map(|a| {
            let f = facts.get(&a.permit_id)?;
            Some(approval_item(a, &state, &permits, f, now))
        })
        .collect();
    let message = match (q.approved, q.rejected) {
        (Some(id), _) if !id.is_empty() => Some(format!(
            "Approved {id}: the agent's next try with the same key sends the call."
        )),
        (_, Some(id)) if !id.is_empty() => Some(format!(
            "Rejected {id}: the agent's tries with its key are refused, and its slot and cost are back."
        )),
        _ => None,
    };
    let mut nav = nav(&state, "approvals", &s).await;
    if let Some(n) = nav.as_mut() {
        // Where the store could not count them, the page's own list still says how many.
        n.waiting = n.waiting.or_else(|| u64::try_from(items.len()).ok());
    }
    html(
        StatusCode::OK,
        &ApprovalsPage {
            nav,
            csrf: s.csrf.clone(),
            message,
            more: waiting.len() >= usize::try_from(PAGE_LIMIT).unwrap_or(usize::MAX),
            items,
        },
    )
}

#[derive(Debug, Deserialize)]
struct DecisionForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    note: String,
}

/// The page's Approve (`APPROVE`) and Reject buttons: the same form but for the decision.
async fn decided<const APPROVE: bool>(
    State(state): State<Shared>,
    Path(id): Path<String>,
    headers: HeaderMap,
    Form(form): Form<DecisionForm>,
) -> Response {
    decision(&state, &id, &headers, form, APPROVE).await
}

/// A person's decision from the page: the session and its CSRF token checked as for a
/// resolution, the session's name recorded as who decided.
async fn decision(
    state: &AppState,
    id: &str,
    headers: &HeaderMap,
    form: DecisionForm,
    approve: bool,
) -> Response {
    let s = match signed_in_form(state, headers, &form.csrf).await {
        Ok(s) => s,
        Err(refused) => return refused,
    };
    let not_decided =
        |status, text: String| message(status, Nav::new("approvals", &s), "Not decided", text);
    let note = match checked_note(Some(form.note)) {
        Ok(n) => n,
        Err(why) => return not_decided(StatusCode::BAD_REQUEST, format!("Not decided: {why}.")),
    };
    match decide(state, id, approve, s.name.clone(), note, "inbox").await {
        Ok(a) => {
            let verb = if approve { "approved" } else { "rejected" };
            Redirect::to(&format!("/admin/approvals?{verb}={}", a.id)).into_response()
        }
        Err(ApprovalError::UnknownAttempt) => not_decided(
            StatusCode::NOT_FOUND,
            format!("No attempt has the id {id}."),
        ),
        Err(ApprovalError::Refused(r)) => not_decided(
            StatusCode::CONFLICT,
            format!("not_awaiting_approval: {r} (someone may have decided it already)."),
        ),
        Err(ApprovalError::Ledger(e)) => store_failed(state, "decide_approval", &e),
    }
}
