//! The per-request state machine. The adapter feeds it Envoy's callbacks as events; it
//! answers with a [`Step`]: what to return to Envoy ([`Flow`]), side effects in order
//! ([`Effect`]), and at most one ledger callout. It never touches Envoy itself, so every
//! transition is tested natively.
//!
//! A request goes through phases ([`phase`], where their diagram is): each handles the
//! events that reach it and says what the request steps to. [`Call`] routes each event to
//! the phase the request is in, and keeps what lasts through all of them ([`Context`]).

use crate::ledger_client::{Callout, LedgerReply};
use atmost_config::Config;
use std::cell::RefCell;
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
mod phase;
mod refusal;
mod sent_body;
mod session_credential;
mod step;
pub mod upgrade;

use body_hold::Ahead;
use phase::reading_body::ReadingBody;
use phase::{start, Phase};
use refusal::rewrite_failed;
use session_credential::Session;

pub(crate) use refusal::{
    alias_refused, bad_request, too_large, trailers_refused, unreadable_body,
};

pub use head::{ENVOY_CONTROL_HEADERS, HEADERS_ATMOST_READS, MAX_RETRIES_HEADER};
pub use phase::PhaseName;
pub use step::*;

/// What lasts through every phase of a request.
#[derive(Debug, Clone)]
struct Context {
    config: Rc<Config>,
    /// `request_hold: body`: what left with the headers of this POST before the decision.
    ahead: Option<Ahead>,
    /// `completion_reports: batched`: this call's report went to the root's batch
    /// ([`Effect::Complete`]) and the machine has not heard that the batch is done.
    in_completion_batch: bool,
    /// `credential_cache_ms` > 0: the session's credential ([`session_credential`]).
    session: Option<Session>,
    /// Unix milliseconds now, by Envoy's clock: when a hold for approval began and whether
    /// its bound is reached.
    clock: fn() -> u64,
}

/// The clock of a call no adapter gave one: time stands still, so a hold for approval ends
/// only by the ledger's answer.
fn still() -> u64 {
    0
}

/// One request's state machine.
#[derive(Debug, Clone)]
pub struct Call {
    phase: Phase,
    cx: Context,
}

/// A configured byte count as a length in memory: past what `usize` holds (wasm32), as
/// much as it can hold.
fn usize_of(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// `request_hold: body`: the upstream answered before the decision.
fn answered_early(cx: &Context) -> bool {
    matches!(&cx.ahead, Some(a) if a.answered_early)
}

impl Call {
    pub fn new(config: Rc<Config>) -> Call {
        Call {
            phase: Phase::Start,
            cx: Context {
                config,
                ahead: None,
                in_completion_batch: false,
                session: None,
                clock: still,
            },
        }
    }

    /// This call reads the time from `clock` (Unix milliseconds).
    pub fn with_clock(mut self, clock: fn() -> u64) -> Call {
        self.cx.clock = clock;
        self
    }

    /// This call takes part in the session's credentials: `cache` is its worker's, `now_ms`
    /// the time its request began.
    pub fn with_session_credentials(
        mut self,
        cache: Rc<RefCell<credential::CredentialCache>>,
        now_ms: u64,
    ) -> Call {
        self.cx.session = Some(Session::new(cache, now_ms));
        self
    }

    /// Where the request stands, as one of the closed set of names ([`PhaseName`]).
    pub fn phase_name(&self) -> PhaseName {
        self.phase.name()
    }

    /// Short state name (tests, debug logs): [`Call::phase_name`] as text.
    pub fn state_name(&self) -> &'static str {
        self.phase_name().as_str()
    }

    /// Hands the phase to `event`, which handles it and says what the request steps to.
    /// While it runs the request counts as answered, the phase that puts nothing at risk.
    fn advance<R>(&mut self, event: impl FnOnce(Phase, &mut Context) -> (Phase, R)) -> R {
        let phase = std::mem::replace(&mut self.phase, Phase::Answered);
        let (next, answer) = event(phase, &mut self.cx);
        self.phase = next;
        answer
    }

    pub fn on_request_headers(&mut self, head: RequestHead) -> Step {
        if let Some(s) = &mut self.cx.session {
            s.note(&head, &self.cx.config.permit_header);
        }
        let step = match self.phase {
            Phase::Start => self.advance(|_, cx| start::on_request_headers(cx, head)),
            _ => Step::cont(),
        };
        self.with_session_credential(step)
    }

    /// The host refused one of the request edits of the last step (a header or the body):
    /// the request must not go on, since it would carry the raw key, or a body that no
    /// longer matches its `content-length`. Every phase ends answered.
    pub fn on_rewrite_failed(&mut self) -> Step {
        self.advance(|phase, cx| {
            let config = &cx.config;
            let step = match phase {
                Phase::Answered | Phase::Overtaken => Step::pause(),
                Phase::Dispatched(d) => d.on_rewrite_failed(config),
                Phase::Forwarding(f) => f.on_rewrite_failed(config),
                Phase::Authorizing(a) => a.on_rewrite_failed(config),
                Phase::Listing(l) => l.on_rewrite_failed(),
                Phase::Start | Phase::Passing | Phase::ReadingBody(_) => rewrite_failed(None),
            };
            (Phase::Answered, step)
        })
    }

    pub fn on_request_body(&mut self, size: usize, end_of_stream: bool) -> BodyStep {
        match &self.phase {
            Phase::ReadingBody(r) => {
                match r.on_request_body(&self.cx.config, size, end_of_stream) {
                    Ok(step) => step,
                    Err(refusal) => {
                        self.phase = Phase::Answered;
                        BodyStep::Done(refusal)
                    }
                }
            }
            Phase::Authorizing(_) | Phase::Answered | Phase::Overtaken => {
                BodyStep::Done(Step::pause())
            }
            _ => BodyStep::Done(Step::cont()),
        }
    }

    pub fn on_request_trailers(&mut self) -> Step {
        match self.phase {
            Phase::ReadingBody(_) => self.advance(|_, _| (Phase::Answered, trailers_refused())),
            Phase::Authorizing(_) | Phase::Answered | Phase::Overtaken => Step::pause(),
            _ => Step::cont(),
        }
    }

    /// The whole request body, after [`BodyStep::Read`].
    pub fn on_request_body_data(&mut self, body: &[u8]) -> Step {
        let step = self.advance(|phase, cx| match phase {
            Phase::ReadingBody(r) => r.on_body(cx, body),
            // Not expected; put nothing at risk.
            _ => (Phase::Answered, Step::pause()),
        });
        self.with_session_credential(step)
    }

    pub fn on_response_headers(&mut self, head: ResponseHead) -> Step {
        if self.awaits_decision() {
            return match &self.phase {
                Phase::Authorizing(a) => {
                    if let Some(ahead) = &mut self.cx.ahead {
                        ahead.answered_early = true;
                    }
                    a.on_response_before_decision()
                }
                _ => {
                    self.phase = Phase::Overtaken;
                    ReadingBody::on_response_before_decision()
                }
            };
        }
        match &mut self.phase {
            Phase::Dispatched(d) => d.on_response_headers(&self.cx.config, head),
            Phase::Listing(l) => l.on_response_headers(&self.cx.config, &head),
            _ => Step::cont(),
        }
    }

    /// The host refused a response edit (a header, or the body): the answer goes out as the
    /// upstream sent it, without the figures in its body, and nothing more is edited (an
    /// SSE stream holds nothing back any longer).
    pub fn on_response_edit_refused(&mut self) -> Step {
        match &mut self.phase {
            Phase::Dispatched(d) => d.on_response_edit_refused(),
            Phase::Listing(l) => l.on_response_edit_refused(),
            _ => {}
        }
        Step::cont().with(Effect::Log(
            Level::Warn,
            "atmost: Envoy refused an edit of the response; it goes on without the permit's figures in its body".into(),
        ))
    }

    pub fn on_response_body(&mut self, size: usize, end_of_stream: bool) -> BodyStep {
        if self.holds_early_response() {
            return BodyStep::Done(Step::pause());
        }
        let max = self.cx.config.max_receipt_bytes;
        match &mut self.phase {
            Phase::Listing(l) => l.on_response_body(max, size, end_of_stream),
            Phase::Dispatched(d) => d.on_response_body(max, size, end_of_stream),
            _ => BodyStep::Done(Step::cont()),
        }
    }

    pub fn on_response_trailers(&mut self) -> BodyStep {
        if self.holds_early_response() {
            return BodyStep::Done(Step::pause());
        }
        match &self.phase {
            Phase::Dispatched(d) => d.on_response_trailers(),
            Phase::Listing(l) => l.on_response_trailers(),
            _ => BodyStep::Done(Step::cont()),
        }
    }

    /// Response bytes after [`BodyStep::Read`]: the whole buffered JSON body, or one SSE chunk.
    pub fn on_response_body_data(&mut self, bytes: &[u8], end_of_stream: bool) -> Step {
        match &mut self.phase {
            Phase::Listing(l) => l.on_response_body_data(&self.cx.config, bytes, end_of_stream),
            Phase::Dispatched(d) => d.on_response_body_data(&mut self.cx, bytes, end_of_stream),
            _ => Step::cont(),
        }
    }

    /// The callout of the last step could not even be dispatched.
    pub fn on_callout_failed(&mut self) -> Step {
        if let Some(step) = self
            .cx
            .session
            .as_mut()
            .and_then(Session::on_callout_failed)
        {
            return step;
        }
        match &mut self.phase {
            Phase::Authorizing(a) => {
                let step = a.on_callout_failed(&self.cx.config);
                self.phase = Phase::Answered;
                step
            }
            Phase::Listing(l) => l.on_callout_failed(),
            Phase::Dispatched(d) => d.on_callout_failed(),
            _ => Step::cont(),
        }
    }

    /// The ledger answered (or failed to answer) the pending callout.
    pub fn on_ledger_reply(&mut self, reply: &LedgerReply) -> Step {
        if let Some(step) = self.cx.session.as_mut().and_then(|s| s.on_reply(reply)) {
            return step;
        }
        match &mut self.phase {
            Phase::Listing(l) => l.on_limits_reply(reply),
            Phase::Dispatched(d) => d.on_report_reply(reply),
            Phase::Authorizing(_) => self.advance(|phase, cx| match phase {
                Phase::Authorizing(a) if answered_early(cx) => {
                    (Phase::Overtaken, a.after_early_answer(reply))
                }
                Phase::Authorizing(a) => a.on_authorize_reply(cx, reply),
                other => (other, Step::cont()),
            }),
            _ => Step::cont(),
        }
    }

    /// `approval_hold_ms`: the call is held open for a person's approval, its request paused,
    /// until the ledger is asked again ([`Call::reask`]).
    pub fn is_held(&self) -> bool {
        matches!(&self.phase, Phase::Authorizing(a) if a.is_held())
    }

    /// The authorize request of a held call, to send again once its wait is over
    /// ([`Effect::HoldForApproval`]); its answer comes back through
    /// [`Call::on_ledger_reply`], or [`Call::on_callout_failed`] when it cannot be sent.
    /// `None` for a call not held.
    pub fn reask(&self) -> Option<Callout> {
        match &self.phase {
            Phase::Authorizing(a) => a.reask(),
            _ => None,
        }
    }

    /// Whether a completion report is out and the response held (the adapter then checks
    /// the root's batch in later callbacks).
    pub fn is_reporting(&self) -> bool {
        matches!(&self.phase, Phase::Dispatched(d) if d.is_reporting())
    }

    /// `completion_reports: batched`: the root finished the batch carrying this call's
    /// report (acknowledged, or failed and queued for retry by the root) and resumed the
    /// response. Nothing is left to report.
    pub fn on_completion_settled(&mut self) {
        self.cx.in_completion_batch = false;
        if let Phase::Dispatched(d) = &mut self.phase {
            d.on_completion_settled();
        }
    }

    /// `completion_reports: batched`, before each response callback and `on_log`: while this
    /// call's report is in the root's batch, asks the root whether it is still `waiting`
    /// there ([`crate::report::Reporter::is_waiting`]); once it is not, the batch is done
    /// ([`Call::on_completion_settled`]). The root is asked nothing otherwise.
    pub fn check_completion_batch(&mut self, waiting: impl FnOnce() -> bool) {
        if self.cx.in_completion_batch && !waiting() {
            self.on_completion_settled();
        }
    }

    /// Whether `on_log` needs Envoy's attempt count and response flags: only for a
    /// dispatched call whose outcome is not settled yet.
    pub fn needs_log_props(&self) -> bool {
        matches!(&self.phase, Phase::Dispatched(d) if d.needs_log_props())
    }

    /// Whether the response headers matter (a dispatched call, or a `tools/list` whose
    /// answer may gain the figures, waiting for them): only then does the adapter look up
    /// `content-type`.
    pub fn watches_response_headers(&self) -> bool {
        match &self.phase {
            Phase::Dispatched(d) => d.awaits_response_headers(),
            Phase::Listing(l) => l.awaits_response_headers(),
            _ => self.awaits_decision(),
        }
    }

    /// The request is over (`on_log`).
    pub fn on_log(&mut self, props: LogProps) -> Step {
        self.advance(|phase, _| {
            let step = match phase {
                Phase::Authorizing(a) => a.on_log(),
                Phase::Dispatched(d) => d.on_log(props),
                _ => Step::cont(),
            };
            (Phase::Answered, step)
        })
    }

    /// `request_hold: body`: before the decision, with the request's headers upstream and
    /// its body held here.
    fn awaits_decision(&self) -> bool {
        matches!(&self.cx.ahead, Some(a) if !a.answered_early)
            && matches!(self.phase, Phase::ReadingBody(_) | Phase::Authorizing(_))
    }

    /// The upstream answered while the authorize callout is out: its response is held.
    fn holds_early_response(&self) -> bool {
        answered_early(&self.cx) && matches!(self.phase, Phase::Authorizing(_))
    }

    /// `step`, which lets the request pass, with the session's credential added: from the
    /// cache, or held for the ledger's answer ([`Session::add_to`]).
    fn with_session_credential(&mut self, step: Step) -> Step {
        let passing = self.phase.lets_request_pass() && self.cx.ahead.is_none();
        match &mut self.cx.session {
            Some(s) if passing => s.add_to(step),
            _ => step,
        }
    }
}

#[cfg(test)]
mod tests;
