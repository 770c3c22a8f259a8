//! The ledger's answers to the machine's callouts: the authorize decision, and the
//! acknowledgement of a completion report.

use super::*;

impl Call {
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
            State::Listing(l) => {
                if matches!(l.watch, ListWatch::Asking(_)) {
                    l.watch = ListWatch::Done;
                    // Still in the body callback: going on releases the held answer.
                    return response::unchanged(
                        Level::Warn,
                        "could not dispatch the limits callout",
                    );
                }
                Step::cont()
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
        if matches!(self.state, State::Listing(_)) {
            return self.on_limits_reply(reply);
        }
        match std::mem::replace(&mut self.state, State::Answered) {
            State::Authorizing(p) if self.answered_early() => self.after_early_answer(&p, reply),
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
                limits,
            }) => match replay::render(&receipt, &p.id, limits.as_ref()) {
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
                limits,
                ..
            }) => {
                let grant = DispatchGrant {
                    attempt_id,
                    round,
                    capability,
                };
                if !self.key_header_fits(&permit_id) {
                    return key_header_misfit(&cfg, &p, &grant);
                }
                let upstream_value = match p.forwarded {
                    Some(f) if f.permit_id == permit_id => f.value,
                    _ => upstream_key::upstream_value(
                        &cfg.upstream_key,
                        &permit_id,
                        p.key.as_deref(),
                    ),
                };
                // `request_hold: body`: the header left with the request's headers already.
                let key_effect = match &upstream_value {
                    _ if self.ahead.is_some() => None,
                    Some(v) => Some(Effect::SetRequestHeader(
                        IDEMPOTENCY_HEADER.into(),
                        v.clone(),
                    )),
                    None => Some(Effect::RemoveRequestHeader(IDEMPOTENCY_HEADER.into())),
                };
                // The body copies of the key get the same treatment as the header. Every edit
                // comes before the resume, which the adapter skips if one is refused.
                let mut step = Step::cont();
                if let Some(edit) = p.body_key_rewrite {
                    step.effects.extend(body_edit(
                        &edit.body,
                        &edit.spans,
                        edit.had_content_length,
                        |_| upstream_value.clone(),
                    ));
                }
                let step = step
                    .with_all(key_effect)
                    .with(Effect::Count(Stat::Dispatched))
                    .with(Effect::Log(
                        Level::Info,
                        format!(
                            "atmost: dispatching attempt {} (round {}) of `{}`",
                            grant.attempt_id, grant.round, p.tool
                        ),
                    ))
                    .with(Effect::ResumeRequest);
                self.state = State::Dispatched(Box::new(Dispatched {
                    grant,
                    permit: p.permit,
                    path: p.path,
                    id: p.id,
                    tool: p.tool,
                    watch: Watch::AwaitingHeaders,
                    session_id: p.session_id,
                    resumed: false,
                    limits,
                    edit_body: false,
                }));
                step
            }
        }
    }
}
