//! The response of a dispatched call: watching it for the receipt, reporting it, and what
//! `on_log` concludes when the request ends without an acknowledged report.

use super::*;

impl Call {
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
                            permit_hash: d.permit.hash(),
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
