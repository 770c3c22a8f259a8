//! The rules of a verifier's refusal (docs/design.md#attempt-states): a proven refusal of
//! this round gives the slot back; anything else leaves it taken.

use atmost_protocol::tool_refusal::{Proof, ToolRefusal};
use atmost_protocol::{DenialCode, Outcome, OutcomeAck, OutcomeReport};

use crate::decide::{apply_outcome, decide, DecideParams, Snapshot};
use crate::model::{Attempt, AttemptState, Permit, Policy};
use crate::token;

const NOW: i64 = 1_800_000_000_000;
const PID: &str = "pmt_000000000000000000000001";
const CAP: &str = "cap-1";
/// The nonce the ledger signed round 1 of [`attempt`] with.
const NONCE: &str = "att_old/1/pmt_000000000000000000000001/pay%20now";

fn attempt() -> Attempt {
    Attempt {
        key_hash: Some(token::sha256_hex("k")),
        capability_hash: Some(token::sha256_hex(CAP)),
        updated_at_ms: NOW - 5_000,
        lease_expires_at_ms: NOW + 50_000,
        ..Attempt::example("att_old", PID, "pay now", AttemptState::InFlight, 5)
    }
}

fn refusal(code: DenialCode, nonce: &str) -> String {
    ToolRefusal {
        code,
        proof: Some(Proof {
            nonce: nonce.into(),
            mac: "ab".repeat(32),
        }),
    }
    .header_value()
}

fn report(round: u32, capability: &str, refusal: String, mac_verified: bool) -> OutcomeReport {
    OutcomeReport {
        attempt_id: "att_old".into(),
        round,
        capability: capability.into(),
        outcome: Outcome::RefusedAtTool {
            refusal,
            mac_verified,
        },
    }
}

fn moved(a: &Attempt, r: &OutcomeReport) -> Attempt {
    let (ack, next) = apply_outcome(Some(a), r, NOW);
    assert_eq!(ack, OutcomeAck::Applied, "{r:?}");
    next.unwrap_or_else(|| panic!("no update for {r:?}"))
}

#[test]
fn a_proven_refusal_of_round_1_gives_the_slot_back_for_each_code_made_before_the_tool() {
    for code in [
        DenialCode::SignatureKeyUnknown,
        DenialCode::SignatureOutsideValidity,
        DenialCode::ContentDigestMismatch,
        DenialCode::SignatureInvalid,
        DenialCode::SignatureMalformed,
        DenialCode::ReplayCacheUnavailable,
    ] {
        let next = moved(&attempt(), &report(1, CAP, refusal(code, NONCE), true));
        assert_eq!(next.state, AttemptState::RefusedAtTool, "{code}");
        assert!(!next.state.holds_slot() && next.state.gave_back());
        assert_eq!(
            next.reason.as_deref(),
            Some(format!("refused_at_tool: {code}").as_str())
        );
        assert_eq!(next.receipt, None, "a refusal is never the key's receipt");
    }
}

#[test]
fn anything_short_of_proof_leaves_the_attempt_uncertain() {
    let cases = [
        // The HMAC did not verify with any key the ledger trusts (a plain upstream's).
        (refusal(DenialCode::SignatureKeyUnknown, NONCE), false),
        // Verified, but over another round's or another attempt's nonce.
        (
            refusal(
                DenialCode::SignatureKeyUnknown,
                "att_old/2/pmt_000000000000000000000001/pay%20now",
            ),
            true,
        ),
        (
            refusal(
                DenialCode::SignatureKeyUnknown,
                "att_other/1/pmt_000000000000000000000001/pay%20now",
            ),
            true,
        ),
        // The same signature was let through before: the tool may have run it.
        (refusal(DenialCode::SignatureReplayed, NONCE), true),
        // No proof at all, or nothing readable.
        ("signature_missing".to_string(), true),
        ("not a refusal".to_string(), true),
    ];
    for (text, verified) in cases {
        let next = moved(&attempt(), &report(1, CAP, text.clone(), verified));
        assert_eq!(next.state, AttemptState::Uncertain, "{text}");
        assert!(next.state.holds_slot());
        assert!(
            next.reason
                .as_deref()
                .is_some_and(|r| r.starts_with("tool_refusal_unproven: ")),
            "{:?}",
            next.reason
        );
    }
}

#[test]
fn a_refusal_moves_only_the_current_round_with_its_capability() {
    let proven = || refusal(DenialCode::SignatureKeyUnknown, NONCE);
    assert_eq!(
        apply_outcome(Some(&attempt()), &report(1, "guess", proven(), true), NOW),
        (OutcomeAck::Refused, None)
    );
    let done = moved(&attempt(), &report(1, CAP, proven(), true));
    assert_eq!(
        apply_outcome(Some(&done), &report(1, CAP, proven(), true), NOW),
        (OutcomeAck::AlreadyRecorded, None)
    );
}

#[test]
fn a_proven_refusal_of_a_continuation_waits_for_input_again() {
    let a = Attempt {
        round: 2,
        capability_hash: Some(token::sha256_hex("cap-2")),
        ..attempt()
    };
    let nonce = "att_old/2/pmt_000000000000000000000001/pay%20now";
    let r = report(
        2,
        "cap-2",
        refusal(DenialCode::SignatureOutsideValidity, nonce),
        true,
    );
    let next = moved(&a, &r);
    assert_eq!(next.state, AttemptState::AwaitingInput);
    assert!(next.state.holds_slot(), "round 1 was sent");
    assert_eq!(next.lease_expires_at_ms, NOW + 55_000, "lease renewed");
}

#[test]
fn the_same_key_after_a_proven_refusal_is_a_new_call() {
    let refused = moved(
        &attempt(),
        &report(
            1,
            CAP,
            refusal(DenialCode::SignatureKeyUnknown, NONCE),
            true,
        ),
    );
    let permit = Permit {
        id: PID.into(),
        token_hash: token::sha256_hex(&format!("atmp_{PID}_{}", "ab".repeat(32))),
        label: "t".into(),
        created_at_ms: NOW - 1000,
        expires_at_ms: NOW + 100_000,
        revoked_at_ms: None,
        policy: Policy::builder().build(),
    };
    let snapshot = Snapshot {
        permit: Some(permit),
        existing: Some(Attempt {
            fingerprint: "fp".into(),
            ..refused
        }),
        now_ms: NOW,
        ..Snapshot::default()
    };
    let req = atmost_protocol::AuthorizeRequest {
        reports: Vec::new(),
        permit_token: format!("atmp_{PID}_{}", "ab".repeat(32)),
        tool: "pay now".into(),
        idempotency_key: Some("k".into()),
        fingerprint: "fp".into(),
        arguments: serde_json::json!({}),
        key_required: false,
        continuation: false,
        forwarded_key: None,
        forwarded_key_carriers: Default::default(),
        dispatch: None,
    };
    let params = DecideParams {
        lease_ms: 60_000,
        approval_wait_ms: 900_000,
        new_attempt_id: "att_new".into(),
        new_capability: "cap-new".into(),
        credential: None,
    };
    let d = decide(&req, &snapshot, &params);
    assert!(
        matches!(d.response, atmost_protocol::AuthorizeResponse::Dispatch { ref attempt_id, .. } if attempt_id == "att_new"),
        "{:?}",
        d.response
    );
}
