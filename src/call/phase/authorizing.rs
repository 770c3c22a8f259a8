//! `Authorizing`: a governed `tools/call` waits for the ledger's decision. The authorize
//! request states what goes upstream if the ledger dispatches ([`Upstream`]); the decision
//! sends it with its edits, answers with a denial or a replay, or, for a dispatch the
//! filter cannot send as asked, denies it and reports the round never sent. With
//! `approval_hold_ms`, an `approval_required` answer holds the call open and the ledger is
//! asked again ([`hold`]) until it answers otherwise or the hold's bound is reached.

use super::dispatched::{Dispatched, Watch};
use super::Phase;
use crate::call::refusal::{
    bad_request, deny_step, gateway_unavailable, rewrite_failed_log, rewrite_refused,
};
use crate::call::reply::{rpc_code, LocalReply};
use crate::call::resume::CallPermit;
use crate::call::sent_body::SentBody;
use crate::call::signing::{self, Signing};
use crate::call::{
    credential, permit, replay, upstream_key, Context, Effect, Flow, Level, RequestHead, Step,
    IDEMPOTENCY_HEADER,
};
use crate::ledger_client::{Callout, CalloutError, Endpoint, LedgerReply};
use crate::parse::fingerprint::fingerprint;
use crate::parse::mcp::ToolCall;
use crate::parse::{idempotency, key_rewrite};
use crate::stats::Stat;
use atmost_config::{Config, RequestHold, UpstreamKey};
use atmost_protocol::idempotency_key::IdempotencyKey;
use atmost_protocol::signature::DispatchNonce;
use atmost_protocol::{
    AuthorizeRequest, AuthorizeResponse, Denial, DenialCode, DispatchGrant, Outcome, PermitLimits,
};
use hold::Held;
use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
pub(in crate::call) struct Authorizing {
    id: Value,
    /// The tool called.
    pub(in crate::call) tool: String,
    permit: CallPermit,
    path: String,
    key: Option<String>,
    session_id: Option<String>,
    /// The Envoy route the request was given (`xds.route_name`), which a credential must
    /// belong to ([`credential`]).
    route: Option<String>,
    /// What goes upstream if the ledger dispatches; `None` when the token names no permit
    /// (the ledger authenticates no such token, and nothing could be derived for it).
    pub(in crate::call) upstream: Option<Box<Upstream>>,
    /// `approval_hold_ms` above 0: the authorize request, kept to be sent again as it was
    /// (same key, same arguments) while the call is held.
    request: Option<Vec<u8>>,
    /// Held for a person's approval ([`hold`]).
    held: Option<Held>,
}

/// What the filter sends upstream if the ledger dispatches the call, fixed before it asks
/// and derived with the permit id the token names, which the Dispatch answer must name too.
/// The authorize request states it (`forwarded_key`, and with `request_hold: headers` the
/// `dispatch` the ledger signs), so what leaves is what the ledger was told.
#[derive(Debug, Clone, PartialEq)]
pub(in crate::call) struct Upstream {
    permit_id: String,
    /// The key in its `upstream_key` form: the `Idempotency-Key` value (`None`: no header)
    /// and the value of the body's key members.
    key: Option<String>,
    /// The body with its key members rewritten, when they are (`upstream_key` other than
    /// `raw`).
    body: Option<SentBody>,
    /// `request_hold: headers`: the request the ledger is asked to sign.
    pub(in crate::call) signing: Option<Signing>,
}

impl Authorizing {
    /// The governed `tools/call` `call`, with the request's `head` and whole `body`: ONE
    /// authorize callout, or a denial when nothing can be asked.
    pub(super) fn ask(
        cx: &Context,
        head: &RequestHead,
        call: ToolCall,
        body_bytes: &[u8],
    ) -> (Phase, Step) {
        let permit = permit::token(&head.permit, &cx.config.permit_header);
        let permit_token = match permit {
            Ok(t) => t,
            Err(e) => {
                let d = Denial::new(DenialCode::PermitInvalid, e.to_string());
                return (
                    Phase::Answered,
                    deny_step(&cx.config, &d, &call.id, &call.name),
                );
            }
        };
        let permit = CallPermit::Token(permit_token.clone());
        let key = match idempotency::resolve(&head.idempotency_key, &call.keys) {
            Ok(k) => k.map(IdempotencyKey::into_string),
            Err(d) => {
                return (
                    Phase::Answered,
                    deny_step(&cx.config, &d, &call.id, &call.name),
                )
            }
        };
        let fp = match fingerprint(&call.name, &call.arguments) {
            Ok(fp) => fp,
            Err(_) => {
                let refusal = bad_request(LocalReply::rpc_error(
                    400,
                    Some(&call.id),
                    rpc_code::INVALID_PARAMS,
                    "Invalid params: arguments cannot be canonicalised (RFC 8785)",
                ));
                return (Phase::Answered, refusal);
            }
        };
        let in_body = call.keys.any_present();
        let hold_headers = cx.config.request_hold == RequestHold::Headers;
        // What the upstream will receive if the ledger dispatches: derived with the permit id
        // the token names, which a Dispatch answer must confirm (the ledger accepts a token
        // only for the permit it names).
        let upstream = atmost_protocol::token::permit_id_of(&permit_token).map(|permit_id| {
            let mode = &cx.config.upstream_key;
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
                Signing::new(&line, sent, key.as_deref(), cx.config.signature_validity_s)
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
            reports: Vec::new(),
            permit_token,
            tool: call.name.clone(),
            idempotency_key: key.clone(),
            fingerprint: fp,
            key_required: cx.config.key_required_tools.contains(&call.name),
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
            Err(_) => {
                let denied = deny_step(&cx.config, &gateway_unavailable(), &call.id, &call.name);
                return (Phase::Answered, denied);
            }
        };
        let request = (cx.config.approval_hold_ms > 0).then(|| body.clone());
        let asking = Phase::Authorizing(Authorizing {
            request,
            held: None,
            permit,
            path: head.path.clone(),
            id: call.id,
            tool: call.name,
            key,
            session_id: head.session_id.clone(),
            route: head.route.clone(),
            upstream,
        });
        let step = Step {
            flow: Flow::Pause,
            effects: Vec::new(),
            callout: Some(Callout {
                endpoint: Endpoint::Authorize,
                body,
            }),
        };
        (asking, step)
    }

    /// The ledger's decision. `approval_required` under `approval_hold_ms` holds the call
    /// open until the ledger is asked again ([`Effect::HoldForApproval`]); a dispatch goes on
    /// with its edits, or is not sent and reported never sent; anything else is answered
    /// here.
    pub(in crate::call) fn on_authorize_reply(
        mut self,
        cx: &Context,
        reply: &LedgerReply,
    ) -> (Phase, Step) {
        let answer = reply.authorize();
        let mut ended = None;
        if let Ok(AuthorizeResponse::Deny(d)) = &answer {
            if d.code == DenialCode::ApprovalRequired && self.request.is_some() {
                let now_ms = (cx.clock)();
                let since_ms = self.held.map_or(now_ms, |h| h.since_ms);
                let hold_ms = cx.config.approval_hold_ms;
                match hold::wait_ms(hold_ms, since_ms, now_ms, d) {
                    Some(wait_ms) => {
                        let mut step = Step::pause();
                        if self.held.replace(Held { since_ms }).is_none() {
                            step = step
                                .with(Effect::Count(Stat::ApprovalHeld))
                                .with(Effect::Log(
                                    Level::Info,
                                    format!("atmost: `{}` awaits approval; held open", self.tool),
                                ));
                        }
                        let step = step.with(Effect::HoldForApproval { wait_ms });
                        return (Phase::Authorizing(self), step);
                    }
                    None => ended = Some(Stat::ApprovalHoldTimedOut),
                }
            }
        }
        if self.held.is_some() {
            let stat = match &answer {
                Ok(AuthorizeResponse::Dispatch { .. }) => Stat::ApprovalHoldDispatched,
                _ => ended.unwrap_or(Stat::ApprovalHoldAnswered),
            };
            let (phase, mut step) = self.decide(cx, answer);
            step.effects.insert(0, Effect::Count(stat));
            return (phase, step);
        }
        self.decide(cx, answer)
    }

    /// The ledger's `answer`, given to the agent: a dispatch goes on with its edits, or is
    /// not sent and reported never sent; anything else is answered here.
    fn decide(
        self,
        cx: &Context,
        answer: Result<AuthorizeResponse, CalloutError>,
    ) -> (Phase, Step) {
        let (p, cfg) = (self, &cx.config);
        let step = match answer {
            Err(CalloutError::UnreadableDispatch(grant)) => {
                not_sent(cfg, &p, &grant, NotSent::Unreadable)
            }
            Err(reason) => deny_step(cfg, &gateway_unavailable(), &p.id, &p.tool).with(
                Effect::Log(Level::Warn, format!("atmost: authorize failed: {reason}")),
            ),
            Ok(AuthorizeResponse::Deny(d)) => deny_step(cfg, &d, &p.id, &p.tool),
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
                Err(_) => deny_step(cfg, &gateway_unavailable(), &p.id, &p.tool).with(Effect::Log(
                    Level::Error,
                    format!(
                        "atmost: stored receipt of attempt {attempt_id} is not a JSON-RPC response"
                    ),
                )),
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
                    _ => {
                        return (
                            Phase::Answered,
                            not_sent(cfg, &p, &grant, NotSent::OtherPermit),
                        )
                    }
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
                        return (
                            Phase::Answered,
                            not_sent(cfg, &p, &grant, NotSent::Unsigned(why)),
                        );
                    }
                    signature_headers = signature.as_ref().map(|s| signing.headers(s));
                }
                let credential_edits = match &credential {
                    Some(c) => match credential::edits(c, p.route.as_deref(), cx.ahead.is_none()) {
                        Ok(edits) => edits,
                        Err(why) => {
                            return (
                                Phase::Answered,
                                not_sent(cfg, &p, &grant, NotSent::Credential(why)),
                            )
                        }
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
                if cx.ahead.is_none() {
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
                let dispatched = p.into_dispatched(grant, limits);
                return (Phase::Dispatched(Box::new(dispatched)), step);
            }
        };
        (Phase::Answered, step)
    }

    /// `request_hold: body`: the upstream answered before the decision, so the body will
    /// never be sent; the answer waits for the ledger, whose dispatch is then released.
    pub(in crate::call) fn on_response_before_decision(&self) -> Step {
        Step::pause()
            .with(Effect::Count(Stat::UpstreamAnsweredEarly))
            .with(Effect::Log(
                Level::Info,
                format!(
                    "atmost: the upstream answered before the ledger decided on `{}`; its body is not sent and the answer waits for the ledger",
                    self.tool
                ),
            ))
    }

    /// The ledger's answer after the upstream answered: nothing is sent (the request is
    /// `Overtaken`). A dispatch is released at once; the upstream's answer goes on to the
    /// client, which ends a hold for approval as any other answer does.
    pub(in crate::call) fn after_early_answer(&self, reply: &LedgerReply) -> Step {
        let mut step = self.early_answer_step(reply);
        if self.held.is_some() {
            step.effects
                .insert(0, Effect::Count(Stat::ApprovalHoldAnswered));
        }
        step
    }

    fn early_answer_step(&self, reply: &LedgerReply) -> Step {
        let grant = match reply.authorize() {
            Ok(AuthorizeResponse::Dispatch {
                attempt_id,
                round,
                capability,
                ..
            }) => Ok(DispatchGrant {
                attempt_id,
                round,
                capability,
            }),
            Err(CalloutError::UnreadableDispatch(grant)) => Ok(*grant),
            Ok(AuthorizeResponse::Deny(d)) => Err(format!("denied it ({})", d.code)),
            Ok(AuthorizeResponse::Replay { attempt_id, .. }) => {
                Err(format!("had a receipt (attempt {attempt_id})"))
            }
            Err(reason) => Err(format!("could not be asked ({reason})")),
        };
        let what = match grant {
            Ok(grant) => {
                return Step::cont()
                    .with(Effect::Enqueue(grant.report(Outcome::Released {
                        reason: "never_sent: upstream_answered_first".into(),
                    })))
                    .with(Effect::Count(Stat::Released))
                    .with(Effect::Log(
                        Level::Info,
                        format!(
                            "atmost: attempt {} (round {}) of `{}` released: the upstream answered before its body was sent",
                            grant.attempt_id, grant.round, self.tool
                        ),
                    ))
                    .with(Effect::ResumeResponse);
            }
            Err(what) => what,
        };
        Step::cont()
            .with(Effect::Log(
                Level::Info,
                format!(
                    "atmost: the ledger {what} after the upstream had answered for `{}`; nothing was sent, the upstream's answer goes to the client",
                    self.tool
                ),
            ))
            .with(Effect::ResumeResponse)
    }

    /// This call as the ledger dispatched it with `grant`, the permit's figures `limits`.
    fn into_dispatched(self, grant: DispatchGrant, limits: Option<PermitLimits>) -> Dispatched {
        Dispatched {
            grant,
            permit: self.permit,
            path: self.path,
            id: self.id,
            tool: self.tool,
            watch: Watch::AwaitingHeaders,
            session_id: self.session_id,
            resumed: false,
            limits,
            edit_body: false,
        }
    }

    /// The host refused an edit before the request went on: nothing left, the call is
    /// denied.
    pub(in crate::call) fn on_rewrite_failed(self, config: &Config) -> Step {
        deny_step(config, &rewrite_refused(), &self.id, &self.tool)
            .with(rewrite_failed_log(&format!("for `{}`", self.tool)))
    }

    /// Held for a person's approval ([`hold`]).
    pub(in crate::call) fn is_held(&self) -> bool {
        self.held.is_some()
    }

    /// The authorize request to send again, the same bytes as the first, while the call is
    /// held.
    pub(in crate::call) fn reask(&self) -> Option<Callout> {
        self.held?;
        self.request.clone().map(|body| Callout {
            endpoint: Endpoint::Authorize,
            body,
        })
    }

    /// The authorize callout could not be dispatched: the call is denied.
    pub(in crate::call) fn on_callout_failed(&self, config: &Config) -> Step {
        let mut step = deny_step(config, &gateway_unavailable(), &self.id, &self.tool)
            .with(Effect::Log(
            Level::Warn,
            "atmost: could not dispatch the authorize callout; call denied (gateway_unavailable)"
                .into(),
        ));
        if self.held.is_some() {
            step.effects
                .insert(0, Effect::Count(Stat::ApprovalHoldAnswered));
        }
        step
    }

    /// The request ended before the ledger answered, or while it was held.
    pub(in crate::call) fn on_log(self) -> Step {
        if self.held.is_some() {
            // Nothing was reserved in flight: the attempt waits for its person, or lapses.
            return Step::cont()
                .with(Effect::Count(Stat::ApprovalHoldAbandoned))
                .with(Effect::Log(
                    Level::Info,
                    format!(
                        "atmost: request ended while `{}` was held for approval; the ledger is not asked again",
                        self.tool
                    ),
                ));
        }
        Step::cont().with(Effect::Log(
            Level::Warn,
            format!(
                "atmost: request ended before the ledger answered for `{}`; a reserved attempt turns uncertain when its lease runs out",
                self.tool
            ),
        ))
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
fn not_sent(config: &Config, p: &Authorizing, grant: &DispatchGrant, why: NotSent) -> Step {
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

mod hold;

#[cfg(test)]
mod tests;
