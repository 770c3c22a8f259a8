//! The ledger's answers to the machine's callouts: the authorize decision, and the
//! acknowledgement of a completion report.

use super::*;
use atmost_protocol::signature::DispatchNonce;

impl Call {
    /// The callout of the last step could not even be dispatched.
    pub fn on_callout_failed(&mut self) -> Step {
        if let Some(step) = self.on_session_credential_failed() {
            return step;
        }
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
        if let Some(step) = self.on_session_credential_reply(reply) {
            return step;
        }
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
            Err(CalloutError::UnreadableDispatch(grant)) => {
                not_sent(&cfg, &p, &grant, NotSent::Unreadable)
            }
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
                signature,
                credential,
                ..
            }) => {
                let grant = DispatchGrant {
                    attempt_id,
                    round,
                    capability,
                };
                let upstream = match &p.upstream {
                    Some(u) if u.permit_id == permit_id => u,
                    _ => return not_sent(&cfg, &p, &grant, NotSent::OtherPermit),
                };
                let mut signature_headers = None;
                if let Some(signing) = &upstream.signing {
                    let nonce = DispatchNonce {
                        attempt_id: grant.attempt_id.clone(),
                        round,
                        permit_id,
                        tool: p.tool.clone(),
                    };
                    if let Err(why) = signing.check(signature.as_ref(), &nonce) {
                        return not_sent(&cfg, &p, &grant, NotSent::Unsigned(why));
                    }
                    signature_headers = signature.as_ref().map(|s| signing.headers(s));
                }
                let credential_edits = match &credential {
                    Some(c) => match credential::edits(c, p.route.as_deref(), self.ahead.is_none())
                    {
                        Ok(edits) => edits,
                        Err(why) => return not_sent(&cfg, &p, &grant, NotSent::Credential(why)),
                    },
                    None => Vec::new(),
                };
                // Every edit comes before the resume, which the adapter skips if one is
                // refused: the body with its key members in upstream form, the key header
                // (with `request_hold: body` none goes upstream: the headers left already),
                // and the ledger's signature.
                let mut step = Step::cont();
                if let Some(body) = upstream.body.clone() {
                    step.effects.extend(body.effects());
                }
                if self.ahead.is_none() {
                    step = step.with(match &upstream.key {
                        Some(v) => Effect::SetRequestHeader(IDEMPOTENCY_HEADER.into(), v.clone()),
                        None => Effect::RemoveRequestHeader(IDEMPOTENCY_HEADER.into()),
                    });
                }
                let step = step
                    .with_all(signature_headers.into_iter().flatten())
                    .with_all(credential_edits)
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

/// Why the filter does not send a call the ledger dispatched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NotSent {
    /// A Dispatch answer whose decision, attempt, round and capability read, and nothing
    /// more.
    Unreadable,
    /// The answer names another permit than the token, whose id the upstream key and the
    /// signed request were derived with. A ledger never answers so: it accepts a token only
    /// for the permit it names.
    OtherPermit,
    /// `request_hold: headers`: the answer carries no signature the filter can send.
    Unsigned(signing::Unusable),
    /// The answer's credential cannot go on the call ([`credential::Unsendable`]).
    Credential(credential::Unsendable),
}

/// A dispatched call the filter does not send: denied `gateway_unavailable`, and its round
/// reported never sent, so round 1 gives its slot back.
fn not_sent(config: &Config, p: &Pending, grant: &DispatchGrant, why: NotSent) -> Step {
    let (reason, message, detail) = match why {
        NotSent::Unreadable => (
            "dispatch_unreadable",
            "the atmost ledger's answer could not be read; the call was not sent",
            "an answer it could not read".to_string(),
        ),
        NotSent::OtherPermit => (
            "dispatch_permit_mismatch",
            "the atmost ledger dispatched the call under another permit than the token names; it was not sent",
            "another permit than the token names".to_string(),
        ),
        NotSent::Unsigned(unusable) => (
            "dispatch_unsigned",
            "the atmost ledger's dispatch carried no usable signature; the call was not sent",
            unusable.as_str().to_string(),
        ),
        NotSent::Credential(why) => (
            why.as_str(),
            "the tool's credential could not be set on the call; it was not sent",
            format!("a credential it could not set ({})", why.as_str()),
        ),
    };
    let denial = Denial::new(DenialCode::GatewayUnavailable, message);
    let step = deny_step(config, &denial, &p.id, &p.tool)
        .with(Effect::Enqueue(grant.report(Outcome::Released {
            reason: format!("never_sent: {reason}"),
        })))
        .with(Effect::Count(Stat::Released));
    let step = match why {
        NotSent::Unsigned(_) => step.with(Effect::Count(Stat::DispatchUnsigned)),
        _ => step,
    };
    step.with(Effect::Log(
        Level::Error,
        format!(
            "atmost: the ledger dispatched attempt {} (round {}) of `{}` with {detail}; not sent, reported never sent",
            grant.attempt_id, grant.round, p.tool
        ),
    ))
}
