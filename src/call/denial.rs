//! How a denial reaches the agent. Either format answers HTTP 200 with the header
//! `atmost-denial: <code>`:
//!
//! - `result` (default): a JSON-RPC result with `isError: true`,
//!   `structuredContent: {"error": {"code", "message", ...data}}` and the same JSON as text
//!   in `content[0].text`, so a model reads it and stops; `resultType: "complete"` as MCP
//!   2026-07-28 requires (older clients ignore the field).
//! - `error`: a JSON-RPC error object `{"code": <application code>, "message",
//!   "data": {"code": "<code>", ...data}}`, application codes outside -32768..-32000.
//!
//! A denial the ledger made under an authenticated permit carries the permit's figures for
//! the tool ([`crate::call::permit_meta`]): in `result._meta` or `error.data`, and in the headers.

use crate::call::permit_meta;
use crate::call::reply::LocalReply;
use atmost_config::DenialFormat;
use atmost_protocol::Denial;
use serde_json::{json, Map, Value};

/// Header naming the denial code on every denial.
pub const DENIAL_HEADER: &str = "atmost-denial";

/// `{"code", "message", ...data}`; data never overrides `code` or `message`.
fn flat_error(denial: &Denial) -> Map<String, Value> {
    let mut err = Map::new();
    err.insert("code".into(), Value::String(denial.code.as_str().into()));
    err.insert("message".into(), Value::String(denial.message.clone()));
    for (k, v) in &denial.data {
        if k != "code" && k != "message" {
            err.insert(k.clone(), v.clone());
        }
    }
    err
}

/// The local reply for a denial of the request with JSON-RPC `id`.
pub fn render(denial: &Denial, id: &Value, format: DenialFormat) -> LocalReply {
    let mut body = match format {
        DenialFormat::Result => {
            let structured = json!({"error": Value::Object(flat_error(denial))});
            json!({
                "jsonrpc": "2.0",
                "id": id,
                "result": {
                    "content": [{"type": "text", "text": structured.to_string()}],
                    "structuredContent": structured,
                    "isError": true,
                    // Required by MCP 2026-07-28 (clients validate it); older clients ignore it.
                    "resultType": "complete"
                }
            })
        }
        DenialFormat::Error => {
            let mut data = Map::new();
            data.insert("code".into(), Value::String(denial.code.as_str().into()));
            for (k, v) in &denial.data {
                if k != "code" {
                    data.insert(k.clone(), v.clone());
                }
            }
            json!({
                "jsonrpc": "2.0",
                "id": id,
                "error": {
                    "code": denial.code.json_rpc_code(),
                    "message": denial.message,
                    "data": Value::Object(data)
                }
            })
        }
    };
    if let Some(limits) = &denial.limits {
        permit_meta::insert(&mut body, limits);
    }
    LocalReply::json(200, &body)
        .with_header(DENIAL_HEADER, denial.code.as_str())
        .with_limits(denial.limits.as_ref())
}

#[cfg(test)]
mod tests {
    use super::*;
    use atmost_protocol::DenialCode;

    fn cap_denial() -> Denial {
        Denial::new(
            DenialCode::PermitMaxCallsExceeded,
            "cap of 1 reached for pay_invoice",
        )
        .with("tool", "pay_invoice")
        .with("limit", 1)
        .with("calls_made", 1)
    }

    #[test]
    fn result_format() {
        let r = render(&cap_denial(), &json!(42), DenialFormat::Result);
        assert_eq!(r.status, 200);
        assert_eq!(r.header(DENIAL_HEADER), Some("permit_max_calls_exceeded"));
        assert_eq!(r.header("content-type"), Some("application/json"));
        let v = r.body_json().unwrap_or(Value::Null);
        let want_err = json!({"code": "permit_max_calls_exceeded", "message": "cap of 1 reached for pay_invoice",
                              "tool": "pay_invoice", "limit": 1, "calls_made": 1});
        assert_eq!(v["jsonrpc"], "2.0");
        assert_eq!(v["id"], 42);
        assert_eq!(v["result"]["isError"], true);
        assert_eq!(v["result"]["resultType"], "complete");
        assert_eq!(v["result"]["structuredContent"], json!({"error": want_err}));
        assert_eq!(v["result"]["content"][0]["type"], "text");
        let text: Value =
            serde_json::from_str(v["result"]["content"][0]["text"].as_str().unwrap_or(""))
                .unwrap_or(Value::Null);
        assert_eq!(text, v["result"]["structuredContent"]);
        assert!(v.get("error").is_none());
    }

    #[test]
    fn error_format() {
        let r = render(&cap_denial(), &json!("req-1"), DenialFormat::Error);
        assert_eq!(r.status, 200);
        assert_eq!(r.header(DENIAL_HEADER), Some("permit_max_calls_exceeded"));
        let v = r.body_json().unwrap_or(Value::Null);
        assert_eq!(
            v,
            json!({"jsonrpc": "2.0", "id": "req-1", "error": {"code": -31004, "message": "cap of 1 reached for pay_invoice",
                   "data": {"code": "permit_max_calls_exceeded", "tool": "pay_invoice", "limit": 1, "calls_made": 1}}})
        );
    }

    #[test]
    fn data_cannot_override_code_or_message() {
        let d = Denial::new(DenialCode::PermitInvalid, "no permit")
            .with("code", "x")
            .with("message", "y");
        let v = render(&d, &json!(1), DenialFormat::Result)
            .body_json()
            .unwrap_or(Value::Null);
        assert_eq!(
            v["result"]["structuredContent"]["error"]["code"],
            "permit_invalid"
        );
        assert_eq!(
            v["result"]["structuredContent"]["error"]["message"],
            "no permit"
        );
        let v = render(&d, &json!(1), DenialFormat::Error)
            .body_json()
            .unwrap_or(Value::Null);
        assert_eq!(v["error"]["data"]["code"], "permit_invalid");
        assert_eq!(v["error"]["code"], -31001);
    }

    #[test]
    fn every_code_renders_in_both_formats() {
        for code in DenialCode::ALL {
            for f in [DenialFormat::Result, DenialFormat::Error] {
                let r = render(&Denial::new(code, "m"), &json!(1), f);
                assert_eq!(r.header(DENIAL_HEADER), Some(code.as_str()));
                assert!(r.body_json().is_some());
            }
        }
    }

    #[test]
    fn the_permits_figures_ride_in_either_format() {
        let mut d = cap_denial();
        d.limits = Some(
            atmost_protocol::PermitLimits::until("2030-01-01T00:00:00.000Z")
                .with_calls_left(Some(0)),
        );
        let figures =
            json!({"calls_left": 0, "budget_left": null, "expires_at": "2030-01-01T00:00:00.000Z"});
        let r = render(&d, &json!(1), DenialFormat::Result);
        let v = r.body_json().unwrap_or(Value::Null);
        assert_eq!(v["result"]["_meta"], json!({"dev.atmost/permit": figures}));
        // The text a model reads is the structured error alone.
        assert_eq!(
            v["result"]["content"][0]["text"]
                .as_str()
                .map(|t| t.contains("dev.atmost")),
            Some(false)
        );
        assert_eq!(r.header("atmost-calls-left"), Some("0"));
        assert_eq!(r.header("atmost-budget-left"), Some("unlimited"));
        let r = render(&d, &json!(1), DenialFormat::Error);
        let v = r.body_json().unwrap_or(Value::Null);
        assert_eq!(v["error"]["data"]["dev.atmost/permit"], figures);
        assert_eq!(v["error"]["data"]["code"], "permit_max_calls_exceeded");
        assert_eq!(
            r.header("atmost-permit-expires"),
            Some("2030-01-01T00:00:00.000Z")
        );
        // The filter's own denials have no figures, and no figure headers.
        let r = render(&cap_denial(), &json!(1), DenialFormat::Result);
        assert!(r.header("atmost-calls-left").is_none());
        assert!(r
            .body_json()
            .is_some_and(|v| v["result"].get("_meta").is_none()));
    }
}
