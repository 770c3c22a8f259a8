//! Finding the receipt of a dispatched call in the upstream's response: the JSON-RPC
//! response object whose `id` is the request's id (it has `result` or `error` and no
//! `method`, so a server-to-client request reusing the id is not taken for it).
//!
//! An `application/json` body is read whole (bounded by `max_receipt_bytes`); a
//! `text/event-stream` body is scanned event by event as it streams past. The receipt is
//! the response's JSON text verbatim when it stands alone (a whole JSON body or a whole
//! SSE event), else the matching element of a batch array re-serialised.

use crate::parse::sse::{Event, SseParser, TooLarge};
use serde::de::{self, Deserialize, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::Value;
use std::fmt;

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
/// parsed once. A lone message is read without building its tree ([`Message`]); a batch
/// is read as a tree, as its matching element is written out again from it.
pub fn from_json_text(text: &str, id: &Value) -> Option<Captured> {
    match serde_json::from_str::<Shape>(text).ok()? {
        Shape::Message(m) if m.is_response_to(id) => Some(Captured {
            text: text.trim().to_string(),
            kind: m.kind(),
        }),
        Shape::Message(_) | Shape::Other => None,
        Shape::Batch => from_tree(text, id),
    }
}

/// [`from_json_text`] by way of the whole tree.
fn from_tree(text: &str, id: &Value) -> Option<Captured> {
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

/// What [`from_json_text`] reads of a JSON text. The same parse as `serde_json::Value`'s
/// (every value is read with `deserialize_any`, so a text one refuses the other refuses),
/// and of a member named twice the last counts, as in a `Value`; but only the members the
/// receipt needs are kept, the rest read and dropped.
enum Shape {
    Message(Message),
    Batch,
    Other,
}

/// A lone message: what [`is_response_to`] and [`kind_of_value`] read of its tree.
#[derive(Default)]
struct Message {
    id: Option<Value>,
    method: bool,
    error: bool,
    result: Option<ResultMembers>,
}

/// The members of `result` that tell its kind; all false when `result` is not an object.
#[derive(Default)]
struct ResultMembers {
    /// `resultType` is the string `input_required` / `task`.
    input_required: bool,
    task_type: bool,
    /// `task` is an object whose `taskId` is a string.
    task_handle: bool,
    content: bool,
}

impl Message {
    fn is_response_to(&self, id: &Value) -> bool {
        self.id.as_ref() == Some(id) && !self.method && (self.result.is_some() || self.error)
    }

    fn kind(&self) -> ResultKind {
        match &self.result {
            Some(r) if r.input_required => ResultKind::InputRequired,
            Some(r) if r.task_type || (r.task_handle && !r.content) => ResultKind::Task,
            _ => ResultKind::Final,
        }
    }
}

/// Any JSON value, read and dropped.
#[derive(Default)]
struct Skip;

/// A JSON value read for one fact about it (`visit_*` of the others answers the default).
trait Probe: Sized + Default {
    fn string(_: &str) -> Self {
        Self::default()
    }
    fn object<'de, A: MapAccess<'de>>(map: A) -> Result<Self, A::Error> {
        drain_map(map).map(|()| Self::default())
    }
}

/// `true` for a string.
#[derive(Default)]
struct IsString(bool);

/// What a `resultType` member says.
#[derive(Default)]
struct ResultType {
    input_required: bool,
    task: bool,
}

/// `true` for an object whose `taskId` is a string.
#[derive(Default)]
struct TaskHandle(bool);

impl Probe for Skip {}

impl Probe for IsString {
    fn string(_: &str) -> IsString {
        IsString(true)
    }
}

impl Probe for ResultType {
    fn string(s: &str) -> ResultType {
        ResultType {
            input_required: s == "input_required",
            task: s == "task",
        }
    }
}

impl Probe for TaskHandle {
    fn object<'de, A: MapAccess<'de>>(mut map: A) -> Result<TaskHandle, A::Error> {
        let mut task_id = false;
        while let Some(name) = map.next_key_seed(MemberName(&["taskId"]))? {
            match name {
                Some(_) => {
                    let Probed(IsString(is_string)) = map.next_value()?;
                    task_id = is_string;
                }
                None => {
                    map.next_value::<Probed<Skip>>()?;
                }
            }
        }
        Ok(TaskHandle(task_id))
    }
}

impl Probe for ResultMembers {
    fn object<'de, A: MapAccess<'de>>(mut map: A) -> Result<ResultMembers, A::Error> {
        const NAMES: &[&str] = &["resultType", "task", "content"];
        let mut r = ResultMembers::default();
        while let Some(name) = map.next_key_seed(MemberName(NAMES))? {
            match name {
                Some(0) => {
                    let Probed(t) = map.next_value::<Probed<ResultType>>()?;
                    (r.input_required, r.task_type) = (t.input_required, t.task);
                }
                Some(1) => {
                    let Probed(TaskHandle(handle)) = map.next_value()?;
                    r.task_handle = handle;
                }
                Some(_) => {
                    map.next_value::<Probed<Skip>>()?;
                    r.content = true;
                }
                None => {
                    map.next_value::<Probed<Skip>>()?;
                }
            }
        }
        Ok(r)
    }
}

/// A [`Probe`] read from any JSON value.
struct Probed<P>(P);

impl<'de, P: Probe> Deserialize<'de> for Probed<P> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ProbeVisitor(std::marker::PhantomData))
            .map(Probed)
    }
}

struct ProbeVisitor<P>(std::marker::PhantomData<P>);

impl<'de, P: Probe> Visitor<'de> for ProbeVisitor<P> {
    type Value = P;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<P, E> {
        Ok(P::default())
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<P, E> {
        Ok(P::default())
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<P, E> {
        Ok(P::default())
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<P, E> {
        Ok(P::default())
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<P, E> {
        Ok(P::string(v))
    }

    fn visit_unit<E: de::Error>(self) -> Result<P, E> {
        Ok(P::default())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<P, A::Error> {
        while seq.next_element::<Probed<Skip>>()?.is_some() {}
        Ok(P::default())
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<P, A::Error> {
        P::object(map)
    }
}

/// Reads the rest of an object, dropping it.
fn drain_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
    while map.next_key_seed(MemberName(&[]))?.is_some() {
        map.next_value::<Probed<Skip>>()?;
    }
    Ok(())
}

/// A member name read as its position among the names asked for (`None`: another name),
/// without keeping it.
struct MemberName(&'static [&'static str]);

impl<'de> DeserializeSeed<'de> for MemberName {
    type Value = Option<usize>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<usize>, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for MemberName {
    type Value = Option<usize>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a member name")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Option<usize>, E> {
        Ok(self.0.iter().position(|n| *n == v))
    }
}

impl<'de> Deserialize<'de> for Shape {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Shape, D::Error> {
        d.deserialize_any(ShapeVisitor)
    }
}

struct ShapeVisitor;

impl<'de> Visitor<'de> for ShapeVisitor {
    type Value = Shape;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Shape, E> {
        Ok(Shape::Other)
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Shape, E> {
        Ok(Shape::Other)
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Shape, E> {
        Ok(Shape::Other)
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Shape, E> {
        Ok(Shape::Other)
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<Shape, E> {
        Ok(Shape::Other)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Shape, E> {
        Ok(Shape::Other)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Shape, A::Error> {
        while seq.next_element::<Probed<Skip>>()?.is_some() {}
        Ok(Shape::Batch)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Shape, A::Error> {
        const NAMES: &[&str] = &["id", "method", "result", "error"];
        let mut m = Message::default();
        while let Some(name) = map.next_key_seed(MemberName(NAMES))? {
            match name {
                Some(0) => m.id = Some(map.next_value::<Value>()?),
                Some(1) => {
                    map.next_value::<Probed<Skip>>()?;
                    m.method = true;
                }
                Some(2) => {
                    let Probed(result) = map.next_value()?;
                    m.result = Some(result);
                }
                Some(_) => {
                    map.next_value::<Probed<Skip>>()?;
                    m.error = true;
                }
                None => {
                    map.next_value::<Probed<Skip>>()?;
                }
            }
        }
        Ok(Shape::Message(m))
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
    /// How many bytes at the start of Envoy's body buffer were scanned already: Envoy keeps
    /// them for the filter ([`SseCapture::pass`] answered `hold`), and offers them again,
    /// followed by what came since, in its next body or trailers callback.
    held: usize,
    /// Holding gave up (what Envoy would keep grew past the event limit, or the host refused
    /// an edit): the stream goes on as it comes.
    unheld: bool,
}

/// What [`SseCapture::pass`] found in Envoy's body buffer, and whether Envoy is to keep it.
#[derive(Debug, Clone, PartialEq)]
pub struct Passed {
    pub progress: SseProgress,
    /// The buffer ends inside an event not seen whole yet: Envoy is to keep all of it
    /// (`Pause`) until more of the stream arrives, or the stream ends.
    pub hold: bool,
    /// With [`SseProgress::Found`], when the response's event stands whole in the buffer:
    /// the event, and the stream offset of the buffer's first byte.
    pub found: Option<(Event, u64)>,
}

impl SseCapture {
    pub fn new(id: Value, max_event_bytes: usize) -> SseCapture {
        SseCapture {
            parser: SseParser::new(max_event_bytes),
            id,
            held: 0,
            unheld: false,
        }
    }

    /// The stream's last event id so far (see [`SseParser::last_event_id`]).
    pub fn last_event_id(&self) -> Option<&str> {
        self.parser.last_event_id()
    }

    /// How many bytes Envoy keeps for this watch (see [`SseCapture::pass`]); 0 when the
    /// stream went on as it came.
    pub fn held(&self) -> usize {
        self.held
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

    /// Scans Envoy's body buffer of a stream whose response the filter edits, and says
    /// whether Envoy is to keep it: a buffer that ends inside an event is held (no client
    /// can use half an event), so that the response's event stands whole in one buffer when
    /// it is found. Envoy keeps the held bytes itself and offers them again, followed by the
    /// next chunk, in its next body callback, or alone in its trailers callback: what the
    /// filter holds is never the filter's to lose (a stream that ends with trailers has no
    /// body callback at its end). `buffer` starts with the bytes held last time, which are
    /// not scanned twice. Once the response is found, nothing more is held. Holding stops for
    /// good when Envoy would keep more than the event limit, and nothing is held at the end
    /// of the stream.
    pub fn pass(&mut self, buffer: &[u8], end_of_stream: bool) -> Passed {
        let seen = std::mem::take(&mut self.held).min(buffer.len());
        let base = self.parser.position() - seen as u64;
        let (progress, event) = self.scan(buffer.get(seen..).unwrap_or_default());
        let unfinished = matches!(progress, SseProgress::Pending)
            && self.parser.pending_start().is_some()
            && !end_of_stream
            && !self.unheld;
        if unfinished {
            if buffer.len() > self.parser.max_event_bytes() {
                self.unheld = true;
            } else {
                self.held = buffer.len();
            }
        }
        let found = event.filter(|e| e.start >= base).map(|e| (e, base));
        Passed {
            progress,
            hold: self.held > 0,
            found,
        }
    }

    /// The host refused an edit of the stream: nothing more is held. What Envoy keeps now
    /// goes on when the filter lets the stream continue.
    pub fn stop_holding(&mut self) {
        self.unheld = true;
    }
}

#[cfg(test)]
mod tests;
