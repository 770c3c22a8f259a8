//! The local replies that end a request before anything of it leaves, given by several
//! phases (and the verifier, for the ones both roles share): refusals of what the filter
//! will not take, and the denials of a governed call.

use super::reply::{rpc_code, LocalReply};
use super::{denial, Effect, Level, RequestHead, Step};
use crate::parse::body_encoding;
use crate::stats::Stat;
use atmost_config::Config;
use atmost_protocol::{Denial, DenialCode};
use serde_json::Value;

/// The denial of a governed `tools/call` of `tool`, answered locally with the request's
/// JSON-RPC `id`, counted by its code.
pub(super) fn deny_step(config: &Config, denial: &Denial, id: &Value, tool: &str) -> Step {
    let mut step = Step::pause()
        .with(Effect::LocalReply(denial::render(
            denial,
            id,
            config.denial_format,
        )))
        .with(Effect::Count(Stat::Denied))
        .with(Effect::Count(Stat::DeniedCode(denial.code)));
    if denial.code == DenialCode::GatewayUnavailable {
        step = step.with(Effect::Count(Stat::GatewayUnavailable));
    }
    step.with(Effect::Log(
        Level::Info,
        format!("atmost: denied tools/call of `{tool}`: {}", denial.code),
    ))
}

/// A local reply to a request the filter will not take, counted as a bad request.
pub(crate) fn bad_request(reply: LocalReply) -> Step {
    Step::pause()
        .with(Effect::LocalReply(reply))
        .with(Effect::Count(Stat::BadRequest))
}

/// A header named like one atmost reads, spelled otherwise: an upstream that reads `_` as
/// `-` could take its value for the one atmost checked, so nothing of the request is sent.
pub(crate) fn alias_refused(name: &str) -> Step {
    bad_request(LocalReply::rpc_error(
        400,
        None,
        rpc_code::INVALID_REQUEST,
        &format!(
            "header `{name}` is refused: servers that read `_` as `-` take it for a header atmost checks under its own name; send that header only as it is spelled with `-`"
        ),
    ))
}

/// The refusal of request trailers on a POST whose body is read: what they would add is
/// read by no check, in either role.
pub(crate) fn trailers_refused() -> Step {
    bad_request(LocalReply::rpc_error(
        400,
        None,
        rpc_code::INVALID_REQUEST,
        "request trailers are not accepted by atmost",
    ))
}

/// The refusal of a POST whose body the filter will not read (an encoding or charset other
/// than plain UTF-8, or a stated length past `max_body_bytes`), the same in both roles.
pub(crate) fn unreadable_body(head: &RequestHead, max_body_bytes: u64) -> Option<Step> {
    if let Err(refusal) = body_encoding::check(&head.content_type, &head.content_encoding) {
        return Some(bad_request(LocalReply::rpc_error(
            400,
            None,
            rpc_code::INVALID_REQUEST,
            refusal.message(),
        )));
    }
    head.content_length
        .filter(|n| *n > max_body_bytes)
        .map(|_| too_large(max_body_bytes))
}

/// The refusal of a body past `max_body_bytes`.
pub(crate) fn too_large(max: u64) -> Step {
    bad_request(LocalReply::rpc_error(
        413,
        None,
        rpc_code::INVALID_REQUEST,
        &format!("request body exceeds max_body_bytes ({max})"),
    ))
}

/// The denial when the ledger could not be asked.
pub(super) fn gateway_unavailable() -> Denial {
    Denial::new(
        DenialCode::GatewayUnavailable,
        "the atmost ledger could not be asked; the call was not sent",
    )
}

/// The denial when the host refused to rewrite the request: nothing went upstream.
pub(super) fn rewrite_refused() -> Denial {
    Denial::new(
        DenialCode::GatewayUnavailable,
        "atmost could not rewrite the request for its upstream (idempotency key or permit header); it was not sent",
    )
}

/// The log line of a request refused because the host refused to rewrite it (`what` says
/// which, or is empty).
pub(super) fn rewrite_failed_log(what: &str) -> Effect {
    Effect::Log(
        Level::Error,
        format!("atmost: could not rewrite the request {what}; refused, not sent"),
    )
}

/// The refusal when the host refused to rewrite a request that is no governed call: `id` is
/// its JSON-RPC id, once read.
pub(super) fn rewrite_failed(id: Option<&Value>) -> Step {
    bad_request(LocalReply::rpc_error(
        503,
        id,
        rpc_code::INTERNAL_ERROR,
        &rewrite_refused().message,
    ))
    .with(rewrite_failed_log(""))
}
