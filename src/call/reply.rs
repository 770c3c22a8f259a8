//! Local replies: answers the filter sends itself, without going upstream.

use crate::call::permit_meta;
use atmost_protocol::PermitLimits;
use serde_json::{json, Value};

/// An HTTP response the filter sends in place of the upstream's (`send_http_response`).
/// Sending one ends the request: nothing is resumed after it.
#[derive(Debug, Clone, PartialEq)]
pub struct LocalReply {
    pub status: u32,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// JSON-RPC 2.0 error codes used for requests the filter refuses to read.
pub mod rpc_code {
    /// Body is not JSON.
    pub const PARSE_ERROR: i64 = -32700;
    /// JSON, but not a JSON-RPC message, or a batch holding `tools/call`, or too large.
    pub const INVALID_REQUEST: i64 = -32600;
    /// `tools/call` whose `params` are malformed.
    pub const INVALID_PARAMS: i64 = -32602;
    /// The filter could not carry out its own edits of a request (it was not sent).
    pub const INTERNAL_ERROR: i64 = -32603;
    /// MCP 2026-07-28: mirrored `Mcp-Method` / `Mcp-Name` header disagrees with the body.
    pub const HEADER_MISMATCH: i64 = -32020;
}

impl LocalReply {
    /// A JSON body with `content-type: application/json`.
    pub fn json(status: u32, body: &Value) -> LocalReply {
        LocalReply {
            status,
            headers: vec![("content-type".to_string(), "application/json".to_string())],
            body: body.to_string().into_bytes(),
        }
    }

    /// A JSON-RPC error object answering request `id` (`null` when unknown).
    pub fn rpc_error(status: u32, id: Option<&Value>, code: i64, message: &str) -> LocalReply {
        let id = id.cloned().unwrap_or(Value::Null);
        LocalReply::json(
            status,
            &json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}}),
        )
    }

    /// The answer to every request when the plugin has no valid configuration: refused
    /// (fail closed), never passed unchecked.
    pub fn not_configured() -> LocalReply {
        LocalReply {
            status: 503,
            headers: vec![("content-type".to_string(), "application/json".to_string())],
            body: br#"{"jsonrpc":"2.0","id":null,"error":{"code":-32603,"message":"atmost filter is not configured"}}"#.to_vec(),
        }
    }

    /// Adds a header.
    pub fn with_header(mut self, name: &str, value: &str) -> LocalReply {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    /// Adds the headers carrying the permit's figures, when there are figures.
    pub fn with_limits(mut self, limits: Option<&PermitLimits>) -> LocalReply {
        for (name, value) in limits.map(permit_meta::headers).into_iter().flatten() {
            self.headers.push((name.to_string(), value));
        }
        self
    }

    /// The body parsed as JSON (tests and logs).
    pub fn body_json(&self) -> Option<Value> {
        serde_json::from_slice(&self.body).ok()
    }

    /// First value of a header, by lowercase name.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rpc_error_uses_the_given_id_or_null() {
        let r = LocalReply::rpc_error(400, Some(&json!(7)), rpc_code::PARSE_ERROR, "Parse error");
        assert_eq!(r.status, 400);
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(
            r.body_json(),
            Some(json!({"jsonrpc":"2.0","id":7,"error":{"code":-32700,"message":"Parse error"}}))
        );
        let r = LocalReply::rpc_error(413, None, rpc_code::INVALID_REQUEST, "x");
        assert_eq!(r.body_json().map(|v| v["id"].clone()), Some(Value::Null));
    }

    #[test]
    fn without_a_configuration_every_request_is_refused_503() {
        let r = LocalReply::not_configured();
        assert_eq!(r.status, 503);
        assert_eq!(
            r.headers,
            [("content-type".to_string(), "application/json".to_string())]
        );
        assert_eq!(
            r.body_json(),
            Some(
                json!({"jsonrpc":"2.0","id":null,"error":{"code":rpc_code::INTERNAL_ERROR,"message":"atmost filter is not configured"}})
            )
        );
    }
}
