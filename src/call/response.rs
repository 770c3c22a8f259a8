//! The response of a dispatched call: watching it for the receipt, reporting it, and what
//! `on_log` concludes when the request ends without an acknowledged report.

use super::*;

impl Call {
    pub fn on_response_headers(&mut self, head: ResponseHead) -> Step {
        if self.awaits_decision() {
            return self.on_response_before_decision();
        }
        let max = usize_of(self.config.max_receipt_bytes);
        // JSON or SSE: the answer to find (and edit) is in the body.
        let kind = match head.end_of_stream {
            true => None,
            false => content_kind(head.content_type.as_deref()),
        };
        let content_length = || Effect::RemoveResponseHeader("content-length".into());
        match &mut self.state {
            State::Dispatched(d) if matches!(d.watch, Watch::AwaitingHeaders) => {
                if let Some(refusal) = head.tool_refusal {
                    // The verifier's refusal passes to the client as it is; the ledger
                    // decides from its proof what the attempt becomes.
                    d.watch = Watch::RefusedAtTool(refusal);
                    return Step::cont();
                }
                d.watch = match kind {
                    Some(true) => Watch::BufferingJson { size: 0 },
                    Some(false) => {
                        Watch::StreamingSse(Box::new(SseCapture::new(d.id.clone(), max)))
                    }
                    None => Watch::NoReceipt(NoReceipt::NotJsonRpc),
                };
                let mut step = Step::cont();
                if let Some(limits) = &d.limits {
                    for (name, value) in permit_meta::headers(limits) {
                        step = step.with(Effect::SetResponseHeader(name.into(), value));
                    }
                    if kind.is_some() {
                        // The body will grow by the figures: its length is Envoy's to frame.
                        d.edit_body = true;
                        step = step.with(content_length());
                    }
                }
                step
            }
            State::Listing(l) if matches!(l.watch, ListWatch::AwaitingHeaders) => {
                l.watch = match kind {
                    Some(true) => ListWatch::BufferingJson { size: 0 },
                    Some(false) => {
                        ListWatch::StreamingSse(Box::new(SseCapture::new(l.id.clone(), max)))
                    }
                    None => ListWatch::Done,
                };
                Step::cont().with_all(kind.map(|_| content_length()))
            }
            _ => Step::cont(),
        }
    }

    /// The host refused a response edit (a header, or the body): the answer goes out as the
    /// upstream sent it, without the figures in its body, and nothing more is edited (an
    /// SSE stream holds nothing back any longer).
    pub fn on_response_edit_refused(&mut self) -> Step {
        let stop = |cap: &mut SseCapture| cap.stop_holding();
        match &mut self.state {
            State::Dispatched(d) => {
                d.edit_body = false;
                if let Watch::StreamingSse(cap) = &mut d.watch {
                    stop(cap);
                }
            }
            State::Listing(l) => {
                if let ListWatch::StreamingSse(cap) = &mut l.watch {
                    stop(cap);
                }
                if !matches!(l.watch, ListWatch::Asking(_)) {
                    l.watch = ListWatch::Done;
                }
            }
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
        let max = self.config.max_receipt_bytes;
        if let State::Listing(l) = &mut self.state {
            return match &mut l.watch {
                ListWatch::BufferingJson { size: seen } => {
                    if size as u64 > max {
                        l.watch = ListWatch::Done;
                        BodyStep::Done(Step::cont())
                    } else if end_of_stream {
                        BodyStep::Read { len: size }
                    } else {
                        *seen = size;
                        BodyStep::Done(Step::pause())
                    }
                }
                ListWatch::StreamingSse(_) => BodyStep::Read { len: size },
                ListWatch::Asking(_) => BodyStep::Done(Step::pause()),
                ListWatch::AwaitingHeaders | ListWatch::Done => BodyStep::Done(Step::cont()),
            };
        }
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
        if self.holds_early_response() {
            return BodyStep::Done(Step::pause());
        }
        // Trailers end the stream: a watched body is read as at its end. An SSE stream reads
        // what Envoy still keeps of it (see `SseCapture::pass`), which goes on before them.
        match &self.state {
            State::Dispatched(d) => match &d.watch {
                Watch::BufferingJson { size } => BodyStep::Read { len: *size },
                Watch::StreamingSse(cap) => BodyStep::Read { len: cap.held() },
                Watch::Reporting { .. } => BodyStep::Done(Step::pause()),
                _ => BodyStep::Done(Step::cont()),
            },
            State::Listing(l) => match &l.watch {
                ListWatch::BufferingJson { size } => BodyStep::Read { len: *size },
                ListWatch::StreamingSse(cap) => BodyStep::Read { len: cap.held() },
                ListWatch::Asking(_) => BodyStep::Done(Step::pause()),
                _ => BodyStep::Done(Step::cont()),
            },
            _ => BodyStep::Done(Step::cont()),
        }
    }

    /// Response bytes after [`BodyStep::Read`]: the whole buffered JSON body, or one SSE chunk.
    pub fn on_response_body_data(&mut self, bytes: &[u8], end_of_stream: bool) -> Step {
        if matches!(self.state, State::Listing(_)) {
            return self.on_list_body_data(bytes, end_of_stream);
        }
        let State::Dispatched(d) = &mut self.state else {
            return Step::cont();
        };
        // The figures go into the answer's body; an SSE stream is held by Envoy while it
        // ends inside an event, so the answer's event is whole when found (see
        // `SseCapture::pass`).
        let limits = d.limits.as_ref().filter(|_| d.edit_body);
        let (found, body) = match &mut d.watch {
            Watch::BufferingJson { .. } => match receipt::from_json_body(bytes, &d.id) {
                Some(r) => {
                    let edits = limits
                        .map(|l| permit_meta::response_edits(bytes, &d.id, l))
                        .unwrap_or_default();
                    (r, TextAt::Whole.edited(bytes, &edits))
                }
                None => {
                    d.watch = Watch::NoReceipt(NoReceipt::NoMatchingResponse);
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
                    let edits = permit_meta::response_edits(at.text(&[]), &d.id, l);
                    body = at.edited(bytes, &edits);
                }
                match passed.progress {
                    SseProgress::Found(r) => (r, body),
                    SseProgress::TooLarge => {
                        d.watch = Watch::NoReceipt(NoReceipt::TooLarge);
                        return receipt_too_large(&d.grant.attempt_id);
                    }
                    SseProgress::Pending if passed.hold => return Step::pause(),
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
                                permit_hash: d.permit.hash(),
                                path: d.path.clone(),
                                limits: d.limits.clone(),
                            },
                        ));
                    }
                }
            }
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
        if released_unwaited(self.config.answer_release, &outcome) {
            // The root's batch owns the report from here; nothing is held for it.
            d.watch = Watch::Settled;
            effects.push(Effect::CompleteUnwaited(report));
            return Step {
                flow: Flow::Continue,
                effects,
                callout: None,
            };
        }
        d.watch = Watch::Reporting { outcome };
        match self.config.completion_reports {
            CompletionReports::Batched => {
                self.in_completion_batch = true;
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

    /// The answer of a `tools/list` (`tools_list_limits`): once found, the governed tools it
    /// lists are asked about in ONE limits callout, the answer held until the ledger answers.
    fn on_list_body_data(&mut self, bytes: &[u8], end_of_stream: bool) -> Step {
        let config = Rc::clone(&self.config);
        let State::Listing(l) = &mut self.state else {
            return Step::cont();
        };
        let (body, at) = match &mut l.watch {
            ListWatch::BufferingJson { .. } => {
                // Only a body that is JSON is edited.
                if serde_json::from_slice::<Value>(bytes).is_err() {
                    l.watch = ListWatch::Done;
                    return Step::cont();
                }
                (bytes.to_vec(), TextAt::Whole)
            }
            ListWatch::StreamingSse(cap) => {
                let passed = cap.pass(bytes, end_of_stream);
                match (passed.progress, passed.found) {
                    (SseProgress::Found(_), Some((event, base))) => {
                        (bytes.to_vec(), TextAt::Event(event, base))
                    }
                    (SseProgress::Pending, _) if passed.hold => return Step::pause(),
                    (SseProgress::Pending, _) if !end_of_stream => return Step::cont(),
                    _ => {
                        l.watch = ListWatch::Done;
                        return Step::cont();
                    }
                }
            }
            _ => return Step::cont(),
        };
        let mut tools =
            permit_meta::listed_tools(at.text(&body), &l.id, |t| config.governed_tools.contains(t));
        tools.truncate(MAX_LIMITS_TOOLS);
        if tools.is_empty() {
            l.watch = ListWatch::Done;
            return Step::cont();
        }
        let callout = Callout::limits(&LimitsRequest {
            permit_token: l.permit_token.clone(),
            tools,
        });
        l.watch = ListWatch::Asking(Box::new((body, at)));
        Step {
            flow: Flow::Pause,
            effects: Vec::new(),
            callout: Some(callout),
        }
    }

    /// The ledger's answer to the limits callout of a `tools/list`: the held answer gains
    /// the figures of each governed tool it lists, or goes on unchanged.
    pub(super) fn on_limits_reply(&mut self, reply: &LedgerReply) -> Step {
        let State::Listing(l) = &mut self.state else {
            return Step::cont();
        };
        let ListWatch::Asking(held) = std::mem::replace(&mut l.watch, ListWatch::Done) else {
            return Step::cont();
        };
        let (body, at) = *held;
        let step = match reply.limits() {
            Ok(LimitsResponse { tools }) => {
                let edits = permit_meta::tools_list_edits(at.text(&body), &l.id, &tools);
                let edited = at
                    .edited(&body, &edits)
                    .map(|new| Effect::ReplaceResponseBody {
                        original_len: body.len(),
                        body: new,
                    });
                Step::cont()
                    .with_all(edited)
                    .with(Effect::Count(Stat::ToolsListFigures))
            }
            // The ledger does not authenticate the permit: nothing to show.
            Err(e) if e.is_permit_invalid() => unchanged(Level::Info, "permit_invalid"),
            Err(e) => unchanged(Level::Warn, &e.to_string()),
        };
        step.with(Effect::ResumeResponse)
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
        self.in_completion_batch = false;
        if let State::Dispatched(d) = &mut self.state {
            if matches!(d.watch, Watch::Reporting { .. }) {
                d.watch = Watch::Settled;
            }
        }
    }

    /// `completion_reports: batched`, before each response callback and `on_log`: while this
    /// call's report is in the root's batch, asks the root whether it is still `waiting`
    /// there ([`crate::report::Reporter::is_waiting`]); once it is not, the batch is done
    /// ([`Call::on_completion_settled`]). The root is asked nothing otherwise.
    pub fn check_completion_batch(&mut self, waiting: impl FnOnce() -> bool) {
        if self.in_completion_batch && !waiting() {
            self.on_completion_settled();
        }
    }

    /// Whether `on_log` needs Envoy's attempt count and response flags: only for a
    /// dispatched call whose outcome is not settled yet.
    pub fn needs_log_props(&self) -> bool {
        matches!(&self.state, State::Dispatched(d) if !matches!(d.watch, Watch::Settled | Watch::Reporting { .. }))
    }

    /// Whether the response headers matter (a dispatched call, or a `tools/list` whose
    /// answer may gain the figures, waiting for them): only then does the adapter look up
    /// `content-type`.
    pub fn watches_response_headers(&self) -> bool {
        match &self.state {
            State::Dispatched(d) => matches!(d.watch, Watch::AwaitingHeaders),
            State::Listing(l) => matches!(l.watch, ListWatch::AwaitingHeaders),
            _ => self.awaits_decision(),
        }
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
                    Watch::RefusedAtTool(refusal) => {
                        (Some(outcome::refused_at_tool(refusal, props.attempts)), NoReceipt::NoResponse)
                    }
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
                    Outcome::RefusedAtTool { refusal, .. } => {
                        (Stat::RefusedAtTool, format!("refused at the tool ({refusal})"))
                    }
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

/// A `tools/list` answer goes on without figures, for `why`.
pub(super) fn unchanged(level: Level, why: &str) -> Step {
    Step::cont()
        .with(Effect::Count(Stat::ToolsListUnchanged))
        .with(Effect::Log(
            level,
            format!("atmost: tools/list answer passes without the permit's figures: {why}"),
        ))
}

fn receipt_too_large(attempt_id: &str) -> Step {
    Step::cont()
        .with(Effect::Count(Stat::ReceiptTooLarge))
        .with(Effect::Log(
            Level::Warn,
            format!("atmost: response of attempt {attempt_id} exceeds max_receipt_bytes; it will be reported uncertain (receipt_too_large)"),
        ))
}
