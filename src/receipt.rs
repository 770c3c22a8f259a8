//! Finding the receipt of a dispatched call in the upstream's response: the JSON-RPC
//! response object whose `id` is the request's id (it has `result` or `error` and no
//! `method`, so a server-to-client request reusing the id is not taken for it).
//!
//! An `application/json` body is read whole (bounded by `max_receipt_bytes`); a
//! `text/event-stream` body is scanned event by event as it streams past. The receipt is
//! the response's JSON text verbatim when it stands alone (a whole JSON body or a whole
//! SSE event), else the matching element of a batch array re-serialised.

use crate::sse::{Event, SseParser, TooLarge};
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
    /// The start of an unfinished event, held back from the stream by [`SseCapture::pass`].
    held: Vec<u8>,
    /// Holding gave up (an unfinished event grew past the limit, or the host refused an
    /// edit): chunks go on as they come.
    unheld: bool,
}

/// A chunk of a watched stream, as it is to go on (see [`SseCapture::pass`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Passed {
    pub progress: SseProgress,
    /// The bytes Envoy's buffer must hold instead of the chunk; `None`: the chunk as it came.
    pub release: Option<Vec<u8>>,
    /// With [`SseProgress::Found`], when the response's event stands whole in the released
    /// bytes: the event, and the stream offset of the first released byte.
    pub found: Option<(Event, u64)>,
}

impl SseCapture {
    pub fn new(id: Value, max_event_bytes: usize) -> SseCapture {
        SseCapture {
            parser: SseParser::new(max_event_bytes),
            id,
            held: Vec::new(),
            unheld: false,
        }
    }

    /// The stream's last event id so far (see [`SseParser::last_event_id`]).
    pub fn last_event_id(&self) -> Option<&str> {
        self.parser.last_event_id()
    }

    /// Feeds a copy of one chunk.
    pub fn feed(&mut self, chunk: &[u8]) -> SseProgress {
        self.scan(chunk).0
    }

    fn scan(&mut self, chunk: &[u8]) -> (SseProgress, Option<Event>) {
        let mut events = Vec::new();
        let res = self.parser.feed_events(chunk, &mut events);
        for e in events {
            if let Some(r) = from_json_text(&e.data, &self.id) {
                return (SseProgress::Found(r), Some(e));
            }
        }
        match res {
            Ok(()) => (SseProgress::Pending, None),
            Err(TooLarge) => (SseProgress::TooLarge, None),
        }
    }

    /// Feeds one chunk of a stream whose response the filter edits, and says what goes on in
    /// its place: an unfinished event at the end of the stream so far is held back (no
    /// client can use half an event) and put in front of the next chunk, so that the
    /// response's event stands whole in one buffer when it is found. Once it is found,
    /// nothing more is held. Holding stops for good (everything held goes on) when the held
    /// bytes would pass the event limit, and at the end of the stream.
    pub fn pass(&mut self, chunk: &[u8], end_of_stream: bool) -> Passed {
        let base = self.parser.position() - self.held.len() as u64;
        let (progress, event) = self.scan(chunk);
        let had_held = !self.held.is_empty();
        let mut bytes = std::mem::take(&mut self.held);
        bytes.extend_from_slice(chunk);
        let keep_from = match (&progress, self.parser.pending_start()) {
            (SseProgress::Pending, Some(start)) if !end_of_stream && !self.unheld => {
                usize::try_from(start - base).ok()
            }
            _ => None,
        };
        if let Some(from) = keep_from {
            if bytes.len() - from > self.parser_limit() {
                self.unheld = true;
            } else {
                self.held = bytes.split_off(from);
            }
        }
        let found = event.filter(|e| e.start >= base).map(|e| (e, base));
        let release = (had_held || !self.held.is_empty()).then_some(bytes);
        Passed {
            progress,
            release,
            found,
        }
    }

    fn parser_limit(&self) -> usize {
        self.parser.max_event_bytes()
    }

    /// The host refused to put the released bytes in place: whatever was held is lost to
    /// this stream, and nothing more is held.
    pub fn stop_holding(&mut self) {
        self.held = Vec::new();
        self.unheld = true;
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

    /// What the chunk that found the response released, the event, and the stream offset of
    /// the released bytes.
    type FoundIn = (Vec<u8>, Event, u64);

    /// Passes `stream` cut at `cuts` through a capture for id 9: every chunk as released,
    /// and where the response was found.
    fn pass_all(stream: &[u8], cuts: &[usize]) -> (Vec<Vec<u8>>, Option<FoundIn>) {
        let mut cap = SseCapture::new(json!(9), 1 << 20);
        let mut out = Vec::new();
        let mut found = None;
        let mut from = 0;
        let ends: Vec<usize> = cuts.iter().copied().chain([stream.len()]).collect();
        for (n, &to) in ends.iter().enumerate() {
            let chunk = &stream[from..to];
            from = to;
            let p = cap.pass(chunk, n + 1 == ends.len());
            let released = p.release.clone().unwrap_or_else(|| chunk.to_vec());
            if let (SseProgress::Found(_), Some((e, base))) = (&p.progress, p.found) {
                found = Some((released.clone(), e, base));
            }
            out.push(released);
        }
        (out, found)
    }

    const STREAM: &str = "id: 1\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{}}\n\n\
                          id: 2\r\ndata: {\"jsonrpc\":\"2.0\",\"id\":9,\r\ndata: \"result\":{\"content\":[]}}\r\n\r\n: bye\n";

    #[test]
    fn a_split_response_event_is_held_until_whole_and_nothing_is_lost() {
        let bytes = STREAM.as_bytes();
        let second = STREAM.find("id: 2").unwrap_or(0);
        for cut in 1..bytes.len() {
            let (out, found) = pass_all(bytes, &[cut]);
            assert_eq!(out.concat(), bytes, "cut at {cut}");
            let (released, e, base) = found.unwrap_or_else(|| panic!("not found, cut at {cut}"));
            // The whole event is in the released bytes, at the offsets the event gives.
            let start = usize::try_from(e.start - base).unwrap_or(usize::MAX);
            let end = usize::try_from(e.end - base).unwrap_or(usize::MAX);
            assert_eq!(
                &released[start..end],
                &bytes[second..second + (end - start)],
                "cut at {cut}"
            );
            assert_eq!(
                e.data,
                "{\"jsonrpc\":\"2.0\",\"id\":9,\n\"result\":{\"content\":[]}}"
            );
            if cut >= second {
                // The first event went out whole with the first chunk: nothing complete waits.
                assert!(out[0].starts_with(&bytes[..second]), "cut at {cut}");
            }
        }
    }

    #[test]
    fn chunks_ending_between_events_go_on_as_they_came() {
        let mut cap = SseCapture::new(json!(9), 1 << 20);
        let p = cap.pass(b"data: {\"jsonrpc\":\"2.0\",\"method\":\"x\"}\n\n", false);
        assert_eq!(
            (p.progress, p.release, p.found),
            (SseProgress::Pending, None, None)
        );
        // A partial event is held back, and goes on in front of the next chunk.
        let p = cap.pass(b"data: {\"jsonrpc\"", false);
        assert_eq!(p.release, Some(Vec::new()));
        let p = cap.pass(b":\"2.0\",\"method\":\"y\"}\n\n", false);
        assert_eq!(
            p.release.as_deref(),
            Some(&b"data: {\"jsonrpc\":\"2.0\",\"method\":\"y\"}\n\n"[..])
        );
        // At the end of the stream nothing is held.
        let p = cap.pass(b"data: {\"unfinished\"", true);
        assert_eq!(p.release, None);
    }

    #[test]
    fn holding_gives_up_past_the_event_limit_and_then_finds_no_whole_event() {
        let mut cap = SseCapture::new(json!(9), 64);
        // Comment lines do not count against the event's data, but the held bytes do.
        let p = cap.pass(b"id: 1\n", false);
        assert_eq!(p.release, Some(Vec::new()));
        let comment = format!(": {}\n", "x".repeat(37));
        let p = cap.pass(comment.as_bytes(), false);
        assert_eq!(p.release, Some(Vec::new()), "46 bytes held");
        let p = cap.pass(comment.as_bytes(), false);
        assert_eq!(p.release.map(|r| r.len()), Some(6 + 2 * comment.len()));
        let p = cap.pass(
            b"data: {\"jsonrpc\":\"2.0\",\"id\":9,\"result\":{}}\n\n",
            false,
        );
        assert!(matches!(p.progress, SseProgress::Found(_)));
        assert_eq!(
            (p.release, p.found),
            (None, None),
            "the event began in bytes already gone"
        );
    }

    #[test]
    fn a_refused_release_stops_holding() {
        let mut cap = SseCapture::new(json!(9), 1 << 20);
        assert_eq!(cap.pass(b"data: {", false).release, Some(Vec::new()));
        cap.stop_holding();
        let p = cap.pass(b"}\n\ndata: {", false);
        assert_eq!(p.release, None);
    }
}
