//! One governed `tools/call` through the filter's state machine, shared by the criterion
//! bench (`benches/filter.rs`, by path) and the call-cost driver.

use std::hint::black_box;
use std::rc::Rc;

use atmost_config::Config;
use atmost_filter::call::{BodyStep, Call, RequestHead, ResponseHead};
use atmost_filter::ledger_client::LedgerReply;

/// A call with its key in `_meta` and three arguments.
pub const CALL: &[u8] = br#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"pay_invoice","arguments":{"invoice":"INV-1","amount":250,"memo":"quarterly"},"_meta":{"dev.atmost/idempotency-key":"task-4417-pay"}}}"#;
pub const CONFIG: &[u8] = br#"{"ledger":{"cluster":"atmost_ledger","service_token":"svc"},"upstream_key":{"mode":"hmac","secret":"0123456789abcdef0123"}}"#;
/// A Dispatch answer as the ledger gives it under a capped permit: round, capability and the
/// permit's figures, which the filter writes into the answer.
const DISPATCH: &[u8] = br#"{"decision":"dispatch","attempt_id":"att-1","permit_id":"p1","lease_ms":120000,"round":1,"capability":"9f2c4e6a8b0d1f3e5a7c9b1d3f5e7a9c0b2d4f6e8a1c3e5b7d9f1a3c5e7b9d1f","limits":{"calls_left":4,"budget_left":9750,"expires_at":"2027-01-01T00:00:00Z"}}"#;
const RESPONSE: &[u8] = br#"{"jsonrpc":"2.0","id":3,"result":{"content":[{"type":"text","text":"ok"}],"isError":false}}"#;

/// One call: request → authorize answer → dispatch → JSON response → completed report.
/// `false` if the machine did not take the path of a dispatched, completed call.
pub fn one_call(config: &Rc<Config>) -> bool {
    let mut call = Call::new(Rc::clone(config));
    call.on_request_headers(RequestHead {
        method: "POST".into(),
        permit: vec![b"p1.secret".to_vec()],
        content_length: Some(CALL.len() as u64),
        ..RequestHead::default()
    });
    let BodyStep::Read { .. } = call.on_request_body(CALL.len(), true) else {
        return false;
    };
    if call.on_request_body_data(CALL).callout.is_none() {
        return false;
    }
    call.on_ledger_reply(&LedgerReply {
        status: Some(200),
        body: DISPATCH.to_vec(),
    });
    call.on_response_headers(ResponseHead {
        content_type: Some("application/json".into()),
        end_of_stream: false,
    });
    let _ = call.on_response_body(RESPONSE.len(), true);
    black_box(call.on_response_body_data(RESPONSE, true));
    call.is_reporting()
}
