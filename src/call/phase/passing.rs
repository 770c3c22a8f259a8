//! `Passing` and `Forwarding`: traffic that needs no ledger answer goes on, every
//! idempotency key it carries in its upstream form. `Forwarding` is such a request whose key
//! was rewritten, which has something to refuse if the host refuses the rewrite.

use super::Phase;
use crate::call::refusal::{deny_step, rewrite_failed, rewrite_failed_log, rewrite_refused};
use crate::call::sent_body::SentBody;
use crate::call::upstream_key::{self, UNGOVERNED_PERMIT_ID};
use crate::call::{body_hold, Context, Effect, RequestHead, Step, IDEMPOTENCY_HEADER};
use crate::parse::{idempotency, key_rewrite};
use atmost_config::{Config, UpstreamKey};
use serde_json::Value;

/// A request passing with its idempotency key rewritten for upstream.
#[derive(Debug, Clone)]
pub(in crate::call) struct Forwarding {
    /// The JSON-RPC id (`null` if none, or the body was not read): what a refusal answers
    /// if the host refuses the rewrite.
    id: Value,
    /// For a `tools/call`, its tool.
    tool: Option<String>,
}

impl Forwarding {
    /// A request whose body is not read.
    pub(super) fn unread() -> Forwarding {
        Forwarding {
            id: Value::Null,
            tool: None,
        }
    }

    /// The host refused the rewrite: the request is refused, a `tools/call` as a denial.
    pub(in crate::call) fn on_rewrite_failed(self, config: &Config) -> Step {
        match self.tool {
            Some(tool) => deny_step(config, &rewrite_refused(), &self.id, &tool)
                .with(rewrite_failed_log(&format!("for `{tool}`"))),
            None => rewrite_failed(Some(&self.id)),
        }
    }
}

/// Lets a parsed message pass that needs no ledger answer (not a `tools/call`, or an
/// ungoverned one), with every idempotency key it carries in its upstream form. `body` is
/// given only when the parse found a key field in it, so other traffic is not scanned
/// again.
pub(super) fn pass(
    cx: &Context,
    head: &RequestHead,
    body: Option<&[u8]>,
    id: Value,
    tool: Option<String>,
) -> (Phase, Step) {
    // After its headers left (`request_hold: body`), such a message cannot go on when its
    // key header was held back as a governed call's.
    if cx.ahead.as_ref().is_some_and(|a| a.key_held_back) {
        return (Phase::Answered, body_hold::key_header_held_back(&id));
    }
    let mode = &cx.config.upstream_key;
    let mut step = Step::cont();
    if let Some(body) = body.filter(|_| *mode != UpstreamKey::Raw) {
        let rewritten = key_rewrite::rewritten(body, |raw| {
            let key = idempotency::valid_body_key(raw);
            upstream_key::upstream_value(mode, UNGOVERNED_PERMIT_ID, key.as_deref())
        });
        if let Some(sent) = rewritten {
            let length = head.content_length.is_some();
            step.effects
                .extend(SentBody::new(body, sent, length).effects());
        }
    }
    if cx.ahead.is_none() {
        step = step.with_all(passing_key_header(&cx.config, &head.idempotency_key));
    }
    if step.effects.is_empty() {
        (Phase::Passing, step)
    } else {
        (Phase::Forwarding(Forwarding { id, tool }), step)
    }
}

/// What traffic that passes without a ledger answer does with an `Idempotency-Key` header:
/// nothing in `raw` mode; otherwise its upstream form, or removed when it is not one key
/// atmost would accept (it is never forwarded raw).
pub(super) fn passing_key_header(config: &Config, values: &[Vec<u8>]) -> Option<Effect> {
    if values.is_empty() || config.upstream_key == UpstreamKey::Raw {
        return None;
    }
    Some(ungoverned_key_header(&config.upstream_key, values))
}

/// The `Idempotency-Key` header in the form of traffic that passes (empty permit id), or
/// removed when its values are not one key atmost would accept.
pub(in crate::call) fn ungoverned_key_header(mode: &UpstreamKey, values: &[Vec<u8>]) -> Effect {
    let key = match values {
        [one] => idempotency::parse_header_value(one).ok(),
        _ => None,
    };
    match upstream_key::upstream_value(mode, UNGOVERNED_PERMIT_ID, key.as_deref()) {
        Some(v) => Effect::SetRequestHeader(IDEMPOTENCY_HEADER.into(), v),
        None => Effect::RemoveRequestHeader(IDEMPOTENCY_HEADER.into()),
    }
}

#[cfg(test)]
mod tests;
