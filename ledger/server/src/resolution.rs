//! How a resolution the store applied is counted and logged, whichever way it came (the
//! admin API, the inbox, the reconciler): one place, so the three cannot count it apart.

use tracing::info;

use crate::state::AppState;
use atmost_ledger::decide::ResolveInput;
use atmost_ledger::model::Attempt;

/// Counts and logs a resolution the store applied; `via` names the way it came (`api`,
/// `inbox`, `reconciler`), `admin` the authenticated admin it came from (none for the
/// reconciler): the `by` of an API call is what its caller wrote, so the log keeps both.
pub fn resolved(
    state: &AppState,
    a: &Attempt,
    input: &ResolveInput,
    via: &str,
    admin: Option<&str>,
) {
    let result = if input.executed {
        "executed"
    } else {
        "not_executed"
    };
    state.metrics.resolutions.with_label_values(&[result]).inc();
    info!(attempt_id = %a.id, permit_id = %a.permit_id, result, by = %input.by,
        admin = admin.unwrap_or("-"), source = input.source.as_str(), via, "attempt resolved");
}
