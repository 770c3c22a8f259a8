//! The machine's vocabulary: what the adapter reads from Envoy for it, and the steps and
//! effects it answers with.

use crate::call::reply::LocalReply;
use crate::call::resume::Ticket;
use crate::ledger_client::Callout;
use crate::parse::mcp::Mirrored;
use crate::stats::Stat;
use atmost_protocol::credential::SecretValue;
use atmost_protocol::OutcomeReport;

/// Name of the idempotency header, as Envoy stores it.
pub use atmost_protocol::IDEMPOTENCY_KEY_HEADER as IDEMPOTENCY_HEADER;

/// What the request headers told us ([`RequestHead::from_headers`]).
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
    /// `:authority` (HTTP/1.1 `Host`), as sent.
    pub authority: String,
    /// `Last-Event-ID`.
    pub last_event_id: Option<String>,
    /// The [`ENVOY_CONTROL_HEADERS`](super::head::ENVOY_CONTROL_HEADERS) the request
    /// carries, each once.
    pub control_headers: Vec<&'static str>,
    /// The [`SIGNATURE_HEADERS`](super::signing::SIGNATURE_HEADERS) the request carries,
    /// each once: a client's own, which never go upstream.
    pub signature_headers: Vec<&'static str>,
    /// The first header named like one atmost reads but spelled otherwise
    /// ([`HEADERS_ATMOST_READS`](super::head::HEADERS_ATMOST_READS), the permit header).
    pub alias: Option<String>,
    /// For a GET carrying `Last-Event-ID`: the ticket a POST stream closed early left under
    /// `resume::key(session, last event id)`, as the adapter took it from shared data (only
    /// after [`Ticket::admits`] this GET, and removing it there, so it is used once).
    pub resume: Option<Ticket>,
    /// How the request asks to switch protocols, if it does (the first way it asks).
    pub upgrade: Option<Upgrade>,
    /// For a request that asks to upgrade: the name of the route Envoy picked for it (the
    /// property `xds.route_name`), which the adapter reads only then; `None` when Envoy
    /// names none.
    pub route: Option<String>,
}

/// How a request asks to switch protocols.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upgrade {
    /// An `Upgrade` header, whatever its value.
    Header,
    /// `:method` `CONNECT`: a tunnel to whatever the route's cluster is.
    Connect,
    /// A `:protocol` pseudo-header (RFC 8441 extended CONNECT) as the filter sees it.
    Protocol,
}

impl Upgrade {
    /// The request header that asks for an upgrade, by name (lowercase) and `:method` value;
    /// `None` for every other header.
    pub fn of_header(name: &str, value: &[u8]) -> Option<Upgrade> {
        match name {
            "upgrade" => Some(Upgrade::Header),
            ":protocol" => Some(Upgrade::Protocol),
            ":method" if value.eq_ignore_ascii_case(b"CONNECT") => Some(Upgrade::Connect),
            _ => None,
        }
    }
}

/// What the response headers told us.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ResponseHead {
    pub content_type: Option<String>,
    pub end_of_stream: bool,
    /// `atmost-tool-refusal`: a verifier at the tool refused the dispatch (every value,
    /// joined by `", "`; read only for a dispatched call).
    pub tool_refusal: Option<String>,
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
    /// A request header set to the ledger's credential ([`crate::call::credential`]): a
    /// request edit like `SetRequestHeader`, whose `Debug` never shows the value.
    SetRequestSecret(String, SecretValue),
    /// Replace the buffered request body (`original_len` bytes) with `body`.
    ///
    /// The request edits (`RemoveRequestHeader`, `SetRequestHeader`, `SetRequestSecret`,
    /// `ReplaceRequestBody`) must all take effect before the request may go on: when the
    /// host refuses one, the adapter carries out nothing more of the step (no
    /// `ResumeRequest`, no `Continue`) and calls [`Call::on_rewrite_failed`] instead.
    ReplaceRequestBody {
        original_len: usize,
        body: Vec<u8>,
    },
    /// Response edits: a header set or removed, or the response body Envoy holds
    /// (`original_len` bytes from its start) replaced by `body`. When the host refuses one,
    /// the adapter tells the machine ([`Call::on_response_edit_refused`]) and goes on: the
    /// answer still goes out, as the upstream sent it.
    SetResponseHeader(String, String),
    RemoveResponseHeader(String),
    ReplaceResponseBody {
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
    /// `answer_release: at_once`: hand this `completed` or `accepted` report to the root's
    /// batch as [`Effect::Complete`] does, but hold nothing for it: the answer goes on in
    /// the same step (its flow is `Continue`) and the root alone sees the report through
    /// (sent, or queued for retry when it fails). The machine hears nothing more of it.
    CompleteUnwaited(OutcomeReport),
    /// `approval_hold_ms`: the call stays paused, held for a person's approval; the ledger
    /// is asked again ([`Call::reask`]) once `wait_ms` have passed. The root context keeps
    /// the time ([`crate::held_calls`]); the request's end forgets it.
    HoldForApproval {
        wait_ms: u64,
    },
    /// Store a resume ticket in shared data under this key (see [`crate::call::resume`]).
    SaveResume(String, Ticket),
    Count(Stat),
    Log(Level, String),
}

impl Effect {
    /// One of the response edits.
    pub fn edits_response(&self) -> bool {
        matches!(
            self,
            Effect::SetResponseHeader(..)
                | Effect::RemoveResponseHeader(_)
                | Effect::ReplaceResponseBody { .. }
        )
    }
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
    pub(crate) fn new(flow: Flow) -> Step {
        Step {
            flow,
            effects: Vec::new(),
            callout: None,
        }
    }
    pub(crate) fn cont() -> Step {
        Step::new(Flow::Continue)
    }
    pub(crate) fn pause() -> Step {
        Step::new(Flow::Pause)
    }
    pub(crate) fn with(mut self, e: Effect) -> Step {
        self.effects.push(e);
        self
    }
    /// Every effect of `e`, in order: an `Option` adds its one effect or none.
    pub(crate) fn with_all(mut self, e: impl IntoIterator<Item = Effect>) -> Step {
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
