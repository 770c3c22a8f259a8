//! What an attempt counts for in its permit's O(1) counters, and what a decision must read.

use atmost_protocol::AuthorizeRequest;

use crate::model::{Attempt, AttemptState, GuardMode, Permit};

/// How one write moves the permit's O(1) counters: slots held for the attempt's tool, and
/// reserved / spent budget. Computed from the attempt's state before (`None`: a new attempt)
/// and after, with the model's rules, so every store keeps the counters the same way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CounterDelta {
    pub slots: i64,
    pub reserved: i64,
    pub spent: i64,
}

impl CounterDelta {
    pub fn is_zero(&self) -> bool {
        *self == CounterDelta::default()
    }
}

/// What an attempt in `state` costing `cost` counts for in its permit's counters: its slot,
/// and its cost as reserved or spent, by the model's rules.
pub fn counter_weight(state: AttemptState, cost: u64) -> CounterDelta {
    let cost = i64::try_from(cost).unwrap_or(i64::MAX);
    let weight = |rule: fn(AttemptState) -> bool, n: i64| if rule(state) { n } else { 0 };
    CounterDelta {
        slots: weight(AttemptState::holds_slot, 1),
        reserved: weight(AttemptState::reserves_budget, cost),
        spent: weight(AttemptState::spends_budget, cost),
    }
}

/// The counter change of writing `new` over `old` (the same attempt, or none before).
pub fn counter_delta(old: Option<&Attempt>, new: &Attempt) -> CounterDelta {
    let after = counter_weight(new.state, new.cost);
    let before = old.map_or_else(CounterDelta::default, |a| counter_weight(a.state, a.cost));
    CounterDelta {
        slots: after.slots - before.slots,
        reserved: after.reserved - before.reserved,
        spent: after.spent - before.spent,
    }
}

/// What an authorize decision needs read besides the permit and the key's attempt: the
/// tool's slots only under a cap (and in the permit's scope), the budget totals only under a
/// budget, whatever decides (the answer's [`PermitLimits`] show them); and the duplicate
/// guard's lookup only when the guard is on and the call is new (the key's attempt does not
/// decide alone: there is none, or it was given back).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reads {
    pub usage: bool,
    pub budget: bool,
    pub duplicate: bool,
}

pub fn reads_needed(req: &AuthorizeRequest, permit: &Permit, existing: Option<&Attempt>) -> Reads {
    let rules = &permit.policy.rules;
    let new_call = existing.is_none_or(|a| a.state.gave_back());
    Reads {
        usage: rules.allows_tool(&req.tool) && rules.limit_for(&req.tool).is_some(),
        budget: rules.budget.is_some(),
        duplicate: new_call && rules.duplicate_guard != GuardMode::Off,
    }
}
