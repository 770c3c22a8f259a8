//! People's decisions on calls waiting for approval (docs/approvals.md): the admin API's
//! routes, and [`decide`], the one way a decision reaches the store whichever way it came (the
//! admin API, the CLI through it, the inbox), so they cannot count or log it apart.

use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::access::{bad_request, error_response, internal};
use crate::admins::AuthenticatedAdmin;
use crate::api::{AttemptResponse, AttemptView};
use crate::state::{AppState, Shared};
use crate::webhook::{self, ApprovalEvent, ApprovalSubject};
use atmost_ledger::decide::ApprovalInput;
use atmost_ledger::error::{ApprovalError, ApprovalRefused};
use atmost_ledger::model::{Attempt, AttemptState};
use atmost_ledger::store::AttemptFilter;
use atmost_protocol::ledger_error::LedgerErrorCode;

/// `GET`: the calls waiting for approval (or in another approval state).
pub const ADMIN_APPROVALS_PATH: &str = "/admin/v1/approvals";

/// The longest note a decision keeps, in bytes.
pub const MAX_NOTE_BYTES: usize = 1024;
/// The longest person's name an authenticating proxy's header may give, in bytes.
pub const MAX_PERSON_BYTES: usize = 128;

/// The admin API's approval routes (behind the admin's authentication, with the other admin
/// routes).
pub fn routes() -> Router<Shared> {
    Router::new()
        .route(ADMIN_APPROVALS_PATH, get(list_approvals))
        .route("/admin/v1/approvals/{id}/approve", post(decision::<true>))
        .route("/admin/v1/approvals/{id}/reject", post(decision::<false>))
}

/// `GET /admin/v1/approvals`'s answer.
#[derive(Debug, Serialize, Deserialize)]
pub struct ApprovalListResponse {
    pub approvals: Vec<AttemptView>,
}

/// The body of a decision: an optional note (an empty body is no note).
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct DecisionBody {
    #[serde(default)]
    pub note: Option<String>,
}

#[derive(Debug, Deserialize)]
struct ApprovalQuery {
    state: Option<String>,
    permit: Option<String>,
    limit: Option<u32>,
}

/// The approval states `?state=` may name.
fn approval_state(name: Option<&str>) -> Result<AttemptState, String> {
    let state = match name.filter(|s| !s.is_empty()) {
        None => return Ok(AttemptState::AwaitingApproval),
        Some(s) => s.parse::<AttemptState>()?,
    };
    match state {
        AttemptState::AwaitingApproval
        | AttemptState::Approved
        | AttemptState::ApprovalRejected
        | AttemptState::ApprovalExpired => Ok(state),
        other => Err(format!(
            "state must be awaiting_approval, approved, approval_rejected or approval_expired, not {other}"
        )),
    }
}

/// The calls in one approval state (by default waiting), oldest first: of the newest
/// `limit` (1,000 by default), as `GET /admin/v1/attempts` lists them.
async fn list_approvals(State(state): State<Shared>, Query(q): Query<ApprovalQuery>) -> Response {
    let st = match approval_state(q.state.as_deref()) {
        Ok(s) => s,
        Err(m) => return bad_request(m),
    };
    let filter = AttemptFilter {
        state: Some(st),
        permit_id: q.permit.filter(|p| !p.is_empty()),
        limit: q.limit,
    };
    match state.store.list_attempts(&filter).await {
        Ok(mut list) => {
            list.reverse();
            Json(ApprovalListResponse {
                approvals: list
                    .iter()
                    .map(|a| AttemptView::new(a, &state.config.redaction))
                    .collect(),
            })
            .into_response()
        }
        Err(e) => internal(&state, "list_approvals", &e),
    }
}

/// `POST …/approve` (`APPROVE`) or `POST …/reject`: the same request but for the decision.
async fn decision<const APPROVE: bool>(
    State(state): State<Shared>,
    Path(id): Path<String>,
    Extension(admin): Extension<AuthenticatedAdmin>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    decision_request(&state, &id, &admin, &headers, &body, APPROVE).await
}

async fn decision_request(
    state: &AppState,
    id: &str,
    admin: &AuthenticatedAdmin,
    headers: &HeaderMap,
    body: &[u8],
    approve: bool,
) -> Response {
    let by = match decider(state, admin, headers) {
        Ok(by) => by,
        Err(why) => return bad_request(why),
    };
    let body: DecisionBody = if body.iter().all(u8::is_ascii_whitespace) {
        DecisionBody::default()
    } else {
        match serde_json::from_slice(body) {
            Ok(b) => b,
            Err(e) => return bad_request(format!("the body must be {{\"note\": \"…\"}}: {e}")),
        }
    };
    let note = match checked_note(body.note) {
        Ok(n) => n,
        Err(why) => return bad_request(why),
    };
    match decide(state, id, approve, by, note, "api").await {
        Ok(a) => Json(AttemptResponse {
            attempt: AttemptView::new(&a, &state.config.redaction),
        })
        .into_response(),
        Err(e) => refusal(state, &e),
    }
}

/// A note as kept: trimmed, none when empty, at most [`MAX_NOTE_BYTES`].
pub fn checked_note(note: Option<String>) -> Result<Option<String>, String> {
    let note = note.map(|n| n.trim().to_string()).filter(|n| !n.is_empty());
    match note {
        Some(n) if n.len() > MAX_NOTE_BYTES => Err(format!(
            "a note is at most {MAX_NOTE_BYTES} bytes, not {}",
            n.len()
        )),
        n => Ok(n),
    }
}

/// Who decides: the admin's name, or, for the admin an authenticating proxy authenticates
/// as (`--admin-identity-from`), `proxy:person` with the person its header names. The header
/// is believed from that credential only: any other admin is its own name.
pub fn decider(
    state: &AppState,
    admin: &AuthenticatedAdmin,
    headers: &HeaderMap,
) -> Result<String, String> {
    let Some(proxy) = state
        .config
        .approvals
        .identity
        .as_ref()
        .filter(|p| p.admin == admin.name)
    else {
        return Ok(admin.name.clone());
    };
    let person = headers
        .get(&proxy.header)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .unwrap_or_default();
    let printable = person.bytes().all(|b| (0x20..0x7f).contains(&b));
    if person.is_empty() || person.len() > MAX_PERSON_BYTES || !printable {
        return Err(format!(
            "a decision through {} must name the person in {} (1 to {MAX_PERSON_BYTES} printable characters)",
            proxy.admin, proxy.header
        ));
    }
    Ok(format!("{}:{person}", proxy.admin))
}

/// Applies a person's decision and counts and logs it; `via` names the way it came (`api`,
/// `inbox`).
pub async fn decide(
    state: &AppState,
    id: &str,
    approve: bool,
    by: String,
    note: Option<String>,
    via: &str,
) -> Result<Attempt, ApprovalError> {
    let input = ApprovalInput {
        approve,
        by,
        note,
        use_within_ms: u64::try_from(state.config.approvals.use_within.as_millis())
            .unwrap_or(u64::MAX),
    };
    let now = state.clock.now_ms();
    let a = state.store.decide_approval(id, &input, now).await?;
    let decision = if approve { "approved" } else { "rejected" };
    state
        .metrics
        .approval_decisions
        .with_label_values(&[decision])
        .inc();
    if let Some(asked) = a.approval.as_ref().map(|x| x.requested_at_ms) {
        let waited_ms = now.saturating_sub(asked).max(0);
        state
            .metrics
            .approval_decision_seconds
            .observe(waited_ms as f64 / 1000.0);
    }
    info!(attempt_id = %a.id, permit_id = %a.permit_id, tool = %a.tool, decision, by = %input.by,
        via, "approval decided");
    announce(state, &a).await;
    Ok(a)
}

/// Hands the webhook (if there is one) the event of an attempt that has just asked for a
/// person's approval or got a decision. The permit's label is read for it after the
/// decision's commit, so announcing never delays a decision.
pub async fn announce(state: &AppState, a: &Attempt) {
    let Some(approval) = a.approval.as_ref().filter(|_| state.webhook.is_some()) else {
        return;
    };
    let permit_label = match state.store.get_permit(&a.permit_id).await {
        Ok(p) => p.map(|p| p.label).unwrap_or_default(),
        Err(e) => {
            warn!(attempt_id = %a.id, error = %e, "approval event without its permit's label");
            String::new()
        }
    };
    let subject = ApprovalSubject {
        approval_id: a.id.clone(),
        permit_id: a.permit_id.clone(),
        permit_label,
        tool: a.tool.clone(),
        cost: a.cost,
    };
    let event = match &approval.decision {
        None => ApprovalEvent::requested(
            subject,
            a.arguments
                .as_deref()
                .map(|t| state.config.redaction.show(t)),
            approval.requested_at_ms,
            a.lease_expires_at_ms,
        ),
        Some(d) => {
            let decision = webhook::Decision {
                by: d.by.clone(),
                at: d.at_ms,
                note: d.note.clone(),
            };
            if d.approved {
                ApprovalEvent::approved(subject, decision, a.lease_expires_at_ms)
            } else {
                ApprovalEvent::rejected(subject, decision)
            }
        }
    };
    state.notify_approval(event);
}

/// The error answer of a refused decision.
pub fn refusal(state: &AppState, e: &ApprovalError) -> Response {
    match e {
        ApprovalError::UnknownAttempt => error_response(LedgerErrorCode::UnknownAttempt, None),
        ApprovalError::Refused(r @ (ApprovalRefused::NotAwaiting(_) | ApprovalRefused::Lapsed)) => {
            error_response(LedgerErrorCode::NotAwaitingApproval, Some(r.to_string()))
        }
        ApprovalError::Ledger(e) => internal(state, "decide_approval", e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_approval_states_are_listed() {
        assert_eq!(approval_state(None), Ok(AttemptState::AwaitingApproval));
        assert_eq!(approval_state(Some("")), Ok(AttemptState::AwaitingApproval));
        assert_eq!(approval_state(Some("approved")), Ok(AttemptState::Approved));
        assert!(approval_state(Some("uncertain"))
            .is_err_and(|m| m.contains("awaiting_approval, approved")));
        assert!(approval_state(Some("nope")).is_err());
    }

    #[test]
    fn notes_are_trimmed_and_bounded() {
        assert_eq!(checked_note(None), Ok(None));
        assert_eq!(checked_note(Some("  ".into())), Ok(None));
        assert_eq!(checked_note(Some(" ok ".into())), Ok(Some("ok".into())));
        assert!(checked_note(Some("x".repeat(MAX_NOTE_BYTES + 1))).is_err());
    }
}
