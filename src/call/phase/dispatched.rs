//! `Dispatched`: the ledger dispatched the call (or a GET resumes the stream of one it
//! dispatched earlier). Its response is watched for the receipt, the answer held while the
//! `completed` report is out, and `on_log` concludes what the attempt became when the
//! request ends without an acknowledged report.

use super::PhaseName;
use crate::call::outcome::{self, NoReceipt};
use crate::call::permit_meta::{self, TextAt};
use crate::call::receipt::{self, Passed, ResultKind, SseCapture, SseProgress};
use crate::call::refusal::{deny_step, rewrite_failed_log, rewrite_refused};
use crate::call::resume::{self, CallPermit, Ticket};
use crate::call::{usize_of, BodyStep, Context, Effect, Flow, Level, LogProps, ResponseHead, Step};
use crate::ledger_client::{Callout, LedgerReply};
use crate::stats::Stat;
use atmost_config::{AnswerRelease, CompletionReports, Config};
use atmost_protocol::{DispatchGrant, Outcome, OutcomeAck, OutcomesRequest, PermitLimits};
use serde_json::Value;

#[derive(Debug, Clone)]
pub(super) enum Watch {
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
pub(in crate::call) struct Dispatched {
    /// The attempt, the round this request dispatched (or resumed) and its capability.
    pub(super) grant: DispatchGrant,
    /// The permit the call came with, so only a GET under the same permit can resume its
    /// stream.
    pub(super) permit: CallPermit,
    /// `:path` of the request, which a resuming GET must repeat.
    pub(super) path: String,
    pub(super) id: Value,
    pub(super) tool: String,
    pub(super) watch: Watch,
    pub(super) session_id: Option<String>,
    /// A GET resuming the stream of a call dispatched by an earlier POST: it can bring the
    /// receipt, but its own failure says nothing about the call.
    pub(super) resumed: bool,
    /// What the permit still allows, as the ledger's Dispatch answer said.
    pub(super) limits: Option<PermitLimits>,
    /// The answer's body is to carry the figures: its `content-length` was removed.
    pub(super) edit_body: bool,
}

impl Watch {
    fn name(&self) -> PhaseName {
        match self {
            Watch::AwaitingHeaders => PhaseName::Dispatched,
            Watch::BufferingJson { .. } => PhaseName::BufferingJson,
            Watch::StreamingSse(_) => PhaseName::StreamingSse,
            Watch::NoReceipt(_) => PhaseName::NoReceipt,
            Watch::RefusedAtTool(_) => PhaseName::RefusedAtTool,
            Watch::Reporting { .. } => PhaseName::Reporting,
            Watch::Settled => PhaseName::Settled,
        }
    }
}

impl Dispatched {
    /// The call a resume ticket names, whose stream a GET of `session_id` resumes.
    pub(super) fn resuming(t: Ticket, session_id: Option<String>) -> Dispatched {
        Dispatched {
            grant: t.grant,
            permit: CallPermit::Hash(t.permit_hash),
            path: t.path,
            id: t.id,
            tool: t.tool,
            watch: Watch::AwaitingHeaders,
            session_id,
            resumed: true,
            limits: t.limits,
            edit_body: false,
        }
    }

    /// The phase's name, told by how far its response is watched.
    pub(super) fn name(&self) -> PhaseName {
        self.watch.name()
    }

    /// A resuming GET whose response has not begun: it passes like traffic that needs no
    /// decision.
    pub(super) fn resumes_unanswered(&self) -> bool {
        self.resumed && self.awaits_response_headers()
    }

    /// Upstream has not answered yet.
    pub(in crate::call) fn awaits_response_headers(&self) -> bool {
        matches!(self.watch, Watch::AwaitingHeaders)
    }

    /// A completion report is out and the response held.
    pub(in crate::call) fn is_reporting(&self) -> bool {
        matches!(self.watch, Watch::Reporting { .. })
    }

    /// `on_log` needs Envoy's attempt count and response flags: the outcome is not settled.
    pub(in crate::call) fn needs_log_props(&self) -> bool {
        !matches!(self.watch, Watch::Settled | Watch::Reporting { .. })
    }

    /// The root's batch carrying this call's report is done.
    pub(in crate::call) fn on_completion_settled(&mut self) {
        if self.is_reporting() {
            self.watch = Watch::Settled;
        }
    }

    /// The host refused a request edit. A call that has not left is reported never sent; a
    /// resuming GET says nothing about its call.
    pub(in crate::call) fn on_rewrite_failed(&self, config: &Config) -> Step {
        if !self.resumed && self.awaits_response_headers() {
            deny_step(config, &rewrite_refused(), &self.id, &self.tool)
                .with(Effect::Enqueue(self.grant.report(Outcome::Released {
                    reason: "never_sent: request_rewrite_failed".into(),
                })))
                .with(Effect::Count(Stat::Released))
                .with(rewrite_failed_log(&format!(
                    "of attempt {} (round {}) of `{}`; reported never sent",
                    self.grant.attempt_id, self.grant.round, self.tool
                )))
        } else {
            deny_step(config, &rewrite_refused(), &self.id, &self.tool).with(rewrite_failed_log(
                &format!(
                    "resuming the stream of attempt {} of `{}`",
                    self.grant.attempt_id, self.tool
                ),
            ))
        }
    }

    /// The upstream's response headers: how its body is watched for the answer, and the
    /// permit's figures as headers.
    pub(in crate::call) fn on_response_headers(
        &mut self,
        config: &Config,
        head: ResponseHead,
    ) -> Step {
        if !self.awaits_response_headers() {
            return Step::cont();
        }
        if let Some(refusal) = head.tool_refusal {
            // The verifier's refusal passes to the client as it is; the ledger decides from
            // its proof what the attempt becomes.
            self.watch = Watch::RefusedAtTool(refusal);
            return Step::cont();
        }
        // JSON or SSE: the answer to find (and edit) is in the body.
        let kind = head.body_kind();
        let max = usize_of(config.max_receipt_bytes);
        self.watch = match kind {
            Some(true) => Watch::BufferingJson { size: 0 },
            Some(false) => Watch::StreamingSse(Box::new(SseCapture::new(self.id.clone(), max))),
            None => Watch::NoReceipt(NoReceipt::NotJsonRpc),
        };
        let mut step = Step::cont();
        if let Some(limits) = &self.limits {
            for (name, value) in permit_meta::headers(limits) {
                step = step.with(Effect::SetResponseHeader(name.into(), value));
            }
            if kind.is_some() {
                // The body will grow by the figures: its length is Envoy's to frame.
                self.edit_body = true;
                step = step.with(Effect::RemoveResponseHeader("content-length".into()));
            }
        }
        step
    }

    /// The host refused a response edit: the body is no longer edited, nor held back.
    pub(in crate::call) fn on_response_edit_refused(&mut self) {
        self.edit_body = false;
        if let Watch::StreamingSse(cap) = &mut self.watch {
            cap.stop_holding();
        }
    }

    /// Part of the response body arrived (`size` bytes so far): JSON is read once whole
    /// (up to `max` bytes), each SSE chunk as it comes.
    pub(in crate::call) fn on_response_body(
        &mut self,
        max: u64,
        size: usize,
        end_of_stream: bool,
    ) -> BodyStep {
        match &mut self.watch {
            Watch::BufferingJson { size: seen } => {
                if size as u64 > max {
                    self.watch = Watch::NoReceipt(NoReceipt::TooLarge);
                    BodyStep::Done(receipt_too_large(&self.grant.attempt_id))
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

    /// Trailers end the stream: a watched body is read as at its end. An SSE stream reads
    /// what Envoy still keeps of it (see `SseCapture::pass`), which goes on before them.
    pub(in crate::call) fn on_response_trailers(&self) -> BodyStep {
        match &self.watch {
            Watch::BufferingJson { size } => BodyStep::Read { len: *size },
            Watch::StreamingSse(cap) => BodyStep::Read { len: cap.held() },
            Watch::Reporting { .. } => BodyStep::Done(Step::pause()),
            _ => BodyStep::Done(Step::cont()),
        }
    }

    /// Response bytes after [`BodyStep::Read`]: the whole buffered JSON body, or one SSE
    /// chunk. Once the answer is found, its report goes out (or to the root's batch).
    pub(in crate::call) fn on_response_body_data(
        &mut self,
        cx: &mut Context,
        bytes: &[u8],
        end_of_stream: bool,
    ) -> Step {
        // The figures go into the answer's body; an SSE stream is held by Envoy while it
        // ends inside an event, so the answer's event is whole when found (see
        // `SseCapture::pass`).
        let limits = self.limits.as_ref().filter(|_| self.edit_body);
        let (found, body) = match &mut self.watch {
            Watch::BufferingJson { .. } => match receipt::from_json_body(bytes, &self.id) {
                Some(r) => {
                    let edits = limits
                        .map(|l| permit_meta::response_edits(bytes, &self.id, l))
                        .unwrap_or_default();
                    (r, TextAt::Whole.edited(bytes, &edits))
                }
                None => {
                    self.watch = Watch::NoReceipt(NoReceipt::NoMatchingResponse);
                    return Step::cont();
                }
            },
            Watch::StreamingSse(cap) => {
                let passed = match limits {
                    Some(_) => cap.pass(bytes, end_of_stream),
                    None => Passed {
                        progress: cap.feed(bytes),
                        hold: false,
                        found: None,
                    },
                };
                let mut body = None;
                if let (Some(l), Some((event, base))) = (limits, passed.found) {
                    let at = TextAt::Event(event, base);
                    let edits = permit_meta::response_edits(at.text(&[]), &self.id, l);
                    body = at.edited(bytes, &edits);
                }
                match passed.progress {
                    SseProgress::Found(r) => (r, body),
                    SseProgress::TooLarge => {
                        self.watch = Watch::NoReceipt(NoReceipt::TooLarge);
                        return receipt_too_large(&self.grant.attempt_id);
                    }
                    SseProgress::Pending if passed.hold => return Step::pause(),
                    SseProgress::Pending => {
                        if !end_of_stream {
                            return Step::cont();
                        }
                        // Ended without the answer. With event ids the client may resume the
                        // stream (GET + Last-Event-ID) and get the answer there.
                        let Some(last) = cap.last_event_id().map(str::to_string) else {
                            self.watch = Watch::NoReceipt(NoReceipt::NoMatchingResponse);
                            return Step::cont();
                        };
                        self.watch = Watch::NoReceipt(NoReceipt::StreamClosedResumable);
                        let key = resume::key(self.session_id.as_deref(), &last);
                        return Step::cont().with(Effect::SaveResume(
                            key,
                            Ticket {
                                grant: self.grant.clone(),
                                id: self.id.clone(),
                                tool: self.tool.clone(),
                                permit_hash: self.permit.hash(),
                                path: self.path.clone(),
                                limits: self.limits.clone(),
                            },
                        ));
                    }
                }
            }
            _ => return Step::cont(),
        };
        let resumed_stat = self.resumed.then_some(Effect::Count(Stat::ResumedReceipt));
        let receipt = found.text;
        let (outcome, stat) = match found.kind {
            ResultKind::Final => (Outcome::Completed { receipt }, Stat::Completed),
            ResultKind::InputRequired => (Outcome::InputRequired { receipt }, Stat::InputRequired),
            ResultKind::Task => (Outcome::Accepted { receipt }, Stat::Accepted),
        };
        let report = self.grant.report(outcome.clone());
        // The answer as the client gets it (the receipt stays the upstream's own text).
        let mut effects: Vec<Effect> = body
            .map(|body| Effect::ReplaceResponseBody {
                original_len: bytes.len(),
                body,
            })
            .into_iter()
            .collect();
        effects.push(Effect::Count(stat));
        effects.extend(resumed_stat);
        if released_unwaited(cx.config.answer_release, &outcome) {
            // The root's batch owns the report from here; nothing is held for it.
            self.watch = Watch::Settled;
            effects.push(Effect::CompleteUnwaited(report));
            return Step {
                flow: Flow::Continue,
                effects,
                callout: None,
            };
        }
        self.watch = Watch::Reporting { outcome };
        match cx.config.completion_reports {
            CompletionReports::Batched => {
                cx.in_completion_batch = true;
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

    /// The ledger's answer to the completion report: the held response goes on.
    pub(in crate::call) fn on_report_reply(&mut self, reply: &LedgerReply) -> Step {
        match std::mem::replace(&mut self.watch, Watch::Settled) {
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
                                    self.grant.attempt_id
                                ),
                            ));
                        }
                        None => {}
                    },
                    Err(e) => {
                        step = step
                            .with(Effect::Enqueue(self.grant.report(outcome)))
                            .with(Effect::Count(Stat::ReportDeferred))
                            .with(Effect::Log(
                                Level::Warn,
                                format!(
                                    "atmost: completed report of attempt {} failed ({e}); queued",
                                    self.grant.attempt_id
                                ),
                            ));
                    }
                }
                step.with(Effect::ResumeResponse)
            }
            other => {
                self.watch = other;
                Step::cont()
            }
        }
    }

    /// The completion report could not be dispatched: it is queued.
    pub(in crate::call) fn on_callout_failed(&mut self) -> Step {
        match std::mem::replace(&mut self.watch, Watch::Settled) {
            Watch::Reporting { outcome } => Step::cont()
                .with(Effect::Enqueue(self.grant.report(outcome)))
                .with(Effect::Count(Stat::ReportDeferred))
                .with(Effect::Log(
                    Level::Warn,
                    format!(
                        "atmost: could not dispatch the completed report of attempt {}; queued",
                        self.grant.attempt_id
                    ),
                )),
            other => {
                self.watch = other;
                Step::cont()
            }
        }
    }

    /// The request is over without an acknowledged report: what the attempt became is
    /// queued for the ledger, unless it stays in flight for a resumed stream.
    pub(in crate::call) fn on_log(self, props: LogProps) -> Step {
        let (reported, why) = match self.watch {
            Watch::Settled => return Step::cont(),
            Watch::RefusedAtTool(refusal) => (
                Some(outcome::refused_at_tool(refusal, props.attempts)),
                NoReceipt::NoResponse,
            ),
            Watch::Reporting { outcome } => (Some(outcome), NoReceipt::NoResponse),
            Watch::NoReceipt(r) => (None, r),
            Watch::AwaitingHeaders | Watch::BufferingJson { .. } | Watch::StreamingSse(_) => {
                (None, NoReceipt::NoResponse)
            }
        };
        let outcome = match reported {
            Some(o) => o,
            None if self.resumed => {
                // The call went out with an earlier POST; this stream failing or
                // ending says nothing new about it. The lease decides.
                return Step::cont().with(Effect::Log(
                    Level::Info,
                    format!(
                        "atmost: resumed stream of attempt {} ended without its answer; it stays in flight",
                        self.grant.attempt_id
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
                            self.grant.attempt_id, self.tool
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
            Outcome::RefusedAtTool { refusal, .. } => (
                Stat::RefusedAtTool,
                format!("refused at the tool ({refusal})"),
            ),
        };
        Step::cont()
            .with(Effect::Enqueue(self.grant.report(outcome)))
            .with(Effect::Count(stat))
            .with(Effect::Log(
                Level::Info,
                format!(
                    "atmost: attempt {} of `{}` is {text}",
                    self.grant.attempt_id, self.tool
                ),
            ))
    }
}

/// Whether the answer carrying `outcome` goes on before the ledger has its report
/// (`answer_release: at_once`; docs/design.md#releasing-the-answer-before-its-report).
/// `input_required` always waits: its continuation is the client's very next request, and
/// the ledger dispatches it only once the attempt is `awaiting_input`.
fn released_unwaited(release: AnswerRelease, outcome: &Outcome) -> bool {
    release == AnswerRelease::AtOnce
        && matches!(
            outcome,
            Outcome::Completed { .. } | Outcome::Accepted { .. }
        )
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
