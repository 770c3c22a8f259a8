//! Resumable SSE: a `tools/call` whose POST stream the server closes early, with the answer
//! arriving later on a GET stream the client opens with `Last-Event-ID` (MCP 2025-11-25
//! resumability; the SDKs do this when a server closes a POST stream to make the client poll).
//!
//! When a dispatched call's SSE response carried event ids and ended cleanly without the
//! call's answer, the filter stores a [`Ticket`] under [`key`]`(session, last event id)` in
//! Envoy's shared data (shared by every worker's VM), and does not report the attempt: it
//! stays `in_flight`. A GET carrying that `Last-Event-ID` in that session is then watched
//! like the POST was, and the answer found on it is the receipt. If no resumed stream brings
//! the answer, the ledger's lease sweeper turns the attempt `uncertain`, as for any call
//! whose outcome never arrived. Nothing here can release a slot.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Prefix of the shared-data keys.
pub const KEY_PREFIX: &str = "atmost/resume/";

/// What a resumed stream needs to capture and report the answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ticket {
    pub attempt_id: String,
    /// JSON-RPC id of the call.
    pub id: Value,
    pub tool: String,
}

/// The shared-data key for a stream of `session` (empty without a session) that ended at
/// event `last_event_id`.
pub fn key(session: Option<&str>, last_event_id: &str) -> String {
    let session = session.unwrap_or("");
    format!("{KEY_PREFIX}{}:{session}:{last_event_id}", session.len())
}

impl Ticket {
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// `None` for an empty (consumed) or unreadable value.
    pub fn from_bytes(bytes: &[u8]) -> Option<Ticket> {
        if bytes.is_empty() {
            return None;
        }
        serde_json::from_slice(bytes).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tickets_round_trip_and_keys_are_unambiguous() {
        let t = Ticket {
            attempt_id: "att_1".into(),
            id: json!(7),
            tool: "pay".into(),
        };
        assert_eq!(Ticket::from_bytes(&t.to_bytes()), Some(t));
        assert_eq!(Ticket::from_bytes(b""), None);
        assert_eq!(Ticket::from_bytes(b"{"), None);
        assert_ne!(key(Some("a:b"), "c"), key(Some("a"), "b:c"));
        assert_eq!(key(None, "e1"), "atmost/resume/0::e1");
    }
}
