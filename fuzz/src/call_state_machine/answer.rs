//! The upstream's answer as Envoy carries it to the client, for the state machine check:
//! what a response callback holds (`Pause`) stays in Envoy's buffer, what one lets go
//! (`Continue`) or the filter resumes goes on, and a body edit replaces bytes at the start
//! of that buffer. What reached the client is then compared with what the upstream sent.

use crate::plain;
use atmost_filter::call::permit_meta::PERMIT_META;
use atmost_filter::call::Flow;
use atmost_protocol::PermitLimits;
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// One response, from its headers to its end.
#[derive(Debug, Default)]
pub(super) struct Answer {
    /// Its headers were delivered (once).
    pub started: bool,
    /// The whole body the upstream sends.
    pub body: Vec<u8>,
    /// Its `content-type` is `text/event-stream`.
    pub sse: bool,
    pub trailers: bool,
    /// Body bytes delivered to Envoy so far.
    pub arrived: usize,
    /// The upstream's end of stream was delivered.
    pub finished: bool,
    /// Envoy's buffer: bytes delivered and not passed on yet.
    pub buffer: Vec<u8>,
    /// The filter holds the answer (a callback paused it and nothing let it go since).
    pub held: bool,
    /// What went on to the client.
    pub client: Vec<u8>,
    /// `content-length` was removed, so the body may change its length.
    pub length_removed: bool,
    /// The host refused a response edit.
    pub edit_refused: bool,
    /// A body edit named more bytes than Envoy held.
    pub replaced_past_end: bool,
}

impl Answer {
    /// The next chunk of the body arrives in Envoy's buffer: `take` more bytes. `None` when
    /// the body is all there; else whether this chunk ends the stream.
    pub fn deliver(&mut self, take: u16) -> Option<bool> {
        if !self.started || self.finished || self.arrived == self.body.len() {
            return None;
        }
        let to = (self.arrived + usize::from(take)).min(self.body.len());
        self.buffer.extend_from_slice(&self.body[self.arrived..to]);
        self.arrived = to;
        self.finished = to == self.body.len() && !self.trailers;
        Some(self.finished)
    }

    /// The trailers arrive (after the whole body): whether they may now.
    pub fn deliver_trailers(&mut self) -> bool {
        if !self.started || self.finished || !self.trailers || self.arrived < self.body.len() {
            return false;
        }
        self.finished = true;
        true
    }

    /// `set_buffer(0, original_len, body)`: as Envoy does it, a length past the end
    /// replaces the whole buffer.
    pub fn replace(&mut self, original_len: usize, body: &[u8]) {
        if original_len > self.buffer.len() {
            self.replaced_past_end = true;
        }
        let n = original_len.min(self.buffer.len());
        self.buffer.splice(..n, body.iter().copied());
    }

    /// Everything Envoy holds goes on (a callback's `Continue`, or `resume_http_response`).
    pub fn pass_on(&mut self) {
        self.client.append(&mut self.buffer);
        self.held = false;
    }

    /// What a response callback's flow does with what Envoy holds.
    pub fn after_callback(&mut self, flow: Flow) {
        match flow {
            Flow::Continue => self.pass_on(),
            Flow::Pause => self.held = true,
        }
    }
}

/// `v` is the JSON-RPC response to `id` (as the filter and a receipt read one).
fn is_response_to(v: &Value, id: &Value) -> bool {
    v.get("id") == Some(id)
        && v.get("method").is_none()
        && (v.get("result").is_some() || v.get("error").is_some())
}

/// The response to `id` in a message: the message itself, or the first element of a batch
/// that is one.
fn response_to<'a>(message: &'a mut Value, id: &Value) -> Option<&'a mut Value> {
    if is_response_to(message, id) {
        return Some(message);
    }
    message
        .as_array_mut()?
        .iter_mut()
        .find(|m| is_response_to(m, id))
}

/// The JSON texts an answer carries: the whole body, or the data of each event.
fn texts(body: &[u8], sse: bool) -> Vec<Vec<u8>> {
    if sse {
        crate::sse::reference(body)
            .0
            .into_iter()
            .map(String::into_bytes)
            .collect()
    } else {
        vec![body.to_vec()]
    }
}

/// The names of the tools any `tools/list` response to `id` in the answer lists.
pub(super) fn listed_names(body: &[u8], sse: bool, id: &Value) -> Vec<String> {
    let mut names = Vec::new();
    for text in texts(body, sse) {
        let Some(mut message) = plain::read(&text) else {
            continue;
        };
        let messages: Vec<Value> = match message.take() {
            Value::Array(items) => items,
            other => vec![other],
        };
        for m in messages.iter().filter(|m| is_response_to(m, id)) {
            let tools = m["result"]["tools"].as_array().cloned().unwrap_or_default();
            names.extend(
                tools
                    .iter()
                    .filter_map(|t| t.get("name")?.as_str().map(str::to_string)),
            );
        }
    }
    names
}

/// `message` as the client must get it once the figures are in: in the response to `id`,
/// each object of `result.tools` whose `name` has figures gets them in
/// `_meta["dev.atmost/permit"]` (a `_meta` that is not an object is replaced).
fn with_figures(mut message: Value, id: &Value, figures: &BTreeMap<String, PermitLimits>) -> Value {
    let tools = response_to(&mut message, id)
        .and_then(|r| r.get_mut("result"))
        .and_then(|r| r.get_mut("tools"))
        .and_then(Value::as_array_mut);
    for tool in tools.into_iter().flatten() {
        let Some(limits) = tool
            .get("name")
            .and_then(Value::as_str)
            .and_then(|n| figures.get(n))
        else {
            continue;
        };
        let Value::Object(tool) = tool else { continue };
        let meta = tool
            .entry("_meta")
            .or_insert_with(|| Value::Object(Default::default()));
        if !meta.is_object() {
            *meta = Value::Object(Default::default());
        }
        if let Value::Object(meta) = meta {
            meta.insert(
                PERMIT_META.into(),
                json!({"calls_left": limits.calls_left, "budget_left": limits.budget_left,
                       "expires_at": limits.expires_at}),
            );
        }
    }
    message
}

/// Where the last complete event of a stream ends: after it comes only what no client can
/// read yet (a line or event the stream did not finish).
fn end_of_events(stream: &[u8]) -> usize {
    let mut end = 0;
    let mut line_start = 0;
    let mut i = 0;
    while i < stream.len() {
        if stream[i] == b'\r' || stream[i] == b'\n' {
            let blank = i == line_start;
            if stream[i] == b'\r' && stream.get(i + 1) == Some(&b'\n') {
                i += 1;
            }
            line_start = i + 1;
            if blank {
                end = line_start;
            }
        }
        i += 1;
    }
    end
}

/// Whether `client` is the upstream's `body` with the figures of a `tools/list` answer to
/// `id` written in, and nothing else changed: a JSON body read whole, an event stream event
/// by event (the first event answering `id` edited, every other one as sent, and the
/// unfinished end of the stream byte for byte).
pub(super) fn edited_as_expected(
    body: &[u8],
    client: &[u8],
    sse: bool,
    id: &Value,
    figures: &BTreeMap<String, PermitLimits>,
) -> bool {
    if !sse {
        return match plain::read(body) {
            Some(sent) => plain::read(client) == Some(with_figures(sent, id, figures)),
            None => client == body,
        };
    }
    let sent = crate::sse::reference(body).0;
    let got = crate::sse::reference(client).0;
    let mut expected = sent.clone();
    let answer = sent.iter().position(|data| {
        plain::read(data.as_bytes()).is_some_and(|mut v| response_to(&mut v, id).is_some())
    });
    let events_match = match answer {
        Some(k) => {
            let edited = plain::read(sent[k].as_bytes()).map(|v| with_figures(v, id, figures));
            let got_k = got.get(k).and_then(|d| plain::read(d.as_bytes()));
            expected.remove(k);
            let mut rest = got.clone();
            if k < rest.len() {
                rest.remove(k);
            }
            edited.is_some() && got_k == edited && rest == expected
        }
        None => got == sent,
    };
    events_match && client.ends_with(&body[end_of_events(body)..])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures() -> BTreeMap<String, PermitLimits> {
        let limits = PermitLimits::until("2030-01-01T00:00:00.000Z").with_calls_left(Some(2));
        [("pay".to_string(), limits)].into_iter().collect()
    }

    #[test]
    fn a_listing_gains_figures_only_in_the_answer_to_its_id() {
        let sent = br#"[{"id":2,"result":{"tools":[{"name":"pay"}]}},{"id":1,"result":{"tools":[{"name":"pay","_meta":7},{"name":"echo"}]}}]"#;
        let v = plain::read(sent).unwrap_or_default();
        let edited = with_figures(v, &json!(1), &figures());
        assert_eq!(edited[0]["result"]["tools"][0].get("_meta"), None);
        assert_eq!(
            edited[1]["result"]["tools"][0]["_meta"]["dev.atmost/permit"]["calls_left"],
            2
        );
        assert_eq!(edited[1]["result"]["tools"][1].get("_meta"), None);
        assert_eq!(listed_names(sent, false, &json!(1)), ["pay", "echo"]);
    }

    #[test]
    fn an_event_stream_is_compared_event_by_event_and_its_unfinished_end_byte_for_byte() {
        let sent = b"data: {\"id\":1,\"result\":{\"tools\":[{\"name\":\"pay\"}]}}\n\ndata: x";
        let good = b"data: {\"id\":1,\"result\":{\"tools\":[{\"name\":\"pay\",\"_meta\":{\"dev.atmost/permit\":{\"calls_left\":2,\"budget_left\":null,\"expires_at\":\"2030-01-01T00:00:00.000Z\"}}}]}}\n\ndata: x";
        assert!(edited_as_expected(sent, good, true, &json!(1), &figures()));
        assert!(!edited_as_expected(
            sent,
            &good[..good.len() - 1],
            true,
            &json!(1),
            &figures()
        ));
        assert!(!edited_as_expected(sent, sent, true, &json!(1), &figures()));
        assert_eq!(end_of_events(b"a\r\n\r\nb\n\nc"), 8);
        assert_eq!(end_of_events(b"a\r\rb"), 3);
    }
}
