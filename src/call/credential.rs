//! The ledger's credential on a dispatched call (docs/design.md#the-agent-holds-no-credential).
//!
//! A Dispatch answer may carry the permit's credential: the header it goes in, its value,
//! and the Envoy route of the tool it belongs to. The filter sets it on that call alone, if
//! Envoy routed the call there, after removing whatever the agent sent under that header;
//! on another route it sets nothing. A replay, a denial or an error carries nothing, since
//! only a Dispatch answer holds a credential. The value travels in
//! [`Effect::SetRequestSecret`], whose `Debug` never shows it, and is never logged or counted.

use crate::call::Effect;
use atmost_protocol::credential::{check_header_name, check_header_value, UpstreamCredential};

/// Why a credential the ledger sent cannot go on the call: the call is then not sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unsendable {
    /// A header name or value no ledger registers (a reserved header, a line break).
    Malformed,
    /// `request_hold: body`: the request's headers left before the decision, so no
    /// credential can be added to them.
    HeadersGone,
}

impl Unsendable {
    pub fn as_str(self) -> &'static str {
        match self {
            Unsendable::Malformed => "credential_malformed",
            Unsendable::HeadersGone => "credential_after_headers",
        }
    }
}

/// The request edits that put `credential` on a call Envoy routed to `route` (`None`: a
/// request that matched no named route), the agent's own value under its header removed
/// first; none when the credential belongs to another route. `headers_held`: the request's
/// headers are still held (`request_hold: headers`).
pub fn edits(
    credential: &UpstreamCredential,
    route: Option<&str>,
    headers_held: bool,
) -> Result<Vec<Effect>, Unsendable> {
    if check_header_name(&credential.header).is_err()
        || check_header_value(credential.value.expose()).is_err()
    {
        return Err(Unsendable::Malformed);
    }
    if !credential.routes.iter().any(|r| Some(r.as_str()) == route) {
        return Ok(Vec::new());
    }
    if !headers_held {
        return Err(Unsendable::HeadersGone);
    }
    Ok(vec![
        Effect::RemoveRequestHeader(credential.header.clone()),
        Effect::SetRequestSecret(credential.header.clone(), credential.value.clone()),
    ])
}

/// Most permits one worker keeps a credential for; past it, expired entries go first, and
/// all of them if none has expired.
pub const MAX_CACHED_PERMITS: usize = 1024;

/// The credentials of the permits one worker (its Wasm VM) has asked the ledger for, for the
/// session's requests other than a dispatched `tools/call`, each kept for `credential_cache_ms`
/// from when it was asked. Keyed by the SHA-256 of the permit token; a permit the ledger
/// refused, or that names no credential, is kept as none, so its requests do not ask again
/// within the lifetime. In memory only, never logged.
#[derive(Debug)]
pub struct CredentialCache {
    lifetime_ms: u64,
    entries: std::collections::HashMap<[u8; 32], (u64, Option<UpstreamCredential>)>,
}

fn token_key(permit_token: &str) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    Sha256::digest(permit_token.as_bytes()).into()
}

impl CredentialCache {
    pub fn new(lifetime_ms: u64) -> CredentialCache {
        CredentialCache {
            lifetime_ms,
            entries: std::collections::HashMap::new(),
        }
    }

    /// What is kept for the token at `now_ms`: `None` when nothing is, or it has expired.
    pub fn get(&self, permit_token: &str, now_ms: u64) -> Option<Option<UpstreamCredential>> {
        let (at, credential) = self.entries.get(&token_key(permit_token))?;
        (now_ms.saturating_sub(*at) < self.lifetime_ms).then(|| credential.clone())
    }

    /// Keeps what the ledger answered for the token, asked at `at_ms`.
    pub fn put(&mut self, permit_token: &str, at_ms: u64, credential: Option<UpstreamCredential>) {
        if self.entries.len() >= MAX_CACHED_PERMITS {
            let lifetime = self.lifetime_ms;
            self.entries
                .retain(|_, (at, _)| at_ms.saturating_sub(*at) < lifetime);
            if self.entries.len() >= MAX_CACHED_PERMITS {
                self.entries.clear();
            }
        }
        self.entries
            .insert(token_key(permit_token), (at_ms, credential));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use atmost_protocol::credential::SecretValue;

    fn credential(header: &str, value: &str) -> UpstreamCredential {
        UpstreamCredential {
            name: "pay".into(),
            version: 2,
            header: header.into(),
            value: SecretValue::new(value.into()),
            routes: vec!["pay_route".into()],
        }
    }

    #[test]
    fn on_its_route_the_agents_value_is_removed_then_the_credential_set() {
        let c = credential("authorization", "Bearer sk-live-1");
        let edits = edits(&c, Some("pay_route"), true).unwrap();
        assert_eq!(
            edits,
            vec![
                Effect::RemoveRequestHeader("authorization".into()),
                Effect::SetRequestSecret(
                    "authorization".into(),
                    SecretValue::new("Bearer sk-live-1".into())
                ),
            ]
        );
        assert!(!format!("{edits:?}").contains("sk-live"), "{edits:?}");
    }

    #[test]
    fn on_another_route_or_none_nothing_is_set() {
        let c = credential("x-api-key", "sk-live-1");
        assert_eq!(edits(&c, Some("other_route"), true), Ok(Vec::new()));
        assert_eq!(edits(&c, None, true), Ok(Vec::new()));
        assert_eq!(edits(&c, Some("other_route"), false), Ok(Vec::new()));
    }

    #[test]
    fn the_cache_keeps_an_answer_for_its_lifetime_and_stays_bounded() {
        let mut cache = CredentialCache::new(1000);
        assert_eq!(cache.get("t1", 0), None);
        cache.put("t1", 100, Some(credential("x-api-key", "v")));
        cache.put("t2", 100, None);
        assert_eq!(cache.get("t1", 1099).flatten().map(|c| c.version), Some(2));
        assert_eq!(cache.get("t2", 1099), Some(None));
        assert_eq!(cache.get("t1", 1100), None, "expired");
        assert_eq!(cache.get("t3", 500), None);
        assert!(!format!("{cache:?}").contains("t1"));
        for i in 0..MAX_CACHED_PERMITS {
            cache.put(&format!("p{i}"), 2000, None);
        }
        // Full: the expired t1 and t2 went first, then everything.
        assert!(cache.entries.len() <= MAX_CACHED_PERMITS);
        cache.put("last", 2000, None);
        assert_eq!(cache.get("last", 2000), Some(None));
        assert!(cache.entries.len() <= MAX_CACHED_PERMITS);
    }

    #[test]
    fn a_credential_that_cannot_go_on_the_call_is_refused() {
        for (header, value) in [
            ("atmost-permit", "v"),
            ("content-length", "1"),
            ("Authorization", "v"),
            ("x-api-key", "a\r\nx-other: b"),
            ("x-api-key", ""),
        ] {
            let c = credential(header, value);
            assert_eq!(
                edits(&c, Some("pay_route"), true),
                Err(Unsendable::Malformed),
                "{header}"
            );
        }
        let c = credential("x-api-key", "sk-live-1");
        assert_eq!(
            edits(&c, Some("pay_route"), false),
            Err(Unsendable::HeadersGone)
        );
    }
}
