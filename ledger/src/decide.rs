//! The ledger's decisions as pure functions: no I/O, no clock, no randomness.
//!
//! A store loads a [`Snapshot`] inside one transaction, calls [`decide`], and applies the
//! returned [`Mutation`] in the same transaction. Outcomes, resolutions and the sweeper
//! have their own pure transitions here too, so every store behaves the same.

use atmost_protocol::{
    AuthorizeRequest, AuthorizeResponse, Denial, DenialCode, LimitsRequest, LimitsResponse,
    Outcome, OutcomeAck, OutcomeReport, PermitLimits,
};
use serde_json::Value;

use crate::clock::Millis;
use crate::credentials::CredentialUse;
use crate::error::ResolveError;
use crate::model::{
    Attempt, AttemptState, BudgetTotals, CostRule, GuardMode, Permit, Resolution, ResolutionSource,
    ToolUsage,
};
use crate::token;

mod refusal;
#[cfg(test)]
mod refusal_tests;
pub use refusal::refusal_proven;
use refusal::report_target;

/// Longest idempotency key accepted, in bytes (the protocol's one rule, the filter's too).
pub use atmost_protocol::idempotency_key::MAX_KEY_BYTES as MAX_KEY_LEN;
/// Upper bound of `retry_after` for a key still in flight, in seconds.
pub const MAX_RETRY_AFTER_SECS: i64 = 30;
/// Reason recorded when the sweeper turns an expired lease into `uncertain`.
pub const LEASE_EXPIRED_REASON: &str = "lease_expired";
/// Reason recorded when the sweeper turns an `awaiting_input` attempt whose continuation
/// never came into `uncertain` (the server may have acted before it asked).
pub const INPUT_ABANDONED_REASON: &str = "input_required_abandoned";

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

/// Values the store supplies for a possible reservation.
#[derive(Debug, Clone)]
pub struct DecideParams {
    pub lease_ms: u64,
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

/// The share of a permit's limits still free after a new reservation, from 0 (that call took
/// the last of it) to 1: of the tool's call cap, and of the permit's budget (`None`: no such
/// limit). Read from the figures the answer carries, so the ledger's metrics cost no read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Headroom {
    pub calls: Option<f64>,
    pub budget: Option<f64>,
}

impl Headroom {
    fn of(permit: &Permit, tool: &str, limits: &PermitLimits) -> Self {
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

impl Decision {
    fn deny(d: Denial) -> Self {
        Decision {
            response: AuthorizeResponse::Deny(d),
            mutation: Mutation::None,
            notices: Vec::new(),
            headroom: None,
        }
    }
}

/// The idempotency key as stored: its SHA-256, so a raw key never rests in the ledger.
pub fn key_hash(req: &AuthorizeRequest) -> Option<String> {
    req.idempotency_key.as_deref().map(token::sha256_hex)
}

/// Whether the token authenticates the permit (constant-time hash comparison) and it is not revoked.
pub fn authenticate<'a>(token: &str, permit: Option<&'a Permit>) -> Option<&'a Permit> {
    let permit = permit?;
    if token::permit_id_of(token) != Some(permit.id.as_str()) {
        return None;
    }
    if !token::token_matches(token, &permit.token_hash) {
        return None;
    }
    if permit.revoked_at_ms.is_some() {
        return None;
    }
    Some(permit)
}

/// An idempotency key (or the value forwarded for one) the ledger accepts: the protocol's
/// rule, the one the filter applies (1 to [`MAX_KEY_LEN`] bytes of printable ASCII).
pub fn valid_key(key: &str) -> bool {
    atmost_protocol::idempotency_key::check_key(key).is_ok()
}

/// Checks what the filter states about the key it forwards, before anything is decided: the
/// value must be one the ledger would accept as a key, and carriers come only with a value
/// (a key that reached the upstream somewhere has a value to look it up by).
pub fn check_forwarded(req: &AuthorizeRequest) -> Result<(), String> {
    match &req.forwarded_key {
        Some(k) if !valid_key(k) => Err(format!(
            "forwarded_key must be 1 to {MAX_KEY_LEN} bytes of printable ASCII"
        )),
        None if !req.forwarded_key_carriers.is_empty() => {
            Err("forwarded_key_carriers needs a forwarded_key".into())
        }
        _ => Ok(()),
    }
}

/// The cost of this call under the permit's rule for the tool.
pub fn resolve_cost(rule: &CostRule, arguments: &Value) -> Result<u64, String> {
    let cost = match rule {
        CostRule::Fixed(n) => *n,
        CostRule::Pointer(ptr) => match arguments.pointer(ptr).and_then(Value::as_u64) {
            Some(n) => n,
            None => return Err(ptr.clone()),
        },
    };
    if i64::try_from(cost).is_err() {
        return Err(match rule {
            CostRule::Pointer(p) => p.clone(),
            CostRule::Fixed(_) => String::from("(fixed)"),
        });
    }
    Ok(cost)
}

/// THE authorize decision. See docs/design.md#the-decision-table.
///
/// Modelled in `ledger/model/atmost.pml` (`decide`): spin checks the cap, one execution per
/// key and no release after a send under every interleaving of two replicas.
///
/// Every answer under an authenticated permit carries the permit's [`PermitLimits`] for the
/// tool, read from the snapshot's counters with the decision's own write counted.
pub fn decide(req: &AuthorizeRequest, snap: &Snapshot, params: &DecideParams) -> Decision {
    // 1. Permit authentication comes first.
    let Some(permit) = authenticate(&req.permit_token, snap.permit.as_ref()) else {
        return Decision::deny(Denial::new(
            DenialCode::PermitInvalid,
            "the permit token is unknown or revoked",
        ));
    };
    let mut decision = decide_under(permit, req, snap, params);
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

/// [`decide`] once the token authenticated `permit`.
fn decide_under(
    permit: &Permit,
    req: &AuthorizeRequest,
    snap: &Snapshot,
    params: &DecideParams,
) -> Decision {
    let now = snap.now_ms;

    if let Some(key) = req.idempotency_key.as_deref() {
        if !valid_key(key) {
            return Decision::deny(Denial::new(
                DenialCode::InvalidIdempotencyKey,
                format!("an idempotency key must be 1 to {MAX_KEY_LEN} bytes of printable ASCII"),
            ));
        }
    }

    // 2. The key already has an attempt under this permit.
    if let Some(existing) = snap.existing.as_ref() {
        if existing.pruned_at_ms.is_some() {
            return Decision::deny(Denial::new(
                DenialCode::IdempotencyKeyExpired,
                "this idempotency key was used before and its receipt has passed the permit's retention; use a new key only if you intend a new call",
            ));
        }
        if existing.fingerprint != req.fingerprint {
            return Decision::deny(Denial::new(
                DenialCode::IdempotencyKeyConflict,
                "this idempotency key was used for a different tool call under this permit",
            ));
        }
        match existing.state {
            AttemptState::Completed | AttemptState::ResolvedExecuted | AttemptState::Accepted => {
                return match existing.receipt.as_ref() {
                    Some(receipt) => {
                        let mut replayed = existing.clone();
                        replayed.replay_count = replayed.replay_count.saturating_add(1);
                        Decision {
                            response: AuthorizeResponse::Replay {
                                attempt_id: existing.id.clone(),
                                receipt: receipt.clone(),
                                limits: None,
                            },
                            mutation: Mutation::Update(replayed),
                            notices: Vec::new(),
                            headroom: None,
                        }
                    }
                    None => Decision::deny(
                        Denial::new(
                            DenialCode::IdempotencyKeyConflict,
                            "already executed; no receipt stored",
                        )
                        .with("attempt_id", existing.id.clone()),
                    ),
                };
            }
            AttemptState::InFlight => {
                let remaining_ms = existing.lease_expires_at_ms.saturating_sub(now).max(0);
                let secs = ((remaining_ms + 999) / 1000).clamp(1, MAX_RETRY_AFTER_SECS);
                return Decision::deny(
                    Denial::new(
                        DenialCode::IdempotencyInProgress,
                        "a call with this idempotency key is still in flight; retry later with the same key",
                    )
                    .with("retry_after", secs),
                );
            }
            AttemptState::AwaitingInput if req.continuation => {
                // The same call, continued: dispatch again under the SAME attempt. Its slot
                // and budget are already held; nothing new is taken.
                if now >= permit.expires_at_ms {
                    return Decision::deny(
                        Denial::new(DenialCode::PermitExpired, "the permit has expired")
                            .with("expires_at", crate::clock::rfc3339(permit.expires_at_ms)),
                    );
                }
                let lease_ms = i64::try_from(params.lease_ms).unwrap_or(i64::MAX);
                let mut next = existing.clone();
                next.state = AttemptState::InFlight;
                next.updated_at_ms = now;
                next.lease_expires_at_ms = now.saturating_add(lease_ms);
                // A new round with a new capability: reports about the earlier round (late,
                // retried or forged) can no longer move the attempt.
                next.round = existing.round.saturating_add(1);
                next.capability_hash = Some(token::sha256_hex(&params.new_capability));
                // The body this round is signed over (its own: the continuation's).
                next.dispatch_body_sha256 = dispatch_body(req);
                // Same key, same permit: the same forwarded value, kept from the first round
                // (an attempt stored before the value was kept learns it now). Where it went
                // is kept with it, from the same round: a round that states no value says
                // nothing about where an earlier round's value went.
                if next.forwarded_key.is_none() {
                    next.forwarded_key = req.forwarded_key.clone();
                    next.forwarded_key_carriers = req.forwarded_key_carriers;
                }
                return Decision {
                    response: AuthorizeResponse::Dispatch {
                        attempt_id: existing.id.clone(),
                        permit_id: permit.id.clone(),
                        lease_ms: params.lease_ms,
                        round: next.round,
                        capability: params.new_capability.clone(),
                        limits: None,
                        signature: None,
                        credential: None,
                    },
                    mutation: Mutation::Update(next),
                    notices: Vec::new(),
                    headroom: None,
                };
            }
            AttemptState::AwaitingInput => {
                let remaining_ms = existing.lease_expires_at_ms.saturating_sub(now).max(0);
                let secs = ((remaining_ms + 999) / 1000).clamp(1, MAX_RETRY_AFTER_SECS);
                return Decision::deny(
                    Denial::new(
                        DenialCode::IdempotencyInProgress,
                        "the call with this idempotency key is waiting for input: send its continuation (params.inputResponses / params.requestState) with the same key",
                    )
                    .with("retry_after", secs)
                    .with("awaiting_input", true),
                );
            }
            AttemptState::Uncertain => {
                return Decision::deny(
                    Denial::new(
                        DenialCode::DeliveryUncertain,
                        "a call with this idempotency key was sent and its outcome is unknown; it will not be sent again until someone checks the provider and resolves it",
                    )
                    .with("attempt_id", existing.id.clone()),
                );
            }
            // Given back: the same key may try again, through every check below.
            AttemptState::Released | AttemptState::ResolvedNotExecuted => {}
            AttemptState::RefusedAtTool => {}
        }
    }

    // 3. A new call (new key, no key, or a key whose attempt was given back).
    let rules = &permit.policy.rules;
    if now >= permit.expires_at_ms {
        return Decision::deny(
            Denial::new(DenialCode::PermitExpired, "the permit has expired")
                .with("expires_at", crate::clock::rfc3339(permit.expires_at_ms)),
        );
    }
    if !rules.allows_tool(&req.tool) {
        return Decision::deny(
            Denial::new(
                DenialCode::PermitToolNotAllowed,
                format!("the permit does not allow the tool {:?}", req.tool),
            )
            .with("tool", req.tool.clone()),
        );
    }
    if req.key_required && req.idempotency_key.is_none() {
        return Decision::deny(
            Denial::new(
                DenialCode::IdempotencyKeyRequired,
                format!("the tool {:?} requires an idempotency key", req.tool),
            )
            .with("tool", req.tool.clone()),
        );
    }
    if let Some(limit) = rules.limit_for(&req.tool) {
        if snap.usage.calls_made >= limit {
            return Decision::deny(
                Denial::new(
                    DenialCode::PermitMaxCallsExceeded,
                    format!(
                        "the permit allows at most {limit} calls of {:?}; {} already made",
                        req.tool, snap.usage.calls_made
                    ),
                )
                .with("tool", req.tool.clone())
                .with("limit", limit)
                .with("calls_made", snap.usage.calls_made),
            );
        }
    }
    let cost = match resolve_cost(&rules.cost_rule_for(&req.tool), &req.arguments) {
        Ok(c) => c,
        Err(pointer) => {
            return Decision::deny(
                Denial::new(
                    DenialCode::PermitBudgetExceeded,
                    format!(
                        "the cost of this call could not be determined: {pointer} in the arguments must be a non-negative integer"
                    ),
                )
                .with("error", "cost_unresolvable")
                .with("pointer", pointer),
            );
        }
    };
    if let Some(budget) = rules.budget {
        let needed =
            u128::from(snap.budget.spent) + u128::from(snap.budget.reserved) + u128::from(cost);
        if needed > u128::from(budget) {
            return Decision::deny(
                Denial::new(
                    DenialCode::PermitBudgetExceeded,
                    "this call would exceed the permit's budget",
                )
                .with("budget", budget)
                .with("spent", snap.budget.spent)
                .with("reserved", snap.budget.reserved)
                .with("cost", cost),
            );
        }
    }
    let key_hash = key_hash(req);
    let mut notices = Vec::new();
    if let Some(dup) = snap.recent_duplicate.as_ref() {
        let is_duplicate = dup.permit_id == permit.id
            && dup.fingerprint == req.fingerprint
            && !dup.state.gave_back()
            && now.saturating_sub(dup.created_at_ms) <= permit.policy.retention_ms
            && (key_hash.is_none() || dup.key_hash != key_hash);
        if is_duplicate {
            match rules.duplicate_guard {
                GuardMode::Off => {}
                GuardMode::Log => notices.push(Notice::DuplicateLogged {
                    earlier_attempt_id: dup.id.clone(),
                }),
                GuardMode::Enforce => {
                    let mut d = Decision::deny(Denial::new(
                        DenialCode::DuplicateRequestSuspected,
                        "a recent call under this permit had the same tool and arguments under another idempotency key; reuse that key to get its result",
                    ));
                    d.notices.push(Notice::DuplicateDenied {
                        earlier_attempt_id: dup.id.clone(),
                    });
                    return d;
                }
            }
        }
    }

    // 4. Reserve: slot and budget taken before anything is sent.
    let lease_ms = i64::try_from(params.lease_ms).unwrap_or(i64::MAX);
    let attempt = Attempt {
        id: params.new_attempt_id.clone(),
        permit_id: permit.id.clone(),
        tool: req.tool.clone(),
        key_hash,
        fingerprint: req.fingerprint.clone(),
        cost,
        state: AttemptState::InFlight,
        created_at_ms: now,
        updated_at_ms: now,
        lease_expires_at_ms: now.saturating_add(lease_ms),
        finished_at_ms: None,
        receipt: None,
        reason: None,
        replay_count: 0,
        pruned_at_ms: None,
        resolution: None,
        round: 1,
        capability_hash: Some(token::sha256_hex(&params.new_capability)),
        forwarded_key: req.forwarded_key.clone(),
        forwarded_key_carriers: req.forwarded_key_carriers,
        arguments: (!req.arguments.is_null()).then(|| req.arguments.to_string()),
        dispatch_body_sha256: dispatch_body(req),
        credential: params.credential.clone(),
    };
    Decision {
        response: AuthorizeResponse::Dispatch {
            attempt_id: attempt.id.clone(),
            permit_id: permit.id.clone(),
            lease_ms: params.lease_ms,
            round: 1,
            capability: params.new_capability.clone(),
            limits: None,
            signature: None,
            credential: None,
        },
        mutation: Mutation::Reserve(attempt),
        notices,
        headroom: None,
    }
}

/// The SHA-256 of the body a dispatch of `req` is signed over, which its attempt records for
/// the round (docs/signatures.md#signed-receipts).
fn dispatch_body(req: &AuthorizeRequest) -> Option<String> {
    req.dispatch.as_ref().map(|d| d.body_sha256.clone())
}

/// The state an outcome report asks for.
pub fn outcome_state(outcome: &Outcome) -> AttemptState {
    match outcome {
        Outcome::Completed { .. } => AttemptState::Completed,
        Outcome::Released { .. } => AttemptState::Released,
        Outcome::Uncertain { .. } => AttemptState::Uncertain,
        Outcome::InputRequired { .. } => AttemptState::AwaitingInput,
        Outcome::Accepted { .. } => AttemptState::Accepted,
        Outcome::RefusedAtTool { .. } => AttemptState::RefusedAtTool,
    }
}

/// The state a report of `outcome` for round `round` moves an `in_flight` attempt to. A
/// round that never reached the upstream gives the slot back only if it was the first: a
/// continuation that never left returns the attempt to where that round started,
/// `awaiting_input`, because round 1 was sent.
pub fn outcome_target(outcome: &Outcome, round: u32) -> AttemptState {
    match outcome {
        Outcome::Released { .. } if round > 1 => AttemptState::AwaitingInput,
        other => outcome_state(other),
    }
}

/// Whether the report proves it speaks for the attempt's current round: the round matches
/// and the capability hashes to the stored one (compared in constant time). An attempt
/// stored without a capability (written before rounds existed) accepts no report; its
/// lease decides.
pub fn report_authenticated(a: &Attempt, report: &OutcomeReport) -> bool {
    match a.capability_hash.as_deref() {
        Some(hash) => report.round == a.round && token::token_matches(&report.capability, hash),
        None => false,
    }
}

/// Applies one outcome report. Only a report that proves the attempt's current round moves
/// it, and only from `in_flight`; the attempt to write, if any, is returned.
///
/// Modelled in `ledger/model/atmost.pml` (`apply_report`): without the round check, an agent
/// holding a later round's capability claims round 1 and releases a sent attempt (the
/// `NO_ROUND_CHECK` mutant's counterexample).
pub fn apply_outcome(
    existing: Option<&Attempt>,
    report: &OutcomeReport,
    now: Millis,
) -> (OutcomeAck, Option<Attempt>) {
    let Some(a) = existing else {
        return (OutcomeAck::UnknownAttempt, None);
    };
    if report.round < a.round && report.round >= 1 {
        // A late or retried report of a round that is over: the attempt has moved on.
        return (OutcomeAck::StaleRound, None);
    }
    if !report_authenticated(a, report) {
        return (OutcomeAck::Refused, None);
    }
    let outcome = &report.outcome;
    let target = report_target(a, report);
    if a.state != AttemptState::InFlight {
        let ack = if a.state == target {
            OutcomeAck::AlreadyRecorded
        } else {
            OutcomeAck::Conflict
        };
        return (ack, None);
    }
    let mut next = a.clone();
    next.state = target;
    next.updated_at_ms = now;
    match outcome {
        Outcome::Completed { receipt } | Outcome::Accepted { receipt } => {
            next.receipt = Some(receipt.clone());
            next.finished_at_ms = Some(now);
        }
        Outcome::Released { reason } if target == AttemptState::AwaitingInput => {
            // The continuation never left: the client may send it again under the same key.
            // The interim receipt of the earlier round stays; the lease is renewed.
            next.reason = Some(reason.clone());
            next.lease_expires_at_ms = now.saturating_add(dispatch_lease(a));
        }
        Outcome::Released { reason } | Outcome::Uncertain { reason } => {
            next.reason = Some(reason.clone());
        }
        Outcome::RefusedAtTool { refusal, .. } => refusal::record(&mut next, a, refusal, now),
        Outcome::InputRequired { receipt } => {
            // The interim answer, kept for inspection (never replayed: the state does not
            // replay). The lease is renewed for as long as the dispatch lease was.
            next.receipt = Some(receipt.clone());
            next.lease_expires_at_ms = now.saturating_add(dispatch_lease(a));
        }
    }
    (OutcomeAck::Applied, Some(next))
}

/// How long the current round's lease was when it was dispatched.
fn dispatch_lease(a: &Attempt) -> Millis {
    a.lease_expires_at_ms.saturating_sub(a.updated_at_ms).max(0)
}

/// What a person (or reconciler) found when checking the provider.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ResolveInput {
    pub executed: bool,
    #[serde(default)]
    pub receipt: Option<String>,
    #[serde(default)]
    pub note: Option<String>,
    pub by: String,
    /// A person, unless the reconciler resolves (in process): the admin API cannot claim
    /// to be the reconciler.
    #[serde(skip)]
    pub source: ResolutionSource,
}

/// What a resolution must say and does not: refused before any attempt is looked up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum InvalidResolution {
    #[error("by must name who resolved the attempt")]
    NoResolver,
    #[error("a receipt only goes with executed: true")]
    ReceiptWithoutExecution,
}

impl ResolveInput {
    /// Someone is named, and a receipt comes only with a call that ran.
    pub fn check(&self) -> Result<(), InvalidResolution> {
        if self.by.trim().is_empty() {
            return Err(InvalidResolution::NoResolver);
        }
        if !self.executed && self.receipt.is_some() {
            return Err(InvalidResolution::ReceiptWithoutExecution);
        }
        Ok(())
    }
}

/// Settles an `uncertain` attempt. Nothing else can be resolved. Modelled in
/// `ledger/model/atmost.pml` (`RESOLVE`).
pub fn resolve(a: &Attempt, input: &ResolveInput, now: Millis) -> Result<Attempt, ResolveError> {
    if a.state != AttemptState::Uncertain {
        return Err(ResolveError::NotUncertain(a.state));
    }
    let mut next = a.clone();
    next.updated_at_ms = now;
    if input.executed {
        next.state = AttemptState::ResolvedExecuted;
        next.receipt = input.receipt.clone();
        next.finished_at_ms = Some(now);
    } else {
        next.state = AttemptState::ResolvedNotExecuted;
        next.receipt = None;
    }
    next.resolution = Some(Resolution {
        executed: input.executed,
        by: input.by.clone(),
        at_ms: now,
        note: input.note.clone(),
        source: input.source.clone(),
    });
    Ok(next)
}

/// The sweeper: an `in_flight` or `awaiting_input` attempt past its lease becomes
/// `uncertain` (never `released`). Modelled in `ledger/model/atmost.pml` (`EXPIRE`).
pub fn expire_lease(a: &Attempt, now: Millis) -> Option<Attempt> {
    if !a.state.leased() || now < a.lease_expires_at_ms {
        return None;
    }
    let mut next = a.clone();
    next.reason = Some(
        if a.state == AttemptState::AwaitingInput {
            INPUT_ABANDONED_REASON
        } else {
            LEASE_EXPIRED_REASON
        }
        .to_string(),
    );
    next.state = AttemptState::Uncertain;
    next.updated_at_ms = now;
    Some(next)
}

/// Retention: a finished attempt's receipt (and its arguments) older than the permit's
/// retention is dropped and the row kept as a tombstone. `uncertain` and `in_flight` attempts
/// are never pruned.
pub fn prune(a: &Attempt, retention_ms: Millis, now: Millis) -> Option<Attempt> {
    if !a.state.replays() || a.pruned_at_ms.is_some() {
        return None;
    }
    let finished = a.finished_at_ms.unwrap_or(a.updated_at_ms);
    if now.saturating_sub(finished) < retention_ms {
        return None;
    }
    let mut next = a.clone();
    next.receipt = None;
    next.arguments = None;
    next.pruned_at_ms = Some(now);
    next.updated_at_ms = now;
    Some(next)
}

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
