//! The filter's outcome reports: those of `POST /v1/outcomes`, and those that ride on an
//! authorize (`AuthorizeRequest::reports`, docs/design.md#reports-riding-on-the-next-authorize).
//! Both are applied, counted and logged here, the one way.

use atmost_protocol::{Outcome, OutcomeAck, OutcomeReport, OutcomesRequest, OutcomesResponse};
use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use tracing::{info, warn};

use crate::access::{internal, json_rejection};
use crate::state::{AppState, Shared};
use atmost_ledger::error::LedgerError;
use atmost_ledger::model::AttemptState;

/// `POST /v1/outcomes`: every report in one store call, one ack per report in order.
pub(crate) async fn outcomes(
    State(state): State<Shared>,
    body: Result<Json<OutcomesRequest>, JsonRejection>,
) -> Response {
    let Json(mut req) = match body {
        Ok(b) => b,
        Err(r) => return json_rejection(r),
    };
    match apply(&state, &mut req.reports).await {
        Ok(acks) => (StatusCode::OK, Json(OutcomesResponse { acks })).into_response(),
        Err(e) => internal(&state, "outcome", &e),
    }
}

/// The reports that rode on an authorize: applied as `POST /v1/outcomes` applies them, their
/// acks for the answer. A failure costs the decision nothing: the answer goes without acks,
/// and the filter sends the reports again in a batch of their own.
pub(crate) async fn apply_riding(
    state: &AppState,
    mut reports: Vec<OutcomeReport>,
) -> Option<Vec<OutcomeAck>> {
    let taken = apply(state, &mut reports).await;
    let result = if taken.is_ok() { "taken" } else { "failed" };
    state
        .metrics
        .reports_ridden
        .with_label_values(&[result])
        .inc_by(reports.len() as u64);
    match taken {
        Ok(acks) => Some(acks),
        Err(e) => {
            state
                .metrics
                .store_errors
                .with_label_values(&["outcome"])
                .inc();
            warn!(reports = reports.len(), error = %e,
                "reports riding on an authorize not applied; answered without their acks (the filter sends them again)");
            None
        }
    }
}

/// Applies `reports` in one store call (one transaction where the store can), and counts
/// and logs each.
async fn apply(
    state: &AppState,
    reports: &mut [OutcomeReport],
) -> Result<Vec<OutcomeAck>, LedgerError> {
    // Whether a verifier's refusal is proven is the keys' to say, never the report's.
    state.config.tool_refusal_keys.check_reports(reports);
    let now = state.clock.now_ms();
    let results = state.store.record_outcomes(reports, now).await?;
    if results.len() != reports.len() {
        return Err(LedgerError::Invariant(
            "the store answered a different number of reports".into(),
        ));
    }
    let mut acks = Vec::with_capacity(reports.len());
    for (report, result) in reports.iter().zip(results) {
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
    Ok(acks)
}
