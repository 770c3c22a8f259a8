//! One governed `tools/call` through the filter's state machine, shared by the criterion
//! bench (`benches/filter.rs`, by path) and the call-cost driver.

use std::cell::RefCell;
use std::hint::black_box;
use std::rc::Rc;

use atmost_config::Config;
use atmost_filter::call::{BodyStep, Call, RequestHead, ResponseHead};
use atmost_filter::ledger_client::LedgerReply;
use atmost_protocol::signature::{self, DispatchNonce};
use atmost_protocol::AuthorizeRequest;
use serde_json::{json, Value};

/// A call with its key in `_meta` and three arguments.
pub const CALL: &[u8] = br#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"pay_invoice","arguments":{"invoice":"INV-1","amount":250,"memo":"quarterly"},"_meta":{"dev.atmost/idempotency-key":"task-4417-pay"}}}"#;
pub const CONFIG: &[u8] = br#"{"ledger":{"cluster":"atmost_ledger","service_token":"svc-token-0123456789abcdef0123456789"},"upstream_key":{"mode":"hmac","secret":"0123456789abcdef0123"}}"#;
/// A permit token of the ledger's shape, and the permit it names.
const TOKEN: &[u8] =
    b"atmp_pmt_0123456789abcdef01234567_0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
const PERMIT_ID: &str = "pmt_0123456789abcdef01234567";

thread_local! {
    /// The Dispatch answer, made once: signing is the ledger's work, not the filter's.
    static DISPATCH: RefCell<Option<Vec<u8>>> = const { RefCell::new(None) };
}

/// A Dispatch answer as the ledger gives it under a capped permit: round, capability, the
/// permit's figures (which the filter writes into the answer) and the signature over the
/// request the authorize callout (`asked`) named; the signature's bytes stand in.
fn dispatch_answer(asked: &[u8]) -> Vec<u8> {
    let signature = serde_json::from_slice::<AuthorizeRequest>(asked)
        .ok()
        .and_then(|asked| {
            let target = asked.dispatch?;
            let nonce = DispatchNonce {
                attempt_id: "att_1".into(),
                round: 1,
                permit_id: PERMIT_ID.into(),
                tool: asked.tool,
            };
            let (input, _) = target.to_sign(
                1_764_680_000,
                "kPrK_qmxVWaYVA9wwBF6Iuo3vVzz7TxHCTwXBygrS4k",
                &nonce,
            )?;
            Some(json!({"signature_input": input.header_value(),
                        "signature": signature::signature_header(&[7; 64])}))
        })
        .unwrap_or(Value::Null);
    json!({"decision":"dispatch","attempt_id":"att_1","permit_id":PERMIT_ID,"lease_ms":120000,"round":1,
           "capability":"9f2c4e6a8b0d1f3e5a7c9b1d3f5e7a9c0b2d4f6e8a1c3e5b7d9f1a3c5e7b9d1f",
           "limits":{"calls_left":4,"budget_left":9750,"expires_at":"2027-01-01T00:00:00Z"},
           "signature": signature})
    .to_string()
    .into_bytes()
}
const RESPONSE: &[u8] = br#"{"jsonrpc":"2.0","id":3,"result":{"content":[{"type":"text","text":"ok"}],"isError":false}}"#;

/// One call: request → authorize answer → dispatch → JSON response → completed report.
/// `false` if the machine did not take the path of a dispatched, completed call.
pub fn one_call(config: &Rc<Config>) -> bool {
    let mut call = Call::new(Rc::clone(config));
    call.on_request_headers(RequestHead {
        method: "POST".into(),
        permit: vec![TOKEN.to_vec()],
        content_length: Some(CALL.len() as u64),
        ..RequestHead::default()
    });
    let BodyStep::Read { .. } = call.on_request_body(CALL.len(), true) else {
        return false;
    };
    let Some(asked) = call.on_request_body_data(CALL).callout else {
        return false;
    };
    let body = DISPATCH.with(|d| {
        d.borrow_mut()
            .get_or_insert_with(|| dispatch_answer(&asked.body))
            .clone()
    });
    call.on_ledger_reply(&LedgerReply {
        status: Some(200),
        body,
    });
    call.on_response_headers(ResponseHead {
        content_type: Some("application/json".into()),
        end_of_stream: false,
        tool_refusal: None,
    });
    let _ = call.on_response_body(RESPONSE.len(), true);
    black_box(call.on_response_body_data(RESPONSE, true));
    call.is_reporting()
}
