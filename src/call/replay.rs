//! Answering a call from a stored receipt: the stored JSON-RPC response with its `id`
//! replaced by the current request's id and `result._meta["dev.atmost/replayed"] = true`
//! (an `error` response is left as it is), sent with `idempotent-replayed: true`, and the
//! permit's figures as they stand ([`crate::call::permit_meta`]).

use crate::call::permit_meta;
use crate::call::reply::LocalReply;
use atmost_protocol::PermitLimits;
use serde_json::{Map, Value};

/// `_meta` key marking a replayed result.
pub const REPLAYED_META: &str = "dev.atmost/replayed";
/// Header marking a replayed response.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// The stored receipt is not a JSON-RPC response object.
#[derive(Debug, Clone, PartialEq)]
pub struct UnreadableReceipt;

/// The rewritten receipt body.
pub fn rewrite(receipt: &str, id: &Value) -> Result<Value, UnreadableReceipt> {
    let Ok(Value::Object(mut obj)) = serde_json::from_str::<Value>(receipt) else {
        return Err(UnreadableReceipt);
    };
    obj.insert("id".into(), id.clone());
    if let Some(Value::Object(result)) = obj.get_mut("result") {
        let meta = result
            .entry("_meta")
            .or_insert_with(|| Value::Object(Map::new()));
        if !meta.is_object() {
            *meta = Value::Object(Map::new());
        }
        if let Value::Object(meta) = meta {
            meta.insert(REPLAYED_META.into(), Value::Bool(true));
        }
    }
    Ok(Value::Object(obj))
}

/// The local reply for a replay: HTTP 200, JSON, `idempotent-replayed: true`; with the
/// permit's figures in the body and the headers when the ledger gave them.
pub fn render(
    receipt: &str,
    id: &Value,
    limits: Option<&PermitLimits>,
) -> Result<LocalReply, UnreadableReceipt> {
    let mut body = rewrite(receipt, id)?;
    if let Some(limits) = limits {
        permit_meta::insert(&mut body, limits);
    }
    Ok(LocalReply::json(200, &body)
        .with_header(REPLAYED_HEADER, "true")
        .with_limits(limits))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn replaces_id_and_marks_result() {
        let stored = r#"{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"paid"}],"_meta":{"x":1}}}"#;
        let r = render(stored, &json!("new-7"), None).ok();
        let r = r.as_ref();
        assert_eq!(r.map(|r| r.status), Some(200));
        assert_eq!(r.and_then(|r| r.header(REPLAYED_HEADER)), Some("true"));
        assert_eq!(
            r.and_then(|r| r.header("content-type")),
            Some("application/json")
        );
        assert_eq!(
            r.and_then(|r| r.body_json()),
            Some(
                json!({"jsonrpc":"2.0","id":"new-7","result":{"content":[{"type":"text","text":"paid"}],
                        "_meta":{"x":1,"dev.atmost/replayed":true}}})
            )
        );
    }

    #[test]
    fn creates_meta_when_missing_or_not_an_object() {
        let v = rewrite(r#"{"jsonrpc":"2.0","id":1,"result":{}}"#, &json!(2)).ok();
        assert_eq!(
            v,
            Some(json!({"jsonrpc":"2.0","id":2,"result":{"_meta":{"dev.atmost/replayed":true}}}))
        );
        let v = rewrite(
            r#"{"jsonrpc":"2.0","id":1,"result":{"_meta":7}}"#,
            &json!(2),
        )
        .ok();
        assert_eq!(
            v.map(|v| v["result"]["_meta"].clone()),
            Some(json!({"dev.atmost/replayed":true}))
        );
    }

    #[test]
    fn error_responses_keep_their_error() {
        let stored = r#"{"jsonrpc":"2.0","id":1,"error":{"code":-32602,"message":"bad"}}"#;
        let r = render(stored, &json!(9), None).ok();
        assert_eq!(
            r.as_ref().and_then(|r| r.header(REPLAYED_HEADER)),
            Some("true")
        );
        assert_eq!(
            r.and_then(|r| r.body_json()),
            Some(json!({"jsonrpc":"2.0","id":9,"error":{"code":-32602,"message":"bad"}}))
        );
    }

    #[test]
    fn unreadable_receipts_are_refused() {
        assert_eq!(rewrite("not json", &json!(1)), Err(UnreadableReceipt));
        assert_eq!(rewrite("[1]", &json!(1)), Err(UnreadableReceipt));
    }

    #[test]
    fn the_permits_figures_ride_in_meta_and_headers() {
        let limits = PermitLimits::until("2030-01-01T00:00:00.000Z")
            .with_calls_left(Some(0))
            .with_budget_left(Some(250));
        let stored = r#"{"jsonrpc":"2.0","id":1,"result":{"content":[]}}"#;
        let r = render(stored, &json!(3), Some(&limits)).ok();
        let r = r.as_ref();
        assert_eq!(
            r.and_then(|r| r.body_json())
                .map(|v| v["result"]["_meta"].clone()),
            Some(json!({"dev.atmost/replayed": true, "dev.atmost/permit":
                {"calls_left": 0, "budget_left": 250, "expires_at": "2030-01-01T00:00:00.000Z"}}))
        );
        assert_eq!(r.and_then(|r| r.header("atmost-calls-left")), Some("0"));
        assert_eq!(r.and_then(|r| r.header("atmost-budget-left")), Some("250"));
        assert_eq!(
            r.and_then(|r| r.header("atmost-permit-expires")),
            Some("2030-01-01T00:00:00.000Z")
        );
        // A stored error answer carries them in its data.
        let stored = r#"{"jsonrpc":"2.0","id":1,"error":{"code":-32602,"message":"bad"}}"#;
        let v = render(stored, &json!(3), Some(&limits))
            .ok()
            .and_then(|r| r.body_json());
        assert_eq!(
            v.map(|v| v["error"]["data"]["dev.atmost/permit"]["budget_left"].clone()),
            Some(json!(250))
        );
    }
}
