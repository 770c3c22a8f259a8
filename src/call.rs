//! The per-request state machine. The adapter feeds it Envoy's callbacks as events; it
//! answers with a [`Step`]: what to return to Envoy ([`Flow`]), side effects in order
//! ([`Effect`]), and at most one ledger callout. It never touches Envoy itself, so every
//! transition is tested natively.
//!
//! ```text
//! Start ──non-POST / bodiless POST──────────────────────────────────▶ Passing
//!   │ POST
//!   ▼
//! ReadingBody ──too large / unreadable / batch with tools/call──────▶ Answered (local reply)
//!   │ ──not tools/call / ungoverned tool────────────────────────────▶ Passing
//!   │     (carrying a key: Forwarding, the key rewritten for upstream)
//!   │ ──no permit / bad key─────────────────────────────────────────▶ Answered (denial)
//!   ▼ governed tools/call: ONE authorize callout
//! Authorizing ──deny / replay / ledger unavailable──────────────────▶ Answered
//!   │ dispatch: rewrite the key, then resume the request upstream
//!   │ ──the host refused a rewrite (on_rewrite_failed): deny, report `released`──▶ Answered
//!   ▼
//! Dispatched(response watch) ──receipt found──▶ report `completed`, hold the chunk ──▶ Settled
//!   └─ on_log without an acknowledged report ──▶ queue completed / released / uncertain
//! ```

use crate::body_encoding;
use crate::denial;
use crate::fingerprint::fingerprint;
use crate::idempotency;
use crate::ledger::{Callout, Endpoint, LedgerReply};
use crate::mcp::{self, Message, MetaKey, Mirrored};
use crate::meta_key;
use crate::outcome::{self, NoReceipt};
use crate::permit;
use crate::receipt::{self, ResultKind, SseCapture, SseProgress};
use crate::replay;
use crate::reply::{rpc_code, LocalReply};
use crate::resume::{self, Ticket};
use crate::stats::Stat;
use crate::upstream_key;
use crate::upstream_key::UNGOVERNED_PERMIT_ID;
use atmost_config::{CompletionReports, Config, UpstreamKey};
use atmost_protocol::{
    AuthorizeRequest, AuthorizeResponse, Denial, DenialCode, DispatchGrant, Outcome, OutcomeAck,
    OutcomeReport, OutcomesRequest,
};
use serde_json::Value;
use std::rc::Rc;

/// Name of the idempotency header, as Envoy stores it.
pub const IDEMPOTENCY_HEADER: &str = "idempotency-key";

/// What the request headers told us.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestHead {
    /// `:method`.
    pub method: String,
    /// Every value of the permit header.
    pub permit: Vec<Vec<u8>>,
    /// Every value of `Idempotency-Key`.
    pub idempotency_key: Vec<Vec<u8>>,
    /// `Mcp-Method`, `Mcp-Name`.
    pub mirrored: Mirrored,
    /// `content-length`, when announced.
    pub content_length: Option<u64>,
    /// Every value of `Content-Type`.
    pub content_type: Vec<Vec<u8>>,
    /// Every value of `Content-Encoding`.
    pub content_encoding: Vec<Vec<u8>>,
    pub end_of_stream: bool,
    /// `Mcp-Session-Id`.
    pub session_id: Option<String>,
    /// `:path`.
    pub path: String,
    /// For a GET carrying `Last-Event-ID`: the ticket a POST stream closed early left under
    /// `resume::key(session, last event id)`, as the adapter took it from shared data (only
    /// after [`Ticket::admits`] this GET, and removing it there, so it is used once).
    pub resume: Option<Ticket>,
}

/// What the response headers told us.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ResponseHead {
    pub content_type: Option<String>,
    pub end_of_stream: bool,
}

/// Envoy properties read in `on_log`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LogProps {
    /// `upstream.request_attempt_count`.
    pub attempts: Option<u64>,
    /// `response.flags`.
    pub flags: Option<u64>,
}

/// What to return to Envoy from the current callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Pause,
}

/// Log levels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Debug,
    Info,
    Warn,
    Error,
}

/// One side effect, carried out by the adapter in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    RemoveRequestHeader(String),
    SetRequestHeader(String, String),
    /// Replace the buffered request body (`original_len` bytes) with `body`.
    ///
    /// The three request edits (`RemoveRequestHeader`, `SetRequestHeader`,
    /// `ReplaceRequestBody`) must all take effect before the request may go on: when the
    /// host refuses one, the adapter carries out nothing more of the step (no
    /// `ResumeRequest`, no `Continue`) and calls [`Call::on_rewrite_failed`] instead.
    ReplaceRequestBody {
        original_len: usize,
        body: Vec<u8>,
    },
    /// `send_http_response`; the request ends here.
    LocalReply(LocalReply),
    /// `resume_http_request` (only from a callout callback).
    ResumeRequest,
    /// `resume_http_response` (only from a callout callback).
    ResumeResponse,
    /// Hand a report to the root context's queue.
    Enqueue(OutcomeReport),
    /// `completion_reports: batched`: hand this `completed` (or `input_required` /
    /// `accepted`) report to the root's batch; the response stays held (the step's flow is
    /// `Pause`) until the root resumes it. Tell the machine with
    /// [`Call::on_completion_settled`] once the batch is done.
    Complete(OutcomeReport),
    /// Store a resume ticket in shared data under this key (see [`crate::resume`]).
    SaveResume(String, Ticket),
    Count(Stat),
    Log(Level, String),
}

/// The machine's answer to one event.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub flow: Flow,
    pub effects: Vec<Effect>,
    /// Dispatched after the effects; if dispatching fails the adapter calls
    /// [`Call::on_callout_failed`] and returns that step's flow instead.
    pub callout: Option<Callout>,
}

impl Step {
    fn new(flow: Flow) -> Step {
        Step {
            flow,
            effects: Vec::new(),
            callout: None,
        }
    }
    fn cont() -> Step {
        Step::new(Flow::Continue)
    }
    fn pause() -> Step {
        Step::new(Flow::Pause)
    }
    fn with(mut self, e: Effect) -> Step {
        self.effects.push(e);
        self
    }
    fn with_opt(mut self, e: Option<Effect>) -> Step {
        self.effects.extend(e);
        self
    }
}

/// A body callback's answer: either done, or "read `len` bytes of the buffered body and
/// call the matching `*_data` method with them".
#[derive(Debug, Clone, PartialEq)]
pub enum BodyStep {
    Done(Step),
    Read { len: usize },
}

#[derive(Debug, Clone, PartialEq)]
struct Pending {
    id: Value,
    tool: String,
    permit_hash: String,
    path: String,
    key: Option<String>,
    session_id: Option<String>,
    /// The raw body and where its body idempotency keys sit, kept only when they must be
    /// rewritten before upstream (`upstream_key.mode` other than `raw`).
    meta_key_edit: Option<MetaKeyEdit>,
}

#[derive(Debug, Clone, PartialEq)]
struct MetaKeyEdit {
    body: Vec<u8>,
    spans: Vec<meta_key::MemberSpan>,
    /// The request announced a `content-length`, which must follow the new size.
    had_content_length: bool,
}

#[derive(Debug, Clone)]
enum Watch {
    /// Upstream has not answered yet.
    AwaitingHeaders,
    /// `application/json`: buffering the body (Pause until end of stream).
    BufferingJson { size: usize },
    /// `text/event-stream`: chunks pass, a copy is scanned.
    StreamingSse(Box<SseCapture>),
    /// Done watching, without a receipt.
    NoReceipt(NoReceipt),
    /// A `completed` (or `input_required` / `accepted`) report is out; the response is held
    /// until it is answered.
    Reporting { outcome: Outcome },
    /// The completion was acknowledged or handed to the root queue: nothing left to do.
    Settled,
}

#[derive(Debug, Clone)]
struct Dispatched {
    /// The attempt, the round this request dispatched (or resumed) and its capability.
    grant: DispatchGrant,
    /// SHA-256 of the permit token the call came with, so only a GET under the same permit
    /// can resume its stream.
    permit_hash: String,
    /// `:path` of the request, which a resuming GET must repeat.
    path: String,
    id: Value,
    tool: String,
    watch: Watch,
    session_id: Option<String>,
    /// A GET resuming the stream of a call dispatched by an earlier POST: it can bring the
    /// receipt, but its own failure says nothing about the call.
    resumed: bool,
}

#[derive(Debug, Clone)]
enum State {
    Start,
    /// Not governed: passes untouched (permit header already removed).
    Passing,
    /// Not governed, passing with its idempotency key rewritten for upstream. Holds the
    /// JSON-RPC id (`null` if none) and, for a `tools/call`, the tool: what a refusal
    /// answers if the host refuses the rewrite.
    Forwarding(Value, Option<String>),
    ReadingBody(Box<RequestHead>),
    Authorizing(Pending),
    Dispatched(Box<Dispatched>),
    /// A local reply was sent.
    Answered,
}

/// One request's state machine.
#[derive(Debug, Clone)]
pub struct Call {
    config: Rc<Config>,
    state: State,
}

fn deny_step(config: &Config, denial: &Denial, id: &Value, tool: &str) -> Step {
    let mut step = Step::pause()
        .with(Effect::LocalReply(denial::render(
            denial,
            id,
            config.denial_format,
        )))
        .with(Effect::Count(Stat::Denied))
        .with(Effect::Count(Stat::DeniedCode(denial.code)));
    if denial.code == DenialCode::GatewayUnavailable {
        step = step.with(Effect::Count(Stat::GatewayUnavailable));
    }
    step.with(Effect::Log(
        Level::Info,
        format!("atmost: denied tools/call of `{tool}`: {}", denial.code),
    ))
}

fn bad_request(reply: LocalReply) -> Step {
    Step::pause()
        .with(Effect::LocalReply(reply))
        .with(Effect::Count(Stat::BadRequest))
}

fn too_large(max: u64) -> Step {
    bad_request(LocalReply::rpc_error(
        413,
        None,
        rpc_code::INVALID_REQUEST,
        &format!("request body exceeds max_body_bytes ({max})"),
    ))
}

fn gateway_unavailable() -> Denial {
    Denial::new(
        DenialCode::GatewayUnavailable,
        "the atmost ledger could not be asked; the call was not sent",
    )
}

/// The denial when the host refused to rewrite the request: nothing went upstream.
fn rewrite_refused() -> Denial {
    Denial::new(
        DenialCode::GatewayUnavailable,
        "atmost could not rewrite the request for its upstream (idempotency key or permit header); it was not sent",
    )
}

/// The effects replacing the body's idempotency key members: `value` gets each member's raw
/// JSON value and returns its upstream form, or `None` to remove it.
fn body_edit(
    original: &[u8],
    spans: &[meta_key::MemberSpan],
    had_content_length: bool,
    value: impl FnMut(&[u8]) -> Option<String>,
) -> Vec<Effect> {
    let body = meta_key::rewrite_all(original, spans, value);
    let mut effects = Vec::with_capacity(2);
    let length = had_content_length
        .then(|| Effect::SetRequestHeader("content-length".into(), body.len().to_string()));
    effects.push(Effect::ReplaceRequestBody {
        original_len: original.len(),
        body,
    });
    effects.extend(length);
    effects
}

fn content_kind(content_type: Option<&str>) -> Option<bool> {
    let media = content_type?
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    match media.as_str() {
        "application/json" => Some(true),
        "text/event-stream" => Some(false),
        _ => None,
    }
}

fn usize_of(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

impl Call {
    pub fn new(config: Rc<Config>) -> Call {
        Call {
            config,
            state: State::Start,
        }
    }

    /// Short state name (tests, debug logs).
    pub fn state_name(&self) -> &'static str {
        match &self.state {
            State::Start => "start",
            State::Passing | State::Forwarding(..) => "passing",
            State::ReadingBody(_) => "reading_body",
            State::Authorizing(_) => "authorizing",
            State::Answered => "answered",
            State::Dispatched(d) => match d.watch {
                Watch::AwaitingHeaders => "dispatched",
                Watch::BufferingJson { .. } => "buffering_json",
                Watch::StreamingSse(_) => "streaming_sse",
                Watch::NoReceipt(_) => "no_receipt",
                Watch::Reporting { .. } => "reporting",
                Watch::Settled => "settled",
            },
        }
    }

    pub fn on_request_headers(&mut self, head: RequestHead) -> Step {
        if !matches!(self.state, State::Start) {
            return Step::cont();
        }
        // The permit never goes upstream; when the request has none there is nothing to
        // remove (the adapter matched every header name case-insensitively).
        let strip = (!head.permit.is_empty())
            .then(|| Effect::RemoveRequestHeader(self.config.permit_header.clone()));
        if head.method.eq_ignore_ascii_case("GET") {
            if let Some(t) = head.resume {
                let key = self.passing_key_header(&head.idempotency_key);
                let step = Step::cont().with_opt(strip).with_opt(key).with(Effect::Log(
                    Level::Info,
                    format!(
                        "atmost: GET resumes the stream of attempt {} (round {}) of `{}`; watching it for the answer",
                        t.grant.attempt_id, t.grant.round, t.tool
                    ),
                ));
                self.state = State::Dispatched(Box::new(Dispatched {
                    grant: t.grant,
                    permit_hash: t.permit_hash,
                    path: t.path,
                    id: t.id,
                    tool: t.tool,
                    watch: Watch::AwaitingHeaders,
                    session_id: head.session_id,
                    resumed: true,
                }));
                return step;
            }
        }
        if !head.method.eq_ignore_ascii_case("POST") || head.end_of_stream {
            return match self.passing_key_header(&head.idempotency_key) {
                Some(key) => {
                    self.state = State::Forwarding(Value::Null, None);
                    Step::cont().with_opt(strip).with(key)
                }
                None => {
                    self.state = State::Passing;
                    Step::cont().with_opt(strip)
                }
            };
        }
        if let Err(refusal) = body_encoding::check(&head.content_type, &head.content_encoding) {
            self.state = State::Answered;
            return bad_request(LocalReply::rpc_error(
                400,
                None,
                rpc_code::INVALID_REQUEST,
                refusal.message(),
            ));
        }
        if head
            .content_length
            .is_some_and(|n| n > self.config.max_body_bytes)
        {
            self.state = State::Answered;
            return too_large(self.config.max_body_bytes);
        }
        self.state = State::ReadingBody(Box::new(head));
        Step::pause().with_opt(strip)
    }

    /// What traffic that passes without a ledger answer does with an `Idempotency-Key`
    /// header: nothing in `raw` mode; otherwise its upstream form, or removed when it is
    /// not one key atmost would accept (it is never forwarded raw).
    fn passing_key_header(&self, values: &[Vec<u8>]) -> Option<Effect> {
        if values.is_empty() || self.config.upstream_key == UpstreamKey::Raw {
            return None;
        }
        let key = match values {
            [one] => idempotency::parse_header_value(one).ok(),
            _ => None,
        };
        Some(
            match upstream_key::upstream_value(
                &self.config.upstream_key,
                UNGOVERNED_PERMIT_ID,
                key.as_deref(),
            ) {
                Some(v) => Effect::SetRequestHeader(IDEMPOTENCY_HEADER.into(), v),
                None => Effect::RemoveRequestHeader(IDEMPOTENCY_HEADER.into()),
            },
        )
    }

    /// Lets a parsed message pass that needs no ledger answer (not a `tools/call`, or an
    /// ungoverned one), with every idempotency key it carries in its upstream form. `body`
    /// is given only when the parse found a key field in it, so other traffic is not
    /// scanned again.
    fn pass(
        &mut self,
        head: &RequestHead,
        body: Option<&[u8]>,
        id: Value,
        tool: Option<String>,
    ) -> Step {
        let mode = &self.config.upstream_key;
        let mut step = Step::cont();
        if let Some(body) = body.filter(|_| *mode != UpstreamKey::Raw) {
            let spans = meta_key::find_all(body);
            if !spans.is_empty() {
                let length = head.content_length.is_some();
                step.effects.extend(body_edit(body, &spans, length, |raw| {
                    let key = idempotency::valid_body_key(raw);
                    upstream_key::upstream_value(mode, UNGOVERNED_PERMIT_ID, key.as_deref())
                }));
            }
        }
        step = step.with_opt(self.passing_key_header(&head.idempotency_key));
        self.state = if step.effects.is_empty() {
            State::Passing
        } else {
            State::Forwarding(id, tool)
        };
        step
    }

    /// The host refused one of the request edits of the last step (a header or the body):
    /// the request must not go on, since it would carry the raw key, or a body that no
    /// longer matches its `content-length`. A dispatched call never left, so the ledger is
    /// told to release its attempt.
    pub fn on_rewrite_failed(&mut self) -> Step {
        let cfg = Rc::clone(&self.config);
        let refused = rewrite_refused();
        let log = |what: String| {
            Effect::Log(
                Level::Error,
                format!("atmost: could not rewrite the request {what}; refused, not sent"),
            )
        };
        match std::mem::replace(&mut self.state, State::Answered) {
            State::Answered => Step::pause(),
            State::Dispatched(d) if !d.resumed && matches!(d.watch, Watch::AwaitingHeaders) => {
                deny_step(&cfg, &refused, &d.id, &d.tool)
                    .with(Effect::Enqueue(d.grant.report(Outcome::Released {
                        reason: "never_sent: request_rewrite_failed".into(),
                    })))
                    .with(Effect::Count(Stat::Released))
                    .with(log(format!(
                        "of attempt {} (round {}) of `{}`; reported never sent",
                        d.grant.attempt_id, d.grant.round, d.tool
                    )))
            }
            State::Dispatched(d) => deny_step(&cfg, &refused, &d.id, &d.tool).with(log(format!(
                "resuming the stream of attempt {} of `{}`",
                d.grant.attempt_id, d.tool
            ))),
            State::Forwarding(id, Some(tool)) => {
                deny_step(&cfg, &refused, &id, &tool).with(log(format!("for `{tool}`")))
            }
            State::Authorizing(p) => {
                deny_step(&cfg, &refused, &p.id, &p.tool).with(log(format!("for `{}`", p.tool)))
            }
            State::Forwarding(id, None) => bad_request(LocalReply::rpc_error(
                503,
                Some(&id),
                rpc_code::INTERNAL_ERROR,
                &refused.message,
            ))
            .with(log(String::new())),
            State::Start | State::Passing | State::ReadingBody(_) => bad_request(
                LocalReply::rpc_error(503, None, rpc_code::INTERNAL_ERROR, &refused.message),
            )
            .with(log(String::new())),
        }
    }

    pub fn on_request_body(&mut self, size: usize, end_of_stream: bool) -> BodyStep {
        match &self.state {
            State::ReadingBody(_) => {
                if size as u64 > self.config.max_body_bytes {
                    self.state = State::Answered;
                    BodyStep::Done(too_large(self.config.max_body_bytes))
                } else if end_of_stream {
                    BodyStep::Read { len: size }
                } else {
                    BodyStep::Done(Step::pause())
                }
            }
            State::Authorizing(_) | State::Answered => BodyStep::Done(Step::pause()),
            _ => BodyStep::Done(Step::cont()),
        }
    }

    pub fn on_request_trailers(&mut self) -> Step {
        match &self.state {
            State::ReadingBody(_) => {
                self.state = State::Answered;
                bad_request(LocalReply::rpc_error(
                    400,
                    None,
                    rpc_code::INVALID_REQUEST,
                    "request trailers are not accepted by atmost",
                ))
            }
            State::Authorizing(_) | State::Answered => Step::pause(),
            _ => Step::cont(),
        }
    }

    /// The whole request body, after [`BodyStep::Read`].
    pub fn on_request_body_data(&mut self, body_bytes: &[u8]) -> Step {
        let body = body_bytes;
        let State::ReadingBody(head) = std::mem::replace(&mut self.state, State::Answered) else {
            // Not expected; put nothing at risk.
            return Step::pause();
        };
        let call = match mcp::parse(body, &head.mirrored) {
            Err(reply) => return bad_request(*reply),
            Ok(Message::Other) => return self.pass(&head, None, Value::Null, None),
            Ok(Message::KeyedOther(id)) => return self.pass(&head, Some(body), id, None),
            Ok(Message::ToolCall(call)) => call,
        };
        if !self.config.governed_tools.contains(&call.name) {
            let keyed = !matches!(
                (&call.meta_key, &call.params_key),
                (MetaKey::Absent, MetaKey::Absent)
            );
            return self.pass(&head, keyed.then_some(body), call.id, Some(call.name));
        }
        let permit = permit::token(&head.permit, &self.config.permit_header);
        let permit_token = match permit {
            Ok(t) => t,
            Err(e) => {
                let d = Denial::new(DenialCode::PermitInvalid, e.to_string());
                return deny_step(&self.config, &d, &call.id, &call.name);
            }
        };
        let permit_hash = resume::permit_hash(permit_token.as_bytes());
        let key =
            match idempotency::resolve(&head.idempotency_key, &call.meta_key, &call.params_key) {
                Ok(k) => k,
                Err(d) => return deny_step(&self.config, &d, &call.id, &call.name),
            };
        let fp = match fingerprint(&call.name, &call.arguments) {
            Ok(fp) => fp,
            Err(_) => {
                return bad_request(LocalReply::rpc_error(
                    400,
                    Some(&call.id),
                    rpc_code::INVALID_PARAMS,
                    "Invalid params: arguments cannot be canonicalised (RFC 8785)",
                ))
            }
        };
        let request = AuthorizeRequest {
            permit_token,
            tool: call.name.clone(),
            idempotency_key: key.clone(),
            fingerprint: fp,
            key_required: self.config.key_required_tools.contains(&call.name),
            continuation: call.continuation,
            arguments: Value::Object(call.arguments),
        };
        let body = match serde_json::to_vec(&request) {
            Ok(b) => b,
            Err(_) => return deny_step(&self.config, &gateway_unavailable(), &call.id, &call.name),
        };
        let in_body = matches!(call.meta_key, MetaKey::Present(_))
            || matches!(call.params_key, MetaKey::Present(_));
        let meta_key_edit = match &self.config.upstream_key {
            UpstreamKey::Raw => None,
            _ if !in_body => None,
            _ => Some(meta_key::find_all(body_bytes))
                .filter(|spans| !spans.is_empty())
                .map(|spans| MetaKeyEdit {
                    body: body_bytes.to_vec(),
                    spans,
                    had_content_length: head.content_length.is_some(),
                }),
        };
        self.state = State::Authorizing(Pending {
            permit_hash,
            path: head.path.clone(),
            id: call.id,
            tool: call.name,
            key,
            session_id: head.session_id.clone(),
            meta_key_edit,
        });
        Step {
            flow: Flow::Pause,
            effects: Vec::new(),
            callout: Some(Callout {
                endpoint: Endpoint::Authorize,
                body,
            }),
        }
    }

    /// The callout of the last step could not even be dispatched.
    pub fn on_callout_failed(&mut self) -> Step {
        match &mut self.state {
            State::Authorizing(p) => {
                let (id, tool) = (p.id.clone(), p.tool.clone());
                self.state = State::Answered;
                deny_step(&self.config, &gateway_unavailable(), &id, &tool).with(Effect::Log(
                    Level::Warn,
                    "atmost: could not dispatch the authorize callout; call denied (gateway_unavailable)".into(),
                ))
            }
            State::Dispatched(d) => match std::mem::replace(&mut d.watch, Watch::Settled) {
                Watch::Reporting { outcome } => Step::cont()
                    .with(Effect::Enqueue(d.grant.report(outcome)))
                    .with(Effect::Count(Stat::ReportDeferred))
                    .with(Effect::Log(
                        Level::Warn,
                        format!(
                            "atmost: could not dispatch the completed report of attempt {}; queued",
                            d.grant.attempt_id
                        ),
                    )),
                other => {
                    d.watch = other;
                    Step::cont()
                }
            },
            _ => Step::cont(),
        }
    }

    /// The ledger answered (or failed to answer) the pending callout.
    pub fn on_ledger_reply(&mut self, reply: &LedgerReply) -> Step {
        match std::mem::replace(&mut self.state, State::Answered) {
            State::Authorizing(p) => self.on_authorize_reply(p, reply),
            State::Dispatched(mut d) => {
                let step = match std::mem::replace(&mut d.watch, Watch::Settled) {
                    Watch::Reporting { outcome } => {
                        let mut step = Step::cont();
                        match reply.outcomes(1) {
                            Ok(acks) => match acks.first() {
                                Some(OutcomeAck::Applied) | Some(OutcomeAck::AlreadyRecorded) => {}
                                Some(a) => {
                                    step = step.with(Effect::Log(
                                        Level::Warn,
                                        format!(
                                            "atmost: ledger did not apply the completed report of attempt {}: {a:?}",
                                            d.grant.attempt_id
                                        ),
                                    ));
                                }
                                None => {}
                            },
                            Err(e) => {
                                step = step
                                    .with(Effect::Enqueue(d.grant.report(outcome)))
                                    .with(Effect::Count(Stat::ReportDeferred))
                                    .with(Effect::Log(
                                        Level::Warn,
                                        format!(
                                            "atmost: completed report of attempt {} failed ({e}); queued",
                                            d.grant.attempt_id
                                        ),
                                    ));
                            }
                        }
                        step.with(Effect::ResumeResponse)
                    }
                    other => {
                        d.watch = other;
                        Step::cont()
                    }
                };
                self.state = State::Dispatched(d);
                step
            }
            other => {
                self.state = other;
                Step::cont()
            }
        }
    }

    fn on_authorize_reply(&mut self, p: Pending, reply: &LedgerReply) -> Step {
        let cfg = Rc::clone(&self.config);
        match reply.authorize() {
            Err(reason) => deny_step(&cfg, &gateway_unavailable(), &p.id, &p.tool).with(
                Effect::Log(Level::Warn, format!("atmost: authorize failed: {reason}")),
            ),
            Ok(AuthorizeResponse::Deny(d)) => deny_step(&cfg, &d, &p.id, &p.tool),
            Ok(AuthorizeResponse::Replay {
                attempt_id,
                receipt,
            }) => match replay::render(&receipt, &p.id) {
                Ok(reply) => Step::pause()
                    .with(Effect::LocalReply(reply))
                    .with(Effect::Count(Stat::Replayed))
                    .with(Effect::Log(
                        Level::Info,
                        format!("atmost: replayed attempt {attempt_id} for `{}`", p.tool),
                    )),
                Err(_) => {
                    deny_step(&cfg, &gateway_unavailable(), &p.id, &p.tool).with(Effect::Log(
                        Level::Error,
                        format!(
                        "atmost: stored receipt of attempt {attempt_id} is not a JSON-RPC response"
                    ),
                    ))
                }
            },
            Ok(AuthorizeResponse::Dispatch {
                attempt_id,
                permit_id,
                round,
                capability,
                ..
            }) => {
                let upstream_value =
                    upstream_key::upstream_value(&cfg.upstream_key, &permit_id, p.key.as_deref());
                let key_effect = match &upstream_value {
                    Some(v) => Effect::SetRequestHeader(IDEMPOTENCY_HEADER.into(), v.clone()),
                    None => Effect::RemoveRequestHeader(IDEMPOTENCY_HEADER.into()),
                };
                // The body copies of the key get the same treatment as the header. Every edit
                // comes before the resume, which the adapter skips if one is refused.
                let mut step = Step::cont();
                if let Some(edit) = p.meta_key_edit {
                    step.effects.extend(body_edit(
                        &edit.body,
                        &edit.spans,
                        edit.had_content_length,
                        |_| upstream_value.clone(),
                    ));
                }
                let step = step
                    .with(key_effect)
                    .with(Effect::Count(Stat::Dispatched))
                    .with(Effect::Log(
                        Level::Info,
                        format!(
                            "atmost: dispatching attempt {attempt_id} (round {round}) of `{}`",
                            p.tool
                        ),
                    ))
                    .with(Effect::ResumeRequest);
                self.state = State::Dispatched(Box::new(Dispatched {
                    grant: DispatchGrant {
                        attempt_id,
                        round,
                        capability,
                    },
                    permit_hash: p.permit_hash,
                    path: p.path,
                    id: p.id,
                    tool: p.tool,
                    watch: Watch::AwaitingHeaders,
                    session_id: p.session_id,
                    resumed: false,
                }));
                step
            }
        }
    }

    pub fn on_response_headers(&mut self, head: ResponseHead) -> Step {
        let max = usize_of(self.config.max_receipt_bytes);
        if let State::Dispatched(d) = &mut self.state {
            if matches!(d.watch, Watch::AwaitingHeaders) {
                d.watch = if head.end_of_stream {
                    Watch::NoReceipt(NoReceipt::NotJsonRpc)
                } else {
                    match content_kind(head.content_type.as_deref()) {
                        Some(true) => Watch::BufferingJson { size: 0 },
                        Some(false) => {
                            Watch::StreamingSse(Box::new(SseCapture::new(d.id.clone(), max)))
                        }
                        None => Watch::NoReceipt(NoReceipt::NotJsonRpc),
                    }
                };
            }
        }
        Step::cont()
    }

    pub fn on_response_body(&mut self, size: usize, end_of_stream: bool) -> BodyStep {
        let max = self.config.max_receipt_bytes;
        let State::Dispatched(d) = &mut self.state else {
            return BodyStep::Done(Step::cont());
        };
        match &mut d.watch {
            Watch::BufferingJson { size: seen } => {
                if size as u64 > max {
                    d.watch = Watch::NoReceipt(NoReceipt::TooLarge);
                    BodyStep::Done(receipt_too_large(&d.grant.attempt_id))
                } else if end_of_stream {
                    BodyStep::Read { len: size }
                } else {
                    *seen = size;
                    BodyStep::Done(Step::pause())
                }
            }
            Watch::StreamingSse(_) => BodyStep::Read { len: size },
            Watch::Reporting { .. } => BodyStep::Done(Step::pause()),
            _ => BodyStep::Done(Step::cont()),
        }
    }

    pub fn on_response_trailers(&mut self) -> BodyStep {
        match &self.state {
            State::Dispatched(d) => match &d.watch {
                Watch::BufferingJson { size } => BodyStep::Read { len: *size },
                Watch::Reporting { .. } => BodyStep::Done(Step::pause()),
                _ => BodyStep::Done(Step::cont()),
            },
            _ => BodyStep::Done(Step::cont()),
        }
    }

    /// Response bytes after [`BodyStep::Read`]: the whole buffered JSON body, or one SSE chunk.
    pub fn on_response_body_data(&mut self, bytes: &[u8], end_of_stream: bool) -> Step {
        let State::Dispatched(d) = &mut self.state else {
            return Step::cont();
        };
        let found = match &mut d.watch {
            Watch::BufferingJson { .. } => match receipt::from_json_body(bytes, &d.id) {
                Some(r) => r,
                None => {
                    d.watch = Watch::NoReceipt(NoReceipt::NoMatchingResponse);
                    return Step::cont();
                }
            },
            Watch::StreamingSse(cap) => match cap.feed(bytes) {
                SseProgress::Found(r) => r,
                SseProgress::TooLarge => {
                    d.watch = Watch::NoReceipt(NoReceipt::TooLarge);
                    return receipt_too_large(&d.grant.attempt_id);
                }
                SseProgress::Pending => {
                    if !end_of_stream {
                        return Step::cont();
                    }
                    // Ended without the answer. With event ids the client may resume the
                    // stream (GET + Last-Event-ID) and get the answer there.
                    let Some(last) = cap.last_event_id().map(str::to_string) else {
                        d.watch = Watch::NoReceipt(NoReceipt::NoMatchingResponse);
                        return Step::cont();
                    };
                    d.watch = Watch::NoReceipt(NoReceipt::StreamClosedResumable);
                    let key = resume::key(d.session_id.as_deref(), &last);
                    return Step::cont().with(Effect::SaveResume(
                        key,
                        Ticket {
                            grant: d.grant.clone(),
                            id: d.id.clone(),
                            tool: d.tool.clone(),
                            permit_hash: d.permit_hash.clone(),
                            path: d.path.clone(),
                        },
                    ));
                }
            },
            _ => return Step::cont(),
        };
        let resumed_stat = d.resumed.then_some(Effect::Count(Stat::ResumedReceipt));
        let receipt = found.text;
        let (outcome, stat) = match found.kind {
            ResultKind::Final => (Outcome::Completed { receipt }, Stat::Completed),
            ResultKind::InputRequired => (Outcome::InputRequired { receipt }, Stat::InputRequired),
            ResultKind::Task => (Outcome::Accepted { receipt }, Stat::Accepted),
        };
        let report = d.grant.report(outcome.clone());
        d.watch = Watch::Reporting { outcome };
        let mut effects = vec![Effect::Count(stat)];
        effects.extend(resumed_stat);
        match self.config.completion_reports {
            CompletionReports::Batched => {
                effects.push(Effect::Complete(report));
                Step {
                    flow: Flow::Pause,
                    effects,
                    callout: None,
                }
            }
            CompletionReports::PerCall => Step {
                flow: Flow::Pause,
                effects,
                callout: Some(Callout::outcomes(&OutcomesRequest {
                    reports: vec![report],
                })),
            },
        }
    }

    /// Whether a completion report is out and the response held (the adapter then checks
    /// the root's batch in later callbacks).
    pub fn is_reporting(&self) -> bool {
        matches!(&self.state, State::Dispatched(d) if matches!(d.watch, Watch::Reporting { .. }))
    }

    /// `completion_reports: batched`: the root finished the batch carrying this call's
    /// report (acknowledged, or failed and queued for retry by the root) and resumed the
    /// response. Nothing is left to report.
    pub fn on_completion_settled(&mut self) {
        if let State::Dispatched(d) = &mut self.state {
            if matches!(d.watch, Watch::Reporting { .. }) {
                d.watch = Watch::Settled;
            }
        }
    }

    /// Whether `on_log` needs Envoy's attempt count and response flags: only for a
    /// dispatched call whose outcome is not settled yet.
    pub fn needs_log_props(&self) -> bool {
        matches!(&self.state, State::Dispatched(d) if !matches!(d.watch, Watch::Settled | Watch::Reporting { .. }))
    }

    /// Whether the response headers matter (a dispatched call waiting for them): only then
    /// does the adapter look up `content-type`.
    pub fn watches_response_headers(&self) -> bool {
        matches!(&self.state, State::Dispatched(d) if matches!(d.watch, Watch::AwaitingHeaders))
    }

    /// The request is over (`on_log`).
    pub fn on_log(&mut self, props: LogProps) -> Step {
        match std::mem::replace(&mut self.state, State::Answered) {
            State::Authorizing(p) => Step::cont().with(Effect::Log(
                Level::Warn,
                format!(
                    "atmost: request ended before the ledger answered for `{}`; a reserved attempt turns uncertain when its lease runs out",
                    p.tool
                ),
            )),
            State::Dispatched(d) => {
                let (reported, why) = match d.watch {
                    Watch::Settled => return Step::cont(),
                    Watch::Reporting { outcome } => (Some(outcome), NoReceipt::NoResponse),
                    Watch::NoReceipt(r) => (None, r),
                    Watch::AwaitingHeaders | Watch::BufferingJson { .. } | Watch::StreamingSse(_) => {
                        (None, NoReceipt::NoResponse)
                    }
                };
                let outcome = match reported {
                    Some(o) => o,
                    None if d.resumed => {
                        // The call went out with an earlier POST; this stream failing or
                        // ending says nothing new about it. The lease decides.
                        return Step::cont().with(Effect::Log(
                            Level::Info,
                            format!(
                                "atmost: resumed stream of attempt {} ended without its answer; it stays in flight",
                                d.grant.attempt_id
                            ),
                        ));
                    }
                    None if why == NoReceipt::StreamClosedResumable
                        && outcome::closed_cleanly(props.attempts, props.flags) =>
                    {
                        return Step::cont()
                            .with(Effect::Count(Stat::StreamAwaitingResume))
                            .with(Effect::Log(
                                Level::Info,
                                format!(
                                    "atmost: the server closed the resumable stream of attempt {} of `{}` before its answer; it stays in flight for the resumed GET stream (or the lease)",
                                    d.grant.attempt_id, d.tool
                                ),
                            ));
                    }
                    None => outcome::classify(None, why, props.attempts, props.flags),
                };
                let (stat, text) = match &outcome {
                    Outcome::Completed { .. } => (Stat::Completed, "completed".to_string()),
                    Outcome::InputRequired { .. } => (Stat::InputRequired, "awaiting input".to_string()),
                    Outcome::Accepted { .. } => (Stat::Accepted, "accepted (task)".to_string()),
                    Outcome::Released { reason } => (Stat::Released, format!("released ({reason})")),
                    Outcome::Uncertain { reason } => (Stat::Uncertain, format!("uncertain ({reason})")),
                };
                Step::cont()
                    .with(Effect::Enqueue(d.grant.report(outcome)))
                    .with(Effect::Count(stat))
                    .with(Effect::Log(
                        Level::Info,
                        format!("atmost: attempt {} of `{}` is {text}", d.grant.attempt_id, d.tool),
                    ))
            }
            _ => Step::cont(),
        }
    }
}

fn receipt_too_large(attempt_id: &str) -> Step {
    Step::cont()
        .with(Effect::Count(Stat::ReceiptTooLarge))
        .with(Effect::Log(
            Level::Warn,
            format!("atmost: response of attempt {attempt_id} exceeds max_receipt_bytes; it will be reported uncertain (receipt_too_large)"),
        ))
}

#[cfg(test)]
mod tests;
