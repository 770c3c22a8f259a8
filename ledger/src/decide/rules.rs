//! The decision table of docs/design.md#the-decision-table, one function per rule in the
//! table's order: [`authenticate`] (1), [`key_shape`] (2), [`by_the_keys_attempt`] (3), the
//! checks of a new call (4: [`permit_expired`], [`tool_not_allowed`], [`key_missing`],
//! [`cap_reached`], [`cost_of`], [`over_budget`], [`duplicate_guard`], and the approval the
//! permit may ask for, [`approval_needed`](super::approval::approval_needed)) and `reserve` (5).
//! A check returns the denial that ends the decision, or `None` to go on.

use atmost_protocol::{AuthorizeRequest, AuthorizeResponse, Denial, DenialCode};
use serde_json::Value;

use super::dispatch::{dispatch, dispatch_body, lease_of, redispatched};
use super::{
    approval, DecideParams, Decision, Mutation, Notice, Snapshot, MAX_KEY_LEN, MAX_RETRY_AFTER_SECS,
};
use crate::clock::Millis;
use crate::model::{Attempt, AttemptState, BudgetTotals, CallRules, CostRule, GuardMode, Permit};
use crate::token;

// Rule 4.1 is the check every dispatch makes (a continuation and an approved call too), so it
// lives with the dispatch.
use super::dispatch::permit_expired;

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
    atmost_protocol::idempotency_key::IdempotencyKey::check(key).is_ok()
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

/// The rules after the first, in the table's order, once the token authenticated `permit`.
pub(super) fn decide_under(
    permit: &Permit,
    req: &AuthorizeRequest,
    snap: &Snapshot,
    params: &DecideParams,
) -> Decision {
    if let Some(denial) = key_shape(req) {
        return Decision::deny(denial);
    }
    if let Some(existing) = snap.existing.as_ref() {
        if let Some(decision) = by_the_keys_attempt(existing, permit, req, params, snap.now_ms) {
            return decision;
        }
    }
    new_call(permit, req, snap, params)
}

/// Rule 2, the key's shape: the protocol's one rule, the filter's too.
pub fn key_shape(req: &AuthorizeRequest) -> Option<Denial> {
    let key = req.idempotency_key.as_deref()?;
    (!valid_key(key)).then(|| {
        Denial::new(
            DenialCode::InvalidIdempotencyKey,
            format!("an idempotency key must be 1 to {MAX_KEY_LEN} bytes of printable ASCII"),
        )
    })
}

/// Rule 3, what the key already has under this permit: the answer of its row of the table,
/// or `None` when the attempt was given back and the call goes on as a new one.
pub fn by_the_keys_attempt(
    existing: &Attempt,
    permit: &Permit,
    req: &AuthorizeRequest,
    params: &DecideParams,
    now: Millis,
) -> Option<Decision> {
    if existing.pruned_at_ms.is_some() {
        return Some(Decision::deny(Denial::new(
            DenialCode::IdempotencyKeyExpired,
            "this idempotency key was used before and its receipt has passed the permit's retention; use a new key only if you intend a new call",
        )));
    }
    if existing.fingerprint != req.fingerprint {
        return Some(Decision::deny(Denial::new(
            DenialCode::IdempotencyKeyConflict,
            "this idempotency key was used for a different tool call under this permit",
        )));
    }
    match existing.state {
        AttemptState::Completed | AttemptState::ResolvedExecuted | AttemptState::Accepted => {
            Some(replay(existing))
        }
        AttemptState::InFlight => Some(Decision::deny(
            Denial::new(
                DenialCode::IdempotencyInProgress,
                "a call with this idempotency key is still in flight; retry later with the same key",
            )
            .with("retry_after", retry_after_secs(existing, now)),
        )),
        AttemptState::AwaitingInput if req.continuation => {
            Some(continue_round(existing, permit, req, params, now))
        }
        AttemptState::AwaitingInput => Some(Decision::deny(
            Denial::new(
                DenialCode::IdempotencyInProgress,
                "the call with this idempotency key is waiting for input: send its continuation (params.inputResponses / params.requestState) with the same key",
            )
            .with("retry_after", retry_after_secs(existing, now))
            .with("awaiting_input", true),
        )),
        AttemptState::Uncertain => Some(Decision::deny(
            Denial::new(
                DenialCode::DeliveryUncertain,
                "a call with this idempotency key was sent and its outcome is unknown; it will not be sent again until someone checks the provider and resolves it",
            )
            .with("attempt_id", existing.id.clone()),
        )),
        // Given back: the same key may try again, through every check of a new call.
        AttemptState::Released | AttemptState::ResolvedNotExecuted | AttemptState::RefusedAtTool => {
            None
        }
        AttemptState::AwaitingApproval
        | AttemptState::Approved
        | AttemptState::ApprovalRejected
        | AttemptState::ApprovalExpired => {
            Some(approval::by_approval(existing, permit, req, params, now))
        }
    }
}

/// Rule 3's finished rows: the stored receipt again, taking nothing; without a receipt, the
/// key cannot be answered and is a conflict.
fn replay(existing: &Attempt) -> Decision {
    let Some(receipt) = existing.receipt.as_ref() else {
        return Decision::deny(
            Denial::new(
                DenialCode::IdempotencyKeyConflict,
                "already executed; no receipt stored",
            )
            .with("attempt_id", existing.id.clone()),
        );
    };
    let mut replayed = existing.clone();
    replayed.replay_count = replayed.replay_count.saturating_add(1);
    Decision::updating(
        AuthorizeResponse::Replay {
            attempt_id: existing.id.clone(),
            receipt: receipt.clone(),
            limits: None,
        },
        replayed,
    )
}

/// Seconds until a leased attempt's lease ends, from 1 to [`MAX_RETRY_AFTER_SECS`].
fn retry_after_secs(existing: &Attempt, now: Millis) -> i64 {
    let remaining_ms = existing.lease_expires_at_ms.saturating_sub(now).max(0);
    ((remaining_ms + 999) / 1000).clamp(1, MAX_RETRY_AFTER_SECS)
}

/// Rule 3's continuation row: the same call, continued, dispatches again under the SAME
/// attempt. Its slot and budget are already held; nothing new is taken.
fn continue_round(
    existing: &Attempt,
    permit: &Permit,
    req: &AuthorizeRequest,
    params: &DecideParams,
    now: Millis,
) -> Decision {
    if let Some(denial) = permit_expired(permit, now) {
        return Decision::deny(denial);
    }
    // A new round with a new capability: reports about the earlier round (late, retried or
    // forged) can no longer move the attempt.
    let mut next = redispatched(existing, req, params, now);
    next.round = existing.round.saturating_add(1);
    // Same key, same permit: the same forwarded value, kept from the first round (an attempt
    // stored before the value was kept learns it now). Where it went is kept with it, from
    // the same round: a round that states no value says nothing about where an earlier
    // round's value went.
    if next.forwarded_key.is_none() {
        next.forwarded_key = req.forwarded_key.clone();
        next.forwarded_key_carriers = req.forwarded_key_carriers;
    }
    Decision::updating(dispatch(&existing.id, permit, params, next.round), next)
}

/// Rule 4, a new call: its checks in order, the first that fails is the answer; then rule 5.
fn new_call(
    permit: &Permit,
    req: &AuthorizeRequest,
    snap: &Snapshot,
    params: &DecideParams,
) -> Decision {
    let rules = &permit.policy.rules;
    let refused = permit_expired(permit, snap.now_ms)
        .or_else(|| tool_not_allowed(rules, req))
        .or_else(|| key_missing(req))
        .or_else(|| cap_reached(rules, req, snap.usage.calls_made));
    if let Some(denial) = refused {
        return Decision::deny(denial);
    }
    let cost = match cost_of(rules, req) {
        Ok(cost) => cost,
        Err(denial) => return Decision::deny(denial),
    };
    if let Some(denial) = over_budget(rules, &snap.budget, cost) {
        return Decision::deny(denial);
    }
    let key_hash = key_hash(req);
    let notices = match duplicate_guard(permit, req, snap, key_hash.as_deref()) {
        Ok(notices) => notices,
        Err(refused) => return *refused,
    };
    let attempt = new_attempt(permit, req, params, cost, key_hash, snap.now_ms);
    // Rule 4.8: a person approves it first; the reservation is the same, the dispatch waits.
    let mut decision = if approval::approval_needed(rules, &req.tool, cost) {
        approval::await_approval(attempt, params, snap.now_ms)
    } else {
        reserve(permit, params, attempt)
    };
    decision.notices = notices;
    decision
}

/// Rule 4.2: the tool is outside the permit's scope.
pub fn tool_not_allowed(rules: &CallRules, req: &AuthorizeRequest) -> Option<Denial> {
    (!rules.allows_tool(&req.tool)).then(|| {
        Denial::new(
            DenialCode::PermitToolNotAllowed,
            format!("the permit does not allow the tool {:?}", req.tool),
        )
        .with("tool", req.tool.clone())
    })
}

/// Rule 4.3: the gateway requires a key for the tool and none came.
pub fn key_missing(req: &AuthorizeRequest) -> Option<Denial> {
    (req.key_required && req.idempotency_key.is_none()).then(|| {
        Denial::new(
            DenialCode::IdempotencyKeyRequired,
            format!("the tool {:?} requires an idempotency key", req.tool),
        )
        .with("tool", req.tool.clone())
    })
}

/// Rule 4.4: the slots held for the tool have reached its cap.
pub fn cap_reached(rules: &CallRules, req: &AuthorizeRequest, calls_made: u64) -> Option<Denial> {
    let limit = rules.limit_for(&req.tool)?;
    (calls_made >= limit).then(|| {
        Denial::new(
            DenialCode::PermitMaxCallsExceeded,
            format!(
                "the permit allows at most {limit} calls of {:?}; {calls_made} already made",
                req.tool
            ),
        )
        .with("tool", req.tool.clone())
        .with("limit", limit)
        .with("calls_made", calls_made)
    })
}

/// Rule 4.5: the call's cost under the permit's rule for the tool, or the denial when the
/// rule cannot be evaluated.
pub fn cost_of(rules: &CallRules, req: &AuthorizeRequest) -> Result<u64, Denial> {
    resolve_cost(&rules.cost_rule_for(&req.tool), &req.arguments).map_err(|pointer| {
        Denial::new(
            DenialCode::PermitBudgetExceeded,
            format!(
                "the cost of this call could not be determined: {pointer} in the arguments must be a non-negative integer"
            ),
        )
        .with("error", "cost_unresolvable")
        .with("pointer", pointer)
    })
}

/// Rule 4.6: spent + reserved + this call's cost exceeds the budget.
pub fn over_budget(rules: &CallRules, totals: &BudgetTotals, cost: u64) -> Option<Denial> {
    let budget = rules.budget?;
    let needed = u128::from(totals.spent) + u128::from(totals.reserved) + u128::from(cost);
    (needed > u128::from(budget)).then(|| {
        Denial::new(
            DenialCode::PermitBudgetExceeded,
            "this call would exceed the permit's budget",
        )
        .with("budget", budget)
        .with("spent", totals.spent)
        .with("reserved", totals.reserved)
        .with("cost", cost)
    })
}

/// Rule 4.7, the duplicate guard: a recent attempt under this permit with the same
/// fingerprint, not given back, and this call without a key or with another one. The notices
/// to log when the call goes on, or the denial under `enforce`.
pub fn duplicate_guard(
    permit: &Permit,
    req: &AuthorizeRequest,
    snap: &Snapshot,
    key_hash: Option<&str>,
) -> Result<Vec<Notice>, Box<Decision>> {
    let Some(dup) = snap.recent_duplicate.as_ref() else {
        return Ok(Vec::new());
    };
    let is_duplicate = dup.permit_id == permit.id
        && dup.fingerprint == req.fingerprint
        && !dup.state.gave_back()
        && snap.now_ms.saturating_sub(dup.created_at_ms) <= permit.policy.retention_ms
        && (key_hash.is_none() || dup.key_hash.as_deref() != key_hash);
    if !is_duplicate {
        return Ok(Vec::new());
    }
    let earlier_attempt_id = dup.id.clone();
    match permit.policy.rules.duplicate_guard {
        GuardMode::Off => Ok(Vec::new()),
        GuardMode::Log => Ok(vec![Notice::DuplicateLogged { earlier_attempt_id }]),
        GuardMode::Enforce => {
            let mut d = Decision::deny(Denial::new(
                DenialCode::DuplicateRequestSuspected,
                "a recent call under this permit had the same tool and arguments under another idempotency key; reuse that key to get its result",
            ));
            d.notices
                .push(Notice::DuplicateDenied { earlier_attempt_id });
            Err(Box::new(d))
        }
    }
}

/// Rule 5, reserve: a new `in_flight` attempt takes a slot and the cost before anything is
/// sent, with a lease, round 1 and a fresh capability; the answer is dispatch.
fn reserve(permit: &Permit, params: &DecideParams, attempt: Attempt) -> Decision {
    Decision {
        response: dispatch(&attempt.id, permit, params, 1),
        mutation: Mutation::Reserve(attempt),
        notices: Vec::new(),
        headroom: None,
    }
}

/// The attempt a new call reserves: `in_flight`, round 1, a fresh capability and a lease.
fn new_attempt(
    permit: &Permit,
    req: &AuthorizeRequest,
    params: &DecideParams,
    cost: u64,
    key_hash: Option<String>,
    now: Millis,
) -> Attempt {
    Attempt {
        id: params.new_attempt_id.clone(),
        permit_id: permit.id.clone(),
        tool: req.tool.clone(),
        key_hash,
        fingerprint: req.fingerprint.clone(),
        cost,
        state: AttemptState::InFlight,
        created_at_ms: now,
        updated_at_ms: now,
        lease_expires_at_ms: now.saturating_add(lease_of(params)),
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
        approval: None,
    }
}
