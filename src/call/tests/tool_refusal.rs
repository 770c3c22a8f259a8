//! A dispatch a verifier at the tool refused: the refusal is never the key's receipt; the
//! filter reports it as `refused_at_tool` with the verifier's header, for the ledger to check
//! (docs/signatures.md, "A refusal at the tool").

use super::*;

const REFUSAL: &str = r#"{"jsonrpc":"2.0","id":7,"error":{"code":-31022,"message":"unknown key","data":{"code":"signature_key_unknown"}}}"#;

fn refused_head(refusal: &str) -> ResponseHead {
    ResponseHead {
        tool_refusal: Some(refusal.into()),
        ..json_head()
    }
}

fn one_attempt() -> LogProps {
    LogProps {
        attempts: Some(1),
        flags: Some(0),
    }
}

#[test]
fn a_refusal_at_the_tool_is_reported_as_such_and_never_as_a_receipt() {
    let header = format!(
        "signature_key_unknown att_1/1/pmt_1/pay_invoice {}",
        "ab".repeat(32)
    );
    let mut call = dispatched(cfg());
    let s = call.on_response_headers(refused_head(&header));
    assert_eq!(s.flow, Flow::Continue);
    assert_eq!(call.state_name(), "refused_at_tool");
    // The verifier's answer passes to the client as it is: nothing is read or held.
    assert_eq!(
        call.on_response_body(REFUSAL.len(), true),
        BodyStep::Done(Step::cont())
    );
    let s = call.on_log(one_attempt());
    let reports = enqueued(&s);
    assert_eq!(reports.len(), 1);
    assert_eq!(
        reports[0].outcome,
        Outcome::RefusedAtTool {
            refusal: header,
            mac_verified: false
        }
    );
    assert!(counts(&s).contains(&Stat::RefusedAtTool));
}

#[test]
fn without_the_header_the_same_answer_is_the_keys_receipt() {
    // The control: the very same JSON-RPC error, without the verifier's header, is what the
    // upstream answered, and is recorded as the call's receipt.
    let mut call = dispatched(cfg());
    call.on_response_headers(json_head());
    let len = read(call.on_response_body(REFUSAL.len(), true));
    let s = call.on_response_body_data(&REFUSAL.as_bytes()[..len], true);
    assert!(
        s.effects.iter().any(|e| matches!(e, Effect::Complete(r)
            if matches!(&r.outcome, Outcome::Completed { receipt } if receipt == REFUSAL)))
            || s.callout.is_some(),
        "{s:?}"
    );
}

#[test]
fn a_refusal_after_more_than_one_attempt_is_uncertain() {
    let mut call = dispatched(cfg());
    call.on_response_headers(refused_head("signature_key_unknown"));
    let s = call.on_log(LogProps {
        attempts: Some(2),
        flags: Some(0),
    });
    assert!(
        matches!(&enqueued(&s)[0].outcome, Outcome::Uncertain { reason } if reason.starts_with("more_than_one_attempt"))
    );
}
