//! The ledger's decisions as pure functions: no I/O, no clock, no randomness.
//!
//! A store loads a [`Snapshot`] inside one transaction, calls [`decide`], and applies the
//! returned [`Mutation`] in the same transaction. Outcomes, resolutions and the sweeper
//! have their own pure transitions here too, so every store behaves the same.
//!
//! Where each thing is: the decision table's rules, one function each, in [`rules`]; the
//! figures an answer carries in [`limits`]; a report's meaning for a round in [`rounds`] and
//! its application in [`reports`] (a refusal at the tool in `refusal`); resolutions, leases
//! and retention in [`settle`]; the permit's counters and the reads a decision needs in
//! [`counters`].

use atmost_protocol::{AuthorizeRequest, AuthorizeResponse, Denial, DenialCode};

use crate::clock::Millis;
use crate::credentials::CredentialUse;
use crate::model::{Attempt, BudgetTotals, Permit, ToolUsage};

pub mod approval;
#[cfg(test)]
mod approval_tests;
pub mod counters;
mod dispatch;
pub mod limits;
mod refusal;
#[cfg(test)]
mod refusal_tests;
pub mod reports;
pub mod rounds;
pub mod rules;
pub mod settle;

pub use approval::{decide_approval, ApprovalInput};
pub use counters::{counter_delta, counter_weight, reads_needed, CounterDelta, Reads};
pub use limits::{limits_answer, permit_limits, Headroom};
pub use refusal::refusal_proven;
pub use reports::apply_outcome;
pub use rounds::{outcome_state, outcome_target, report_authenticated};
pub use rules::{authenticate, check_forwarded, key_hash, resolve_cost, valid_key};
pub use settle::{
    expire_lease, prune, resolve, InvalidResolution, ResolveInput, INPUT_ABANDONED_REASON,
    LEASE_EXPIRED_REASON,
};

/// Longest idempotency key accepted, in bytes (the protocol's one rule, the filter's too).
pub use atmost_protocol::idempotency_key::MAX_KEY_BYTES as MAX_KEY_LEN;
/// Upper bound of `retry_after` for a key still in flight, in seconds.
pub const MAX_RETRY_AFTER_SECS: i64 = 30;

/// What the store read for one authorize call, all inside the same transaction.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// The permit whose id the token names, if one exists.
    pub permit: Option<Permit>,
    /// The attempt the request's idempotency key maps to under this permit.
    pub existing: Option<Attempt>,
    /// Slots held for the requested tool.
    pub usage: ToolUsage,
    /// Spent and reserved budget of the permit.
    pub budget: BudgetTotals,
    /// The newest attempt under this permit with the same fingerprint, another key (or no key),
    /// not given back, created within the permit's retention window.
    pub recent_duplicate: Option<Attempt>,
    pub now_ms: Millis,
}

/// How long what a decision reserves may last, in milliseconds: the ledger's settings, the
/// same for every call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Leases {
    /// A dispatched call's lease (`--lease`).
    pub call_ms: u64,
    /// How long a call that needs a person's approval waits for the decision
    /// (`--approval-wait`).
    pub approval_wait_ms: u64,
}

impl Leases {
    /// The default wait for a person's decision: 15 minutes.
    pub const DEFAULT_APPROVAL_WAIT_MS: u64 = 15 * 60 * 1000;

    /// A call lease of `call_ms`, with the default wait for approvals.
    pub fn call(call_ms: u64) -> Leases {
        Leases {
            call_ms,
            approval_wait_ms: Self::DEFAULT_APPROVAL_WAIT_MS,
        }
    }
}

/// Values the store supplies for a possible reservation.
#[derive(Debug, Clone)]
pub struct DecideParams {
    pub lease_ms: u64,
    /// How long a call waiting for a person's approval holds its slot before it lapses.
    pub approval_wait_ms: u64,
    /// The id a new attempt gets if the call dispatches.
    pub new_attempt_id: String,
    /// The capability a dispatch (of a new attempt or a continuation round) hands out;
    /// only its hash is kept. Minted by the store from the operating system's CSPRNG.
    pub new_capability: String,
    /// The credential (newest version of the one the permit names) a dispatch carries, as
    /// the ledger read it before deciding; kept with a new attempt.
    pub credential: Option<CredentialUse>,
}

/// What the store must write, in the same transaction as the read.
#[derive(Debug, Clone, PartialEq)]
pub enum Mutation {
    None,
    /// Insert this `in_flight` attempt and, when it has a key, point the key at it.
    Reserve(Attempt),
    /// Rewrite this attempt (a replay bumps its replay count; a continuation moves an
    /// `awaiting_input` attempt back to `in_flight` with a new lease).
    Update(Attempt),
}

/// A note for logs and metrics that does not change the answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// The duplicate guard in `log` mode saw a new key with a recent attempt's fingerprint.
    DuplicateLogged { earlier_attempt_id: String },
    /// The duplicate guard in `enforce` mode refused.
    DuplicateDenied { earlier_attempt_id: String },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub response: AuthorizeResponse,
    pub mutation: Mutation,
    pub notices: Vec<Notice>,
    /// What a new reservation left of the permit's limits; `None` unless this decision
    /// reserves a new attempt.
    pub headroom: Option<Headroom>,
}

impl Decision {
    /// `response`, with `attempt` written over the key's attempt.
    fn updating(response: AuthorizeResponse, attempt: Attempt) -> Self {
        Decision {
            response,
            mutation: Mutation::Update(attempt),
            notices: Vec::new(),
            headroom: None,
        }
    }

    fn deny(d: Denial) -> Self {
        Decision {
            response: AuthorizeResponse::Deny(d),
            mutation: Mutation::None,
            notices: Vec::new(),
            headroom: None,
        }
    }
}

/// THE authorize decision. See docs/design.md#the-decision-table.
///
/// Modelled in `ledger/model/atmost.pml` (`decide`): spin checks the cap, one execution per
/// key and no release after a send under every interleaving of two replicas.
///
/// Every answer under an authenticated permit carries the permit's [`atmost_protocol::PermitLimits`] for the
/// tool, read from the snapshot's counters with the decision's own write counted.
pub fn decide(req: &AuthorizeRequest, snap: &Snapshot, params: &DecideParams) -> Decision {
    // 1. Permit authentication comes first.
    let Some(permit) = authenticate(&req.permit_token, snap.permit.as_ref()) else {
        return Decision::deny(Denial::new(
            DenialCode::PermitInvalid,
            "the permit token is unknown or revoked",
        ));
    };
    let mut decision = rules::decide_under(permit, req, snap, params);
    let moved = match &decision.mutation {
        Mutation::None => CounterDelta::default(),
        Mutation::Reserve(a) => counter_delta(None, a),
        Mutation::Update(a) => counter_delta(snap.existing.as_ref(), a),
    };
    let limits = permit_limits(
        permit,
        &req.tool,
        moved_count(snap.usage.calls_made, moved.slots),
        BudgetTotals {
            reserved: moved_count(snap.budget.reserved, moved.reserved),
            spent: moved_count(snap.budget.spent, moved.spent),
        },
        snap.now_ms,
    );
    if matches!(decision.mutation, Mutation::Reserve(_)) {
        decision.headroom = Some(Headroom::of(permit, &req.tool, &limits));
    }
    match &mut decision.response {
        AuthorizeResponse::Dispatch { limits: l, .. }
        | AuthorizeResponse::Replay { limits: l, .. } => *l = Some(limits),
        AuthorizeResponse::Deny(d) => d.limits = Some(limits),
    }
    decision
}

fn moved_count(counted: u64, delta: i64) -> u64 {
    u64::try_from(i128::from(counted) + i128::from(delta)).unwrap_or(0)
}
