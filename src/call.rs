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
//!   │ ──dispatch under another permit than the token names, or (`request_hold: headers`)
//!   │   without a signature over what was asked: deny, report `released`──▶ Answered
//!   │ dispatch: rewrite the key, add the ledger's signature, then resume the request
//!   │ ──the host refused a rewrite (on_rewrite_failed): deny, report `released`──▶ Answered
//!   ▼
//! Dispatched(response watch) ──receipt found──▶ report `completed`, hold the chunk ──▶ Settled
//!   │ (`answer_release: at_once`, `completed` / `accepted`: the report to the root's batch,
//!   │  nothing held ──▶ Settled at once)
//!   └─ on_log without an acknowledged report ──▶ queue completed / released / uncertain
//!
//! ReadingBody ──tools/list with a permit, `tools_list_limits` on──▶ Listing(response watch)
//!   ──answer found: ONE limits callout, the answer held──▶ figures written in ──▶ done
//! ```
//!
//! Every answer to a governed call carries the permit's figures the ledger gave
//! ([`crate::call::permit_meta`]): a local reply gets them as it is built, a dispatched call's
//! upstream answer as an edit of its body (JSON or the SSE event), with the headers.
//!
//! With `request_hold: headers` (the default) nothing of a governed call leaves before the
//! decision, so the authorize request names the exact request that will leave and the
//! ledger signs it ([`signing`]).
//!
//! With `request_hold: body` ([`body_hold`]) a POST's headers go upstream at once from
//! `Start` (without the permit header, `content-length`, or a governed call's key header,
//! which would be derived before the ledger confirmed the permit) and only its body waits in `ReadingBody`
//! and `Authorizing`; a response before the decision leads to `Overtaken`, where the body is
//! held for good and a reserved attempt is released.

use crate::ledger_client::{Callout, CalloutError, Endpoint, LedgerReply};
use crate::parse::body_encoding;
use crate::parse::fingerprint::fingerprint;
use crate::parse::idempotency;
use crate::parse::key_rewrite;
use crate::parse::mcp::{self, Message};
use crate::stats::Stat;
use atmost_config::{AnswerRelease, CompletionReports, Config, RequestHold, UpstreamKey};
use atmost_protocol::{
    AuthorizeRequest, AuthorizeResponse, Denial, DenialCode, DispatchGrant, LimitsRequest,
    LimitsResponse, Outcome, OutcomeAck, OutcomesRequest, PermitLimits, MAX_LIMITS_TOOLS,
};
use serde_json::Value;
use std::rc::Rc;

pub mod credential;
pub mod denial;
pub mod effects;
pub mod outcome;
pub mod permit;
pub mod permit_meta;
pub mod receipt;
pub mod replay;
pub mod reply;
pub mod resume;
pub mod signing;
pub mod upstream_key;

mod body_hold;
mod head;
mod ledger_reply;
mod response;
mod sent_body;
mod session_credential;
mod step;
pub mod upgrade;

use body_hold::Ahead;
use outcome::NoReceipt;
use permit_meta::TextAt;
use receipt::{Passed, ResultKind, SseCapture, SseProgress};
use reply::{rpc_code, LocalReply};
use resume::{CallPermit, Ticket};
use sent_body::SentBody;
use signing::Signing;
use upstream_key::UNGOVERNED_PERMIT_ID;

pub use head::{ENVOY_CONTROL_HEADERS, HEADERS_ATMOST_READS, MAX_RETRIES_HEADER};
pub use step::*;

#[derive(Debug, Clone, PartialEq)]
struct Pending {
    id: Value,
    tool: String,
    permit: CallPermit,
    path: String,
    key: Option<String>,
    session_id: Option<String>,
    /// The Envoy route the request was given (`xds.route_name`), which a credential must
    /// belong to ([`credential`]).
    route: Option<String>,
    /// What goes upstream if the ledger dispatches; `None` when the token names no permit
    /// (the ledger authenticates no such token, and nothing could be derived for it).
    upstream: Option<Box<Upstream>>,
}

/// What the filter sends upstream if the ledger dispatches the call, fixed before it asks
/// and derived with the permit id the token names, which the Dispatch answer must name too.
/// The authorize request states it (`forwarded_key`, and with `request_hold: headers` the
/// `dispatch` the ledger signs), so what leaves is what the ledger was told.
#[derive(Debug, Clone, PartialEq)]
struct Upstream {
    permit_id: String,
    /// The key in its `upstream_key` form: the `Idempotency-Key` value (`None`: no header)
    /// and the value of the body's key members.
    key: Option<String>,
    /// The body with its key members rewritten, when they are (`upstream_key` other than
    /// `raw`).
    body: Option<SentBody>,
    /// `request_hold: headers`: the request the ledger is asked to sign.
    signing: Option<Signing>,
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
    /// A verifier at the tool refused the dispatch: its `atmost-tool-refusal` header. The
    /// answer is the verifier's, never a receipt.
    RefusedAtTool(String),
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
    /// The permit the call came with, so only a GET under the same permit can resume its
    /// stream.
    permit: CallPermit,
    /// `:path` of the request, which a resuming GET must repeat.
    path: String,
    id: Value,
    tool: String,
    watch: Watch,
    session_id: Option<String>,
    /// A GET resuming the stream of a call dispatched by an earlier POST: it can bring the
    /// receipt, but its own failure says nothing about the call.
    resumed: bool,
    /// What the permit still allows, as the ledger's Dispatch answer said.
    limits: Option<PermitLimits>,
    /// The answer's body is to carry the figures: its `content-length` was removed.
    edit_body: bool,
}

/// A `tools/list` whose answer may gain the permit's figures (`tools_list_limits`).
#[derive(Debug, Clone)]
struct Listing {
    id: Value,
    permit_token: String,
    watch: ListWatch,
}

#[derive(Debug, Clone)]
enum ListWatch {
    AwaitingHeaders,
    /// `application/json`: buffering the body.
    BufferingJson {
        size: usize,
    },
    /// `text/event-stream`: looking for the answer's event.
    StreamingSse(Box<SseCapture>),
    /// The limits callout is out; Envoy holds these bytes, where the answer's text is.
    Asking(Box<(Vec<u8>, TextAt)>),
    /// Nothing (more) to do.
    Done,
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
    /// A `tools/list` passing, its answer watched for the permit's figures.
    Listing(Box<Listing>),
    /// A local reply was sent.
    Answered,
    /// `request_hold: body`: the upstream answered before the decision. The body is held
    /// for good (never sent); the upstream's answer goes to the client.
    Overtaken,
}

/// One request's state machine.
#[derive(Debug, Clone)]
pub struct Call {
    config: Rc<Config>,
    state: State,
    /// `request_hold: body`: what left with the headers of this POST before the decision.
    ahead: Option<Ahead>,
    /// `completion_reports: batched`: this call's report went to the root's batch
    /// ([`Effect::Complete`]) and the machine has not heard that the batch is done.
    in_completion_batch: bool,
    /// `credential_cache_ms` > 0: the session's credential ([`session_credential`]).
    session: Option<session_credential::Session>,
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

pub(crate) fn bad_request(reply: LocalReply) -> Step {
    Step::pause()
        .with(Effect::LocalReply(reply))
        .with(Effect::Count(Stat::BadRequest))
}

/// A header named like one atmost reads, spelled otherwise: an upstream that reads `_` as
/// `-` could take its value for the one atmost checked, so nothing of the request is sent.
pub(crate) fn alias_refused(name: &str) -> Step {
    bad_request(LocalReply::rpc_error(
        400,
        None,
        rpc_code::INVALID_REQUEST,
        &format!(
            "header `{name}` is refused: servers that read `_` as `-` take it for a header atmost checks under its own name; send that header only as it is spelled with `-`"
        ),
    ))
}

/// The refusal of request trailers on a POST whose body is read: what they would add is
/// read by no check, in either role.
pub(crate) fn trailers_refused() -> Step {
    bad_request(LocalReply::rpc_error(
        400,
        None,
        rpc_code::INVALID_REQUEST,
        "request trailers are not accepted by atmost",
    ))
}

/// The refusal of a POST whose body the filter will not read (an encoding or charset other
/// than plain UTF-8, or a stated length past `max_body_bytes`), the same in both roles.
pub(crate) fn unreadable_body(head: &RequestHead, max_body_bytes: u64) -> Option<Step> {
    if let Err(refusal) = body_encoding::check(&head.content_type, &head.content_encoding) {
        return Some(bad_request(LocalReply::rpc_error(
            400,
            None,
            rpc_code::INVALID_REQUEST,
            refusal.message(),
        )));
    }
    head.content_length
        .filter(|n| *n > max_body_bytes)
        .map(|_| too_large(max_body_bytes))
}

pub(crate) fn too_large(max: u64) -> Step {
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
            ahead: None,
            in_completion_batch: false,
            session: None,
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
            State::Listing(l) => match l.watch {
                ListWatch::Asking(_) => "listing_asking",
                _ => "listing",
            },
            State::Overtaken => "overtaken",
            State::Dispatched(d) => match d.watch {
                Watch::AwaitingHeaders => "dispatched",
                Watch::BufferingJson { .. } => "buffering_json",
                Watch::StreamingSse(_) => "streaming_sse",
                Watch::NoReceipt(_) => "no_receipt",
                Watch::RefusedAtTool(_) => "refused_at_tool",
                Watch::Reporting { .. } => "reporting",
                Watch::Settled => "settled",
            },
        }
    }

    pub fn on_request_headers(&mut self, head: RequestHead) -> Step {
        self.note_session(&head);
        let step = self.request_headers(head);
        self.with_session_credential(step)
    }

    fn request_headers(&mut self, head: RequestHead) -> Step {
        if !matches!(self.state, State::Start) {
            return Step::cont();
        }
        if let Some(alias) = &head.alias {
            self.state = State::Answered;
            return alias_refused(alias);
        }
        if let Some(refusal) = upgrade::refusal(&head, &self.config.upgrade_routes) {
            self.state = State::Answered;
            return refusal;
        }
        let edits = self.head_edits(&head);
        if head.method.eq_ignore_ascii_case("GET") {
            if let Some(t) = head.resume {
                let key = self.passing_key_header(&head.idempotency_key);
                let step = Step::cont().with_all(edits).with_all(key).with(Effect::Log(
                    Level::Info,
                    format!(
                        "atmost: GET resumes the stream of attempt {} (round {}) of `{}`; watching it for the answer",
                        t.grant.attempt_id, t.grant.round, t.tool
                    ),
                ));
                self.state = State::Dispatched(Box::new(Dispatched {
                    grant: t.grant,
                    permit: CallPermit::Hash(t.permit_hash),
                    path: t.path,
                    id: t.id,
                    tool: t.tool,
                    watch: Watch::AwaitingHeaders,
                    session_id: head.session_id,
                    resumed: true,
                    limits: t.limits,
                    edit_body: false,
                }));
                return step;
            }
        }
        // An upgrade on a listed route passes like traffic that needs no decision: what
        // follows its headers is the upgraded connection, never a body to read.
        if head.upgrade.is_some() || !head.method.eq_ignore_ascii_case("POST") || head.end_of_stream
        {
            return match self.passing_key_header(&head.idempotency_key) {
                Some(key) => {
                    self.state = State::Forwarding(Value::Null, None);
                    Step::cont().with_all(edits).with(key)
                }
                None => {
                    self.state = State::Passing;
                    Step::cont().with_all(edits)
                }
            };
        }
        if let Some(refusal) = unreadable_body(&head, self.config.max_body_bytes) {
            self.state = State::Answered;
            return refusal;
        }
        if self.config.request_hold == RequestHold::Body {
            return self.let_headers_go(head, edits);
        }
        self.state = State::ReadingBody(Box::new(head));
        Step::pause().with_all(edits)
    }

    /// The edits every request gets before anything of it can leave: the permit header and
    /// Envoy's control headers removed and, on a POST, Envoy's retries turned off.
    fn head_edits(&self, head: &RequestHead) -> Vec<Effect> {
        let mut edits = Vec::new();
        // The permit never goes upstream; when the request has none there is nothing to
        // remove (every header name was matched case-insensitively).
        if !head.permit.is_empty() {
            edits.push(Effect::RemoveRequestHeader(
                self.config.permit_header.clone(),
            ));
        }
        for name in head.control_headers.iter().chain(&head.signature_headers) {
            edits.push(Effect::RemoveRequestHeader((*name).into()));
        }
        if head.method.eq_ignore_ascii_case("POST") {
            edits.push(Effect::SetRequestHeader(
                MAX_RETRIES_HEADER.into(),
                "0".into(),
            ));
        }
        edits.extend(
            head.control_headers
                .iter()
                .map(|_| Effect::Count(Stat::ControlHeaderRemoved)),
        );
        edits
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
        if let Some(refused) = self.refuse_pass_after_head(&id) {
            return refused;
        }
        let mode = &self.config.upstream_key;
        let mut step = Step::cont();
        if let Some(body) = body.filter(|_| *mode != UpstreamKey::Raw) {
            let rewritten = key_rewrite::rewritten(body, |raw| {
                let key = idempotency::valid_body_key(raw);
                upstream_key::upstream_value(mode, UNGOVERNED_PERMIT_ID, key.as_deref())
            });
            if let Some(sent) = rewritten {
                let length = head.content_length.is_some();
                step.effects
                    .extend(SentBody::new(body, sent, length).effects());
            }
        }
        if self.ahead.is_none() {
            step = step.with_all(self.passing_key_header(&head.idempotency_key));
        }
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
            State::Answered | State::Overtaken => Step::pause(),
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
            State::Listing(l) => bad_request(LocalReply::rpc_error(
                503,
                Some(&l.id),
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
            State::Authorizing(_) | State::Answered | State::Overtaken => {
                BodyStep::Done(Step::pause())
            }
            _ => BodyStep::Done(Step::cont()),
        }
    }

    pub fn on_request_trailers(&mut self) -> Step {
        match &self.state {
            State::ReadingBody(_) => {
                self.state = State::Answered;
                trailers_refused()
            }
            State::Authorizing(_) | State::Answered | State::Overtaken => Step::pause(),
            _ => Step::cont(),
        }
    }

    /// The whole request body, after [`BodyStep::Read`].
    pub fn on_request_body_data(&mut self, body_bytes: &[u8]) -> Step {
        let step = self.request_body_data(body_bytes);
        self.with_session_credential(step)
    }

    fn request_body_data(&mut self, body_bytes: &[u8]) -> Step {
        let body = body_bytes;
        let State::ReadingBody(head) = std::mem::replace(&mut self.state, State::Answered) else {
            // Not expected; put nothing at risk.
            return Step::pause();
        };
        let call = match mcp::parse(body, &head.mirrored) {
            Err(reply) => return bad_request(*reply),
            Ok(Message::Other) => return self.pass(&head, None, Value::Null, None),
            Ok(Message::KeyedOther(id)) => return self.pass(&head, Some(body), id, None),
            Ok(Message::ToolsList { id, keyed }) => {
                let step = self.pass(&head, keyed.then_some(body), id.clone(), None);
                // A refused pass (`request_hold: body`) answered it: nothing to watch.
                let passed = !matches!(self.state, State::Answered);
                if self.config.tools_list_limits && passed {
                    // Without a readable permit there is nothing to ask: it passes unchanged.
                    if let Ok(permit_token) =
                        permit::token(&head.permit, &self.config.permit_header)
                    {
                        self.state = State::Listing(Box::new(Listing {
                            id,
                            permit_token,
                            watch: ListWatch::AwaitingHeaders,
                        }));
                    }
                }
                return step;
            }
            Ok(Message::ToolCall(call)) => call,
        };
        if !self.config.governed_tools.contains(&call.name) {
            self.no_session_credential();
            let keyed = call.keys.any_field();
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
        let permit = CallPermit::Token(permit_token.clone());
        let key = match idempotency::resolve(&head.idempotency_key, &call.keys) {
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
        let in_body = call.keys.any_present();
        let hold_headers = self.config.request_hold == RequestHold::Headers;
        // What the upstream will receive if the ledger dispatches: derived with the permit id
        // the token names, which a Dispatch answer must confirm (the ledger accepts a token
        // only for the permit it names).
        let upstream = atmost_protocol::token::permit_id_of(&permit_token).map(|permit_id| {
            let mode = &self.config.upstream_key;
            let key = upstream_key::upstream_value(mode, permit_id, key.as_deref());
            let body = match mode {
                UpstreamKey::Raw => None,
                _ if !in_body => None,
                _ => key_rewrite::rewritten(body_bytes, |_| key.clone())
                    .map(|sent| SentBody::new(body_bytes, sent, head.content_length.is_some())),
            };
            let signing = hold_headers.then(|| {
                let line = signing::RequestLine {
                    method: &head.method,
                    authority: &head.authority,
                    path: &head.path,
                };
                let sent = body.as_ref().map_or(body_bytes, |b| b.body.as_slice());
                Signing::new(
                    &line,
                    sent,
                    key.as_deref(),
                    self.config.signature_validity_s,
                )
            });
            Box::new(Upstream {
                permit_id: permit_id.to_string(),
                key,
                body,
                signing,
            })
        });
        // With `request_hold: body` no key header goes upstream (it would leave before the
        // ledger confirmed the permit it is derived for): only a key in the body reaches it.
        let forwarded_key = upstream
            .as_ref()
            .and_then(|u| u.key.clone())
            .filter(|_| hold_headers || in_body);
        // The header is set by the dispatch under `request_hold: headers` only.
        let forwarded_key_carriers =
            upstream_key::carriers(forwarded_key.is_some(), hold_headers, &call.keys);
        let request = AuthorizeRequest {
            permit_token,
            tool: call.name.clone(),
            idempotency_key: key.clone(),
            fingerprint: fp,
            key_required: self.config.key_required_tools.contains(&call.name),
            continuation: call.continuation,
            arguments: Value::Object(call.arguments),
            forwarded_key,
            forwarded_key_carriers,
            dispatch: upstream
                .as_ref()
                .and_then(|u| u.signing.as_ref())
                .map(|s| s.target.clone()),
        };
        let body = match serde_json::to_vec(&request) {
            Ok(b) => b,
            Err(_) => return deny_step(&self.config, &gateway_unavailable(), &call.id, &call.name),
        };
        self.state = State::Authorizing(Pending {
            permit,
            path: head.path.clone(),
            id: call.id,
            tool: call.name,
            key,
            session_id: head.session_id.clone(),
            route: head.route.clone(),
            upstream,
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
}

#[cfg(test)]
mod tests;
