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
//!
//! Each of these steps is taken by the phase it happens in ([`super::phase`]): `Start` lets
//! the headers go ahead, the passing phase refuses a message whose key header was held
//! back, and `ReadingBody` and `Authorizing` meet an early answer.

use super::refusal::bad_request;
use super::reply::{rpc_code, LocalReply};
use super::Step;
use crate::parse::mcp;
use atmost_config::ToolSet;
use serde_json::Value;

/// What left with a POST's headers under `request_hold: body`.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Ahead {
    /// The request's `Idempotency-Key` header was held back as a governed call's: it did not
    /// go upstream, and cannot follow once the headers left.
    pub(super) key_held_back: bool,
    /// The upstream answered before the decision.
    pub(super) answered_early: bool,
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
pub(super) fn key_header_held_back(id: &Value) -> Step {
    bad_request(LocalReply::rpc_error(
        400,
        Some(id),
        rpc_code::INVALID_REQUEST,
        KEY_HEADER_HELD_BACK,
    ))
}

const KEY_HEADER_HELD_BACK: &str = "this message needs no ledger decision, but its Idempotency-Key header was held back as a governed call's when its headers went upstream (request_hold: body), and cannot follow; it was not sent. Send such a message without the permit header, or with Mcp-Method / Mcp-Name headers that name it";
