//! The figures every answer under a permit carries ([`PermitLimits`]), and how much of its
//! limits a new reservation left ([`Headroom`], for the metrics).

use atmost_protocol::{LimitsRequest, LimitsResponse, PermitLimits};

use super::rules::authenticate;
use crate::clock::Millis;
use crate::model::{BudgetTotals, Permit};

/// The share of a permit's limits still free after a new reservation, from 0 (that call took
/// the last of it) to 1: of the tool's call cap, and of the permit's budget (`None`: no such
/// limit). Read from the figures the answer carries, so the ledger's metrics cost no read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Headroom {
    pub calls: Option<f64>,
    pub budget: Option<f64>,
}

impl Headroom {
    pub(super) fn of(permit: &Permit, tool: &str, limits: &PermitLimits) -> Self {
        let rules = &permit.policy.rules;
        let share = |left: Option<u64>, of: Option<u64>| match (left, of) {
            (Some(left), Some(of)) if of > 0 => Some((left as f64 / of as f64).min(1.0)),
            (Some(_), Some(_)) => Some(0.0),
            _ => None,
        };
        Headroom {
            calls: share(limits.calls_left, rules.limit_for(tool)),
            budget: share(limits.budget_left, rules.budget),
        }
    }
}

/// What `permit` still allows for `tool`, given the slots held for the tool and the budget
/// totals: calls left under the tool's cap (0 outside the permit's scope or past its expiry,
/// `None` without a cap), budget left (`None` without a budget) and the expiry.
pub fn permit_limits(
    permit: &Permit,
    tool: &str,
    calls_made: u64,
    budget: BudgetTotals,
    now: Millis,
) -> PermitLimits {
    let rules = &permit.policy.rules;
    let calls_left = if now >= permit.expires_at_ms || !rules.allows_tool(tool) {
        Some(0)
    } else {
        rules
            .limit_for(tool)
            .map(|limit| limit.saturating_sub(calls_made))
    };
    PermitLimits {
        calls_left,
        budget_left: rules
            .budget
            .map(|b| b.saturating_sub(budget.spent.saturating_add(budget.reserved))),
        expires_at: crate::clock::rfc3339(permit.expires_at_ms),
    }
}

/// The answer of `POST /v1/limits`: the figures of each of `tools` under the permit the
/// token authenticates (`permit` is the one its id names, if any), from the permit's stored
/// counters (`slots` of a tool, the budget totals). `None` when the token does not
/// authenticate.
pub fn limits_answer(
    req: &LimitsRequest,
    permit: Option<&Permit>,
    slots: impl Fn(&str) -> u64,
    budget: BudgetTotals,
    now: Millis,
) -> Option<LimitsResponse> {
    let permit = authenticate(&req.permit_token, permit)?;
    let tools = req
        .tools
        .iter()
        .map(|t| (t.clone(), permit_limits(permit, t, slots(t), budget, now)))
        .collect();
    Some(LimitsResponse { tools })
}
