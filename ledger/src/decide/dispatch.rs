//! What every dispatch is made of, shared by the rules ([`rules`](super::rules): a new call,
//! a continuation) and an approved call ([`approval`](super::approval)): the permit's expiry,
//! which bars any dispatch ([`permit_expired`], rule 4.1), the dispatch answer ([`dispatch`]),
//! the attempt dispatched again ([`redispatched`]), its lease and the body it is signed over.

use atmost_protocol::{AuthorizeRequest, AuthorizeResponse, Denial, DenialCode};

use super::DecideParams;
use crate::clock::{rfc3339, Millis};
use crate::model::{Attempt, AttemptState, Permit};
use crate::token;

/// Rule 4.1, and the one check before an attempt is dispatched again (a continuation, an
/// approved call): the permit has expired.
pub fn permit_expired(permit: &Permit, now: Millis) -> Option<Denial> {
    (now >= permit.expires_at_ms).then(|| {
        Denial::new(DenialCode::PermitExpired, "the permit has expired")
            .with("expires_at", rfc3339(permit.expires_at_ms))
    })
}

/// The dispatch answer for `round` of an attempt; the limits, signature and credential are
/// filled in after the decision.
pub(super) fn dispatch(
    attempt_id: &str,
    permit: &Permit,
    params: &DecideParams,
    round: u32,
) -> AuthorizeResponse {
    AuthorizeResponse::Dispatch {
        attempt_id: attempt_id.to_string(),
        permit_id: permit.id.clone(),
        lease_ms: params.lease_ms,
        round,
        capability: params.new_capability.clone(),
        limits: None,
        signature: None,
        credential: None,
    }
}

pub(super) fn lease_of(params: &DecideParams) -> Millis {
    i64::try_from(params.lease_ms).unwrap_or(i64::MAX)
}

/// The SHA-256 of the body a dispatch of `req` is signed over, which its attempt records for
/// the round (docs/signatures.md#signed-receipts).
pub(super) fn dispatch_body(req: &AuthorizeRequest) -> Option<String> {
    req.dispatch.as_ref().map(|d| d.body_sha256.clone())
}

/// `existing` dispatched again at `now`, in its current round: `in_flight` with a new lease
/// and a new capability, signed over this request's body (its own).
pub(super) fn redispatched(
    existing: &Attempt,
    req: &AuthorizeRequest,
    params: &DecideParams,
    now: Millis,
) -> Attempt {
    let mut next = existing.clone();
    next.state = AttemptState::InFlight;
    next.updated_at_ms = now;
    next.lease_expires_at_ms = now.saturating_add(lease_of(params));
    next.capability_hash = Some(token::sha256_hex(&params.new_capability));
    next.dispatch_body_sha256 = dispatch_body(req);
    next
}
