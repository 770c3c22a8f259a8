//! `Start`: the request's headers, the one event this phase handles. They decide whether
//! the request is refused at once, passes, resumes a dispatched call's stream, or has its
//! body read.

use super::dispatched::Dispatched;
use super::passing::{passing_key_header, ungoverned_key_header, Forwarding};
use super::reading_body::ReadingBody;
use super::Phase;
use crate::call::body_hold::{self, Ahead};
use crate::call::refusal::{alias_refused, unreadable_body};
use crate::call::{
    upgrade, Context, Effect, Level, RequestHead, Step, IDEMPOTENCY_HEADER, MAX_RETRIES_HEADER,
};
use crate::stats::Stat;
use atmost_config::{Config, RequestHold, UpstreamKey};

/// The request's headers: the only event `Start` handles, and the one that leaves it.
pub(in crate::call) fn on_request_headers(cx: &mut Context, head: RequestHead) -> (Phase, Step) {
    let config = &cx.config;
    if let Some(alias) = &head.alias {
        return (Phase::Answered, alias_refused(alias));
    }
    if let Some(refusal) = upgrade::refusal(&head, &config.upgrade_routes) {
        return (Phase::Answered, refusal);
    }
    let edits = head_edits(config, &head);
    if head.method.eq_ignore_ascii_case("GET") {
        if let Some(t) = head.resume {
            let key = passing_key_header(config, &head.idempotency_key);
            let step = Step::cont().with_all(edits).with_all(key).with(Effect::Log(
                Level::Info,
                format!(
                    "atmost: GET resumes the stream of attempt {} (round {}) of `{}`; watching it for the answer",
                    t.grant.attempt_id, t.grant.round, t.tool
                ),
            ));
            let resumed = Dispatched::resuming(t, head.session_id);
            return (Phase::Dispatched(Box::new(resumed)), step);
        }
    }
    // An upgrade on a listed route passes like traffic that needs no decision: what
    // follows its headers is the upgraded connection, never a body to read.
    if head.upgrade.is_some() || !head.method.eq_ignore_ascii_case("POST") || head.end_of_stream {
        return match passing_key_header(config, &head.idempotency_key) {
            Some(key) => (
                Phase::Forwarding(Forwarding::unread()),
                Step::cont().with_all(edits).with(key),
            ),
            None => (Phase::Passing, Step::cont().with_all(edits)),
        };
    }
    if let Some(refusal) = unreadable_body(&head, config.max_body_bytes) {
        return (Phase::Answered, refusal);
    }
    if config.request_hold == RequestHold::Body {
        return let_headers_go(cx, head, edits);
    }
    (ReadingBody::of(head), Step::pause().with_all(edits))
}

/// The edits every request gets before anything of it can leave: the permit header and
/// Envoy's control headers removed and, on a POST, Envoy's retries turned off.
fn head_edits(config: &Config, head: &RequestHead) -> Vec<Effect> {
    let mut edits = Vec::new();
    // The permit never goes upstream; when the request has none there is nothing to
    // remove (every header name was matched case-insensitively).
    if !head.permit.is_empty() {
        edits.push(Effect::RemoveRequestHeader(config.permit_header.clone()));
    }
    for name in head.control_headers.iter().chain(&head.signature_headers) {
        edits.push(Effect::RemoveRequestHeader((*name).into()));
    }
    if head.method.eq_ignore_ascii_case("POST") {
        edits.push(Effect::SetRequestHeader(
            MAX_RETRIES_HEADER.into(),
            "0".into(),
        ));
    }
    edits.extend(
        head.control_headers
            .iter()
            .map(|_| Effect::Count(Stat::ControlHeaderRemoved)),
    );
    edits
}

/// `request_hold: body` ([`body_hold`]): the headers of a POST with a body, after the
/// header checks, go on now, edited; the body is read next, and waits for the decision.
fn let_headers_go(cx: &mut Context, mut head: RequestHead, edits: Vec<Effect>) -> (Phase, Step) {
    let governed = body_hold::may_be_governed(&head.mirrored, &cx.config.governed_tools);
    let (key_effect, key_held_back) = key_header_ahead(&cx.config, &head, governed);
    let mut step = Step::cont().with_all(edits);
    if head.content_length.is_some() {
        step = step.with(Effect::RemoveRequestHeader("content-length".into()));
        // Gone with the headers: a body rewrite must not set it again.
        head.content_length = None;
    }
    cx.ahead = Some(Ahead {
        key_held_back,
        answered_early: false,
    });
    (ReadingBody::of(head), step.with_all(key_effect))
}

/// What becomes of the key header when the headers leave, and whether it was held back as
/// a governed call's.
fn key_header_ahead(config: &Config, head: &RequestHead, governed: bool) -> (Option<Effect>, bool) {
    let mode = &config.upstream_key;
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
    (
        Some(ungoverned_key_header(mode, &head.idempotency_key)),
        false,
    )
}

#[cfg(test)]
mod tests;
