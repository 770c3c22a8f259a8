//! Finding the receipt of a dispatched call in the upstream's response: the JSON-RPC
//! response object whose `id` is the request's id (it has `result` or `error` and no
//! `method`, so a server-to-client request reusing the id is not taken for it).
//!
//! An `application/json` body is read whole (bounded by `max_receipt_bytes`); a
//! `text/event-stream` body is scanned event by event as it streams past. The receipt is
//! the response's JSON text verbatim when it stands alone (a whole JSON body or a whole
//! SSE event), else the matching element of a batch array re-serialised.

use crate::sse::{SseParser, TooLarge};
use serde_json::Value;

fn is_response_to(v: &Value, id: &Value) -> bool {
    v.get("id") == Some(id)
        && v.get("method").is_none()
        && (v.get("result").is_some() || v.get("error").is_some())
}

/// A captured response: its text (verbatim when it stood alone) and what it says.
#[derive(Debug, Clone, PartialEq)]
pub struct Captured {
    pub text: String,
    pub kind: ResultKind,
}

/// The receipt in one complete JSON text, if it holds the response to `id`. The text is
/// parsed once; its kind is read from the same tree.
pub fn from_json_text(text: &str, id: &Value) -> Option<Captured> {
    let value: Value = serde_json::from_str(text).ok()?;
    match &value {
        Value::Object(_) if is_response_to(&value, id) => Some(Captured {
            text: text.trim().to_string(),
            kind: kind_of_value(&value),
        }),
        Value::Array(items) => items
            .iter()
            .find(|v| is_response_to(v, id))
            .map(|v| Captured {
                text: v.to_string(),
                kind: kind_of_value(v),
            }),
        _ => None,
    }
}

/// What a captured response says about the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResultKind {
    /// A final result or a JSON-RPC error: the call is complete.
    Final,
    /// MCP 2026-07-28 `resultType: "input_required"`: the server waits for the client's
    /// continuation of the same call.
    InputRequired,
    /// A task handle (`CreateTaskResult`: `result.task.taskId`, or `resultType: "task"`):
    /// the call was accepted, not completed.
    Task,
}

/// Reads the kind of a captured response's text (anything unreadable counts as final).
pub fn kind_of(receipt: &str) -> ResultKind {
    serde_json::from_str::<Value>(receipt).map_or(ResultKind::Final, |v| kind_of_value(&v))
}

fn kind_of_value(v: &Value) -> ResultKind {
    let Some(result) = v.get("result").and_then(Value::as_object) else {
        return ResultKind::Final;
    };
    match result.get("resultType").and_then(Value::as_str) {
        Some("input_required") => return ResultKind::InputRequired,
        Some("task") => return ResultKind::Task,
        _ => {}
    }
    let is_task_handle = result
        .get("task")
        .and_then(Value::as_object)
        .is_some_and(|t| t.get("taskId").is_some_and(Value::is_string))
        && !result.contains_key("content");
    if is_task_handle {
        ResultKind::Task
    } else {
        ResultKind::Final
    }
}

/// The receipt in a whole `application/json` body.
pub fn from_json_body(body: &[u8], id: &Value) -> Option<Captured> {
    from_json_text(std::str::from_utf8(body).ok()?, id)
}

/// What an SSE chunk brought.
#[derive(Debug, Clone, PartialEq)]
pub enum SseProgress {
    /// Not yet.
    Pending,
    /// The response to the request.
    Found(Captured),
    /// An event grew past `max_receipt_bytes`; capture stopped.
    TooLarge,
}

/// Watches an SSE response for the response to one request.
#[derive(Debug, Clone)]
pub struct SseCapture {
    parser: SseParser,
    id: Value,
}

impl SseCapture {
    pub fn new(id: Value, max_event_bytes: usize) -> SseCapture {
        SseCapture {
            parser: SseParser::new(max_event_bytes),
            id,
        }
    }

    /// The stream's last event id so far (see [`SseParser::last_event_id`]).
    pub fn last_event_id(&self) -> Option<&str> {
        self.parser.last_event_id()
    }

    /// Feeds a copy of one chunk.
    pub fn feed(&mut self, chunk: &[u8]) -> SseProgress {
        let mut events = Vec::new();
        let res = self.parser.feed(chunk, &mut events);
        for data in &events {
            if let Some(r) = from_json_text(data, &self.id) {
                return SseProgress::Found(r);
            }
        }
        match res {
            Ok(()) => SseProgress::Pending,
            Err(TooLarge) => SseProgress::TooLarge,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn json_bodies() {
        let body = br#"{"jsonrpc":"2.0","id":5,"result":{"ok":true}}"#;
        assert_eq!(
            from_json_body(body, &json!(5)),
            Some(Captured {
                text: r#"{"jsonrpc":"2.0","id":5,"result":{"ok":true}}"#.into(),
                kind: ResultKind::Final
            })
        );
        assert_eq!(from_json_body(body, &json!(6)), None);
        assert_eq!(from_json_body(body, &json!("5")), None);
        let err = br#"{"jsonrpc":"2.0","id":"a","error":{"code":-32602,"message":"x"}}"#;
        assert!(from_json_body(err, &json!("a")).is_some());
        // A server request reusing the id is not a response.
        let req = br#"{"jsonrpc":"2.0","id":5,"method":"sampling/createMessage","params":{}}"#;
        assert_eq!(from_json_body(req, &json!(5)), None);
        let batch =
            br#"[{"jsonrpc":"2.0","id":4,"result":{}},{"jsonrpc":"2.0","id":5,"result":{"n":1}}]"#;
        assert_eq!(
            from_json_body(batch, &json!(5))
                .and_then(|c| serde_json::from_str::<Value>(&c.text).ok()),
            Some(json!({"jsonrpc":"2.0","id":5,"result":{"n":1}}))
        );
        assert_eq!(from_json_body(b"not json", &json!(5)), None);
        assert_eq!(from_json_body(&[0xff, 0xfe], &json!(5)), None);
    }

    #[test]
    fn sse_stream_finds_the_final_response() {
        let stream = "event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{}}\n\n\
                      data: {\"jsonrpc\":\"2.0\",\"id\":9,\"method\":\"elicitation/create\",\"params\":{}}\n\n\
                      data: {\"jsonrpc\":\"2.0\",\"id\":9,\r\ndata: \"result\":{\"content\":[]}}\r\n\r\n";
        let bytes = stream.as_bytes();
        for split in 0..bytes.len() {
            let mut cap = SseCapture::new(json!(9), 1 << 20);
            let mut found = None;
            for part in [&bytes[..split], &bytes[split..]] {
                if let SseProgress::Found(r) = cap.feed(part) {
                    found = Some(r);
                }
            }
            assert_eq!(
                found.map(|c| c.text).as_deref(),
                Some("{\"jsonrpc\":\"2.0\",\"id\":9,\n\"result\":{\"content\":[]}}"),
                "split at {split}"
            );
        }
    }

    #[test]
    fn result_kinds() {
        for (text, kind) in [
            (
                r#"{"jsonrpc":"2.0","id":1,"result":{"content":[]}}"#,
                ResultKind::Final,
            ),
            (
                r#"{"jsonrpc":"2.0","id":1,"error":{"code":1,"message":"m"}}"#,
                ResultKind::Final,
            ),
            ("not json", ResultKind::Final),
            (
                r#"{"jsonrpc":"2.0","id":1,"result":{"resultType":"complete","content":[]}}"#,
                ResultKind::Final,
            ),
            (
                r#"{"jsonrpc":"2.0","id":1,"result":{"resultType":"input_required","inputRequests":{},"requestState":"s"}}"#,
                ResultKind::InputRequired,
            ),
            (
                r#"{"jsonrpc":"2.0","id":1,"result":{"task":{"taskId":"t1","status":"working","createdAt":"x","lastUpdatedAt":"x","ttl":null}}}"#,
                ResultKind::Task,
            ),
            (
                r#"{"jsonrpc":"2.0","id":1,"result":{"resultType":"task","task":{"taskId":"t1"}}}"#,
                ResultKind::Task,
            ),
            // A tool result that happens to hold a `task` field is still a result.
            (
                r#"{"jsonrpc":"2.0","id":1,"result":{"content":[],"task":{"taskId":"t1"}}}"#,
                ResultKind::Final,
            ),
        ] {
            assert_eq!(kind_of(text), kind, "{text}");
            // Captured responses carry the same kind, read from the one parse.
            if let Some(c) = from_json_text(text, &json!(1)) {
                assert_eq!(c.kind, kind, "{text}");
            }
        }
    }

    #[test]
    fn a_batch_element_keeps_its_own_kind() {
        let batch = r#"[{"jsonrpc":"2.0","id":1,"result":{"content":[]}},{"jsonrpc":"2.0","id":2,"result":{"resultType":"input_required","requestState":"s"}}]"#;
        assert_eq!(
            from_json_text(batch, &json!(2)).map(|c| c.kind),
            Some(ResultKind::InputRequired)
        );
        assert_eq!(
            from_json_text(batch, &json!(1)).map(|c| c.kind),
            Some(ResultKind::Final)
        );
    }

    #[test]
    fn sse_too_large() {
        let mut cap = SseCapture::new(json!(1), 10);
        assert_eq!(
            cap.feed(b"data: {\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}\n\n"),
            SseProgress::TooLarge
        );
    }
}
