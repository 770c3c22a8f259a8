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
//!
//! A ticket is the call's, not the session's: only a GET on the same path under the same
//! permit may take it ([`Ticket::admits`]), and taking it removes it from shared data, so
//! each ticket is used once. It carries the round and capability of the dispatch it stands
//! for, so a receipt it brings is recorded only for that round: if the attempt has moved on,
//! the ledger answers `stale_round` and nothing changes.

use atmost_protocol::{DispatchGrant, PermitLimits};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// Prefix of the shared-data keys.
pub const KEY_PREFIX: &str = "atmost/resume/";

/// What a resumed stream needs to capture and report the answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ticket {
    pub grant: DispatchGrant,
    /// JSON-RPC id of the call.
    pub id: Value,
    pub tool: String,
    /// [`permit_hash`] of the permit token the call was authorized under.
    pub permit_hash: String,
    /// `:path` of the call.
    pub path: String,
    /// The permit's figures from the call's dispatch, for the answer the resumed stream
    /// carries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<PermitLimits>,
}

/// Lowercase hex SHA-256 of a permit token as presented: tickets in shared data name the
/// permit without holding its secret.
pub fn permit_hash(token: &[u8]) -> String {
    let digest = Sha256::digest(token);
    let mut out = String::with_capacity(64);
    for b in digest {
        out.push(char::from(HEX[usize::from(b >> 4)]));
        out.push(char::from(HEX[usize::from(b & 0xf)]));
    }
    out
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// The permit a dispatched call came with, as a ticket will need it: the token as presented
/// (hashed only when a ticket is saved, which few calls need, so the hash stays off the path
/// of every call), or the hash a resumed stream's own ticket carried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallPermit {
    Token(String),
    Hash(String),
}

impl CallPermit {
    /// [`permit_hash`] of the permit.
    pub fn hash(&self) -> String {
        match self {
            CallPermit::Token(token) => permit_hash(token.as_bytes()),
            CallPermit::Hash(hash) => hash.clone(),
        }
    }
}

/// The shared-data key for a stream of `session` (empty without a session) that ended at
/// event `last_event_id`.
pub fn key(session: Option<&str>, last_event_id: &str) -> String {
    let session = session.unwrap_or("");
    format!("{KEY_PREFIX}{}:{session}:{last_event_id}", session.len())
}

impl Ticket {
    /// Whether a GET on `path` carrying these permit header values may resume this call's
    /// stream: exactly one permit value, the call's, and the call's path.
    pub fn admits(&self, permit_values: &[Vec<u8>], path: &str) -> bool {
        match permit_values {
            [one] => {
                let presented = permit_hash(trim_ascii(one));
                constant_time_eq(presented.as_bytes(), self.permit_hash.as_bytes())
                    && path == self.path
            }
            _ => false,
        }
    }

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

fn trim_ascii(b: &[u8]) -> &[u8] {
    let start = b
        .iter()
        .position(|c| !c.is_ascii_whitespace())
        .unwrap_or(b.len());
    let end = b
        .iter()
        .rposition(|c| !c.is_ascii_whitespace())
        .map_or(start, |i| i + 1);
    b.get(start..end).unwrap_or_default()
}

/// Comparison whose time does not depend on where the inputs differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tickets_round_trip_and_keys_are_unambiguous() {
        let t = ticket();
        assert_eq!(Ticket::from_bytes(&t.to_bytes()), Some(t));
        assert_eq!(Ticket::from_bytes(b""), None);
        assert_eq!(Ticket::from_bytes(b"{"), None);
        assert_ne!(key(Some("a:b"), "c"), key(Some("a"), "b:c"));
        assert_eq!(key(None, "e1"), "atmost/resume/0::e1");
    }

    fn ticket() -> Ticket {
        Ticket {
            grant: DispatchGrant {
                attempt_id: "att_1".into(),
                round: 2,
                capability: "cap".into(),
            },
            id: json!(7),
            tool: "pay".into(),
            permit_hash: permit_hash(b"atmp_pmt_1_secret"),
            path: "/mcp".into(),
            limits: Some(PermitLimits::until("2030-01-01T00:00:00.000Z").with_calls_left(Some(1))),
        }
    }

    #[test]
    fn a_calls_permit_hashes_the_same_from_its_token_or_from_a_ticket() {
        let token = CallPermit::Token("atmp_pmt_1_secret".into());
        assert_eq!(token.hash(), permit_hash(b"atmp_pmt_1_secret"));
        assert_eq!(CallPermit::Hash(token.hash()).hash(), token.hash());
    }

    #[test]
    fn only_the_calls_permit_on_the_calls_path_takes_a_ticket() {
        let t = ticket();
        let permit = b"atmp_pmt_1_secret".to_vec();
        assert!(t.admits(std::slice::from_ref(&permit), "/mcp"));
        assert!(t.admits(&[b" atmp_pmt_1_secret ".to_vec()], "/mcp"));
        assert!(!t.admits(&[], "/mcp"), "a GET without a permit");
        assert!(
            !t.admits(&[b"atmp_pmt_2_other".to_vec()], "/mcp"),
            "another permit"
        );
        assert!(
            !t.admits(&[permit.clone(), permit.clone()], "/mcp"),
            "two permits"
        );
        assert!(!t.admits(&[permit], "/other"), "another path");
        assert_eq!(
            permit_hash(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
