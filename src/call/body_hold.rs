//! `request_hold: body`: for deployments whose Envoy cannot hold a request's headers (an
//! Istio WasmPlugin or Envoy Gateway cannot set `allow_on_headers_stop_iteration`).
//!
//! A POST's headers go upstream at once: the permit header removed, `content-length`
//! removed so the body can still be rewritten (HTTP/1.1 then frames it chunked). Only the
//! body waits (`Pause`: Envoy's StopIterationAndBuffer) until the decision. A denial, a
//! replay or a refusal is a local reply, which ends the stream: Envoy resets the upstream
//! request before any byte of the body left, so no tool runs. Nothing is signed in this
//! mode: the headers left before the ledger could sign them.
//!
//! The `Idempotency-Key` header is chosen from the headers alone ([`may_be_governed`]):
//! - a POST that may be a governed `tools/call` and carries a permit header sends no key
//!   header upstream. A governed call's upstream key is derived with the permit id its token
//!   spells, which is only a claim until the ledger has answered: sent ahead, it would let an
//!   agent learn another permit's upstream key for a key of its choosing. The key reaches
//!   the upstream only in the body, which leaves after the decision. A message that turns
//!   out to need no ledger answer is refused, since its key header cannot follow;
//! - any other POST (its `Mcp-Method` / `Mcp-Name` say it is not a governed call, or it has
//!   no permit header) gets the form of traffic that passes (empty permit id); the body must
//!   then agree with those headers (HeaderMismatch), or the call is denied `permit_invalid`.
//!
//! A response before the decision (an upstream that answers early, a connection that fails)
//! means the body is never sent: the call is handled as never sent. Before the authorize
//! callout the response goes on to the client at once (nothing is reserved); while the
//! callout is out it is held until the ledger answered, so a reserved attempt is released
//! now rather than turning uncertain when its lease runs out. The body never follows.

use super::*;
use atmost_config::ToolSet;

/// What left with a POST's headers under `request_hold: body`.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Ahead {
    /// The request's `Idempotency-Key` header was held back as a governed call's: it did not
    /// go upstream, and cannot follow once the headers left.
    key_held_back: bool,
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

/// The refusal of a message that passes without a ledger answer after its key header was
/// held back as a governed call's.
const KEY_HEADER_HELD_BACK: &str = "this message needs no ledger decision, but its Idempotency-Key header was held back as a governed call's when its headers went upstream (request_hold: body), and cannot follow; it was not sent. Send such a message without the permit header, or with Mcp-Method / Mcp-Name headers that name it";

impl Call {
    /// Headers of a POST with a body, after the header checks: they go on now, edited.
    pub(super) fn let_headers_go(&mut self, mut head: RequestHead, edits: Vec<Effect>) -> Step {
        let governed = may_be_governed(&head.mirrored, &self.config.governed_tools);
        let (key_effect, key_held_back) = self.key_header_ahead(&head, governed);
        let mut step = Step::cont().with_all(edits);
        if head.content_length.is_some() {
            step = step.with(Effect::RemoveRequestHeader("content-length".into()));
            // Gone with the headers: a body rewrite must not set it again.
            head.content_length = None;
        }
        self.ahead = Some(Ahead {
            key_held_back,
            answered_early: false,
        });
        self.state = State::ReadingBody(Box::new(head));
        step.with_all(key_effect)
    }

    /// What becomes of the key header when the headers leave, and whether it was held back
    /// as a governed call's.
    fn key_header_ahead(&self, head: &RequestHead, governed: bool) -> (Option<Effect>, bool) {
        let mode = &self.config.upstream_key;
        if head.idempotency_key.is_empty() || (!governed && *mode == UpstreamKey::Raw) {
            return (None, false);
        }
        if governed && !head.permit.is_empty() {
            // Under `off` no key header goes upstream in any case: nothing is held back.
            let held_back = *mode != UpstreamKey::Off;
            return (
                Some(Effect::RemoveRequestHeader(IDEMPOTENCY_HEADER.into())),
                held_back,
            );
        }
        let key = match head.idempotency_key.as_slice() {
            [one] => idempotency::parse_header_value(one).ok(),
            _ => None,
        };
        let effect = match upstream_key::upstream_value(mode, UNGOVERNED_PERMIT_ID, key.as_deref())
        {
            Some(v) => Effect::SetRequestHeader(IDEMPOTENCY_HEADER.into(), v),
            None => Effect::RemoveRequestHeader(IDEMPOTENCY_HEADER.into()),
        };
        (Some(effect), false)
    }

    /// A message that passes without a ledger answer, after its headers left: refused when
    /// its key header was held back (see [`KEY_HEADER_HELD_BACK`]).
    pub(super) fn refuse_pass_after_head(&self, id: &Value) -> Option<Step> {
        self.ahead.as_ref().filter(|a| a.key_held_back).map(|_| {
            bad_request(LocalReply::rpc_error(
                400,
                Some(id),
                rpc_code::INVALID_REQUEST,
                KEY_HEADER_HELD_BACK,
            ))
        })
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
                            grant.attempt_id, grant.round, p.tool
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
                    p.tool
                ),
            ))
            .with(Effect::ResumeResponse)
    }
}
