//! `approval_hold_ms`: a call the ledger answers `approval_required` is held open while a
//! person decides, instead of answering the denial at once, so that an agent that does not
//! retry on `retry_after` still gets through a quick approval. Decided here: whether the
//! call waits, and for how long before the ledger is asked again. The waiting is the root
//! context's ([`crate::held_calls`]).

use atmost_protocol::Denial;
use serde_json::Value;

/// The bounds of a wait between two asks, whatever `retry_after` says: the ledger's own
/// range (1 to 5 s). Never shorter, so a held call costs the ledger at most one authorize a
/// second; never longer, so an approval reaches a held call within 5 s.
const MIN_WAIT_MS: u64 = 1_000;
const MAX_WAIT_MS: u64 = 5_000;

/// A call held for a person's approval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Held {
    /// When the ledger first answered `approval_required` (Unix ms, Envoy's clock): the
    /// bound counts from here.
    pub(super) since_ms: u64,
}

/// How long to wait before asking the ledger again about a call it answered `denial`
/// (`approval_required`) at `now_ms`, held since `since_ms` for at most `hold_ms`: the
/// denial's `retry_after` within 1 to 5 s (1 s when it names none), cut to what is left of
/// the hold so the last ask falls on its bound; `None` once the bound is reached.
pub(super) fn wait_ms(hold_ms: u64, since_ms: u64, now_ms: u64, denial: &Denial) -> Option<u64> {
    let left = since_ms.saturating_add(hold_ms).saturating_sub(now_ms);
    if left == 0 {
        return None;
    }
    let retry_after_ms = denial
        .data
        .get("retry_after")
        .and_then(Value::as_u64)
        .map_or(MIN_WAIT_MS, |s| s.saturating_mul(1_000))
        .clamp(MIN_WAIT_MS, MAX_WAIT_MS);
    Some(retry_after_ms.min(left))
}
