//! `request_hold: body`: for deployments whose Envoy cannot hold a request's headers (an
//! Istio WasmPlugin or Envoy Gateway cannot set `allow_on_headers_stop_iteration`).
//!
//! A POST's headers go upstream at once, as a dispatched call would carry them: the permit
//! header removed, `Idempotency-Key` in its upstream form, `content-length` removed so the
//! body can still be rewritten (HTTP/1.1 then frames it chunked). Only the body waits
//! (`Pause`: Envoy's StopIterationAndBuffer) until the decision. A denial, a replay or a
//! refusal is a local reply, which ends the stream: Envoy resets the upstream request before
//! any byte of the body left, so no tool runs.
//!
//! The key header's form is chosen from the headers alone ([`may_be_governed`]):
//! - a POST that may be a governed `tools/call` gets the form of a dispatch: under `hmac`,
//!   derived with the permit id its token spells. That id is a claim until the ledger
//!   answers: a dispatch under another permit is not sent (released), and a message that
//!   turns out to pass without a ledger answer is refused, since its header would carry one
//!   permit's derivation for traffic nobody checked;
//! - a POST whose `Mcp-Method` / `Mcp-Name` say it is not a governed call gets the form of
//!   traffic that passes (empty permit id); the body must then agree (HeaderMismatch).
//!
//! A response before the decision (an upstream that answers early, a connection that fails)
//! means the body is never sent: the call is handled as never sent. Before the authorize
//! callout the response goes on to the client at once (nothing is reserved); while the
//! callout is out it is held until the ledger answered, so a reserved attempt is released
//! now rather than turning uncertain when its lease runs out. The body never follows.

use super::*;
use atmost_config::ToolSet;
use atmost_protocol::token::permit_id_of;
use atmost_protocol::KeyCarriers;

/// What left with a POST's headers under `request_hold: body`.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Ahead {
    /// Under `hmac`: the permit id the upstream `Idempotency-Key` header was derived with
    /// (empty: the form of traffic that passes without a ledger answer). `None` when no key
    /// header left, or its form depends on no permit (`raw`, `off`, a header atmost could
    /// not read, which was removed).
    key_permit: Option<String>,
    /// An `Idempotency-Key` header left with the headers (the key's upstream form); without
    /// it a dispatch reaches the upstream with no key header, whatever the body carries.
    key_header: bool,
    /// The upstream answered before the decision.
    answered_early: bool,
}

/// Whether a POST may be a governed `tools/call`, from its headers alone: unless its
/// mirrored `Mcp-Method` names another method, or `Mcp-Name` a tool that is not governed.
/// The body must later agree with those headers, or it is refused (HeaderMismatch).
pub fn may_be_governed(mirrored: &mcp::Mirrored, governed: &ToolSet) -> bool {
    if mirrored.duplicated {
        return true;
    }
    match (mirrored.method.as_deref(), mirrored.name.as_deref()) {
        (Some(method), _) if method != "tools/call" => false,
        (_, Some(name)) => governed.contains(name),
        _ => true,
    }
}

/// The refusal of a message that passes without a ledger answer after its key header left
/// derived for a permit.
const KEY_HEADER_FOR_A_PERMIT: &str = "this message needs no ledger decision, but its Idempotency-Key header already went upstream derived for the permit its token names (request_hold: body); it was not sent. Send such a message without the permit header, or with Mcp-Method / Mcp-Name headers that name it";

impl Call {
    /// Headers of a POST with a body, after the header checks: they go on now, edited.
    pub(super) fn let_headers_go(&mut self, mut head: RequestHead, edits: Vec<Effect>) -> Step {
        let governed = may_be_governed(&head.mirrored, &self.config.governed_tools);
        let (key_effect, key_permit) = self.key_header_ahead(&head, governed);
        let mut step = Step::cont().with_all(edits);
        if head.content_length.is_some() {
            step = step.with(Effect::RemoveRequestHeader("content-length".into()));
            // Gone with the headers: a body rewrite must not set it again.
            head.content_length = None;
        }
        self.ahead = Some(Ahead {
            key_permit,
            key_header: matches!(key_effect, Some(Effect::SetRequestHeader(..))),
            answered_early: false,
        });
        self.state = State::ReadingBody(Box::new(head));
        step.with_all(key_effect)
    }

    /// The upstream form of the key header that leaves with the headers, and the permit id
    /// it was derived with (`hmac` only).
    fn key_header_ahead(
        &self,
        head: &RequestHead,
        governed: bool,
    ) -> (Option<Effect>, Option<String>) {
        let mode = &self.config.upstream_key;
        if head.idempotency_key.is_empty() || (!governed && *mode == UpstreamKey::Raw) {
            return (None, None);
        }
        let key = match head.idempotency_key.as_slice() {
            [one] => idempotency::parse_header_value(one).ok(),
            _ => None,
        };
        let permit_id = match governed {
            true => permit::token(&head.permit, &self.config.permit_header)
                .ok()
                .and_then(|t| permit_id_of(&t).map(str::to_string))
                .unwrap_or_default(),
            false => UNGOVERNED_PERMIT_ID.to_string(),
        };
        match upstream_key::upstream_value(mode, &permit_id, key.as_deref()) {
            Some(v) => {
                let hmac = matches!(mode, UpstreamKey::Hmac { .. });
                (
                    Some(Effect::SetRequestHeader(IDEMPOTENCY_HEADER.into(), v)),
                    hmac.then_some(permit_id),
                )
            }
            None => (
                Some(Effect::RemoveRequestHeader(IDEMPOTENCY_HEADER.into())),
                None,
            ),
        }
    }

    /// A message that passes without a ledger answer, after its headers left: refused when
    /// its key header went derived for a permit (see [`KEY_HEADER_FOR_A_PERMIT`]).
    pub(super) fn refuse_pass_after_head(&self, id: &Value) -> Option<Step> {
        let permit = self.ahead.as_ref()?.key_permit.as_deref()?;
        (permit != UNGOVERNED_PERMIT_ID).then(|| {
            bad_request(LocalReply::rpc_error(
                400,
                Some(id),
                rpc_code::INVALID_REQUEST,
                KEY_HEADER_FOR_A_PERMIT,
            ))
        })
    }

    /// Where the upstream receives the forwarded key if this call is dispatched, from what the
    /// dispatch sends: the `Idempotency-Key` header is set by the dispatch under
    /// `request_hold: headers`, while under `body` only a header that left with the headers is
    /// there; the body members are rewritten to the forwarded value (or left as sent, `raw`).
    pub(super) fn forwarded_key_carriers(
        &self,
        forwarded: Option<&ForwardedKey>,
        body: &idempotency::BodyKeys,
    ) -> KeyCarriers {
        let key_header = self.ahead.as_ref().is_none_or(|a| a.key_header);
        upstream_key::carriers(
            forwarded.is_some_and(|f| f.value.is_some()),
            key_header,
            body,
        )
    }

    /// Whether a dispatch under `permit_id` matches the key header that already left.
    pub(super) fn key_header_fits(&self, permit_id: &str) -> bool {
        match self.ahead.as_ref().and_then(|a| a.key_permit.as_deref()) {
            Some(p) => p == permit_id,
            None => true,
        }
    }

    /// Before the decision, with the request's headers upstream and its body held here.
    pub(super) fn awaits_decision(&self) -> bool {
        matches!(&self.ahead, Some(a) if !a.answered_early)
            && matches!(self.state, State::ReadingBody(_) | State::Authorizing(_))
    }

    /// The upstream answered before the decision.
    pub(super) fn answered_early(&self) -> bool {
        matches!(&self.ahead, Some(a) if a.answered_early)
    }

    /// The upstream answered while the authorize callout is out: its response is held.
    pub(super) fn holds_early_response(&self) -> bool {
        self.answered_early() && matches!(self.state, State::Authorizing(_))
    }

    /// Response headers before the decision: the body will never be sent.
    pub(super) fn on_response_before_decision(&mut self) -> Step {
        let count = Effect::Count(Stat::UpstreamAnsweredEarly);
        match &self.state {
            State::Authorizing(p) => {
                let log = Effect::Log(
                    Level::Info,
                    format!(
                        "atmost: the upstream answered before the ledger decided on `{}`; its body is not sent and the answer waits for the ledger",
                        p.tool
                    ),
                );
                if let Some(a) = &mut self.ahead {
                    a.answered_early = true;
                }
                Step::pause().with(count).with(log)
            }
            _ => {
                self.state = State::Overtaken;
                Step::cont().with(count).with(Effect::Log(
                    Level::Info,
                    "atmost: the upstream answered before the request body was read; the body is not sent".into(),
                ))
            }
        }
    }

    /// The ledger's answer after the upstream answered: nothing is sent. A dispatch is
    /// released at once; the upstream's answer goes on to the client.
    pub(super) fn after_early_answer(&mut self, p: &Pending, reply: &LedgerReply) -> Step {
        self.state = State::Overtaken;
        let what = match reply.authorize() {
            Ok(AuthorizeResponse::Dispatch {
                attempt_id,
                round,
                capability,
                ..
            }) => {
                let grant = DispatchGrant {
                    attempt_id,
                    round,
                    capability,
                };
                return Step::cont()
                    .with(Effect::Enqueue(grant.report(Outcome::Released {
                        reason: "never_sent: upstream_answered_first".into(),
                    })))
                    .with(Effect::Count(Stat::Released))
                    .with(Effect::Log(
                        Level::Info,
                        format!(
                            "atmost: attempt {} (round {}) of `{}` released: the upstream answered before its body was sent",
                            grant.attempt_id, grant.round, p.tool
                        ),
                    ))
                    .with(Effect::ResumeResponse);
            }
            Ok(AuthorizeResponse::Deny(d)) => format!("denied it ({})", d.code),
            Ok(AuthorizeResponse::Replay { attempt_id, .. }) => {
                format!("had a receipt (attempt {attempt_id})")
            }
            Err(reason) => format!("could not be asked ({reason})"),
        };
        Step::cont()
            .with(Effect::Log(
                Level::Info,
                format!(
                    "atmost: the ledger {what} after the upstream had answered for `{}`; nothing was sent, the upstream's answer goes to the client",
                    p.tool
                ),
            ))
            .with(Effect::ResumeResponse)
    }
}

/// A dispatch whose key header left derived for another permit than the ledger's: not sent.
pub(super) fn key_header_misfit(config: &Config, p: &Pending, grant: &DispatchGrant) -> Step {
    let denial = Denial::new(
        DenialCode::GatewayUnavailable,
        "the Idempotency-Key header that went upstream with the request's headers was derived for another permit than the one the ledger found; the call was not sent",
    );
    deny_step(config, &denial, &p.id, &p.tool)
        .with(Effect::Enqueue(grant.report(Outcome::Released {
            reason: "never_sent: key_header_permit_mismatch".into(),
        })))
        .with(Effect::Count(Stat::Released))
}
