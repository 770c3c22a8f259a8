//! The verifier's keys: those the configuration names, and the ledger's JWKS as last
//! fetched; and when to fetch it again. The root context fetches it on a timer
//! (`verify.jwks.refresh_ms`) and whenever a call names a `keyid` no key has: that call
//! waits for the fetch (at most `verify.jwks.timeout_ms`). One fetch at a time, and one
//! started for an unknown `keyid` only if none started in the last [`MIN_REFRESH_GAP_MS`],
//! so a stream of made-up `keyid`s costs the ledger at most one fetch a second per worker.

use atmost_config::{JwksSource, VerifyKey};
use atmost_protocol::signature::Jwk;
use serde_json::Value;

/// Shortest time between the starts of two fetches, when the second is for an unknown
/// `keyid`.
pub const MIN_REFRESH_GAP_MS: u64 = 1000;
/// After a failed fetch, the next timed one comes this soon (or at `refresh_ms`, if sooner).
pub const RETRY_AFTER_FAILURE_MS: u64 = 5000;
/// Most keys taken from one fetched JWKS.
pub const MAX_FETCHED_KEYS: usize = 64;

/// Every key the verifier trusts now.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KeySet {
    configured: Vec<VerifyKey>,
    fetched: Vec<VerifyKey>,
}

impl KeySet {
    pub fn new(configured: Vec<VerifyKey>) -> KeySet {
        KeySet {
            configured,
            fetched: Vec::new(),
        }
    }

    /// The public key `kid` names.
    pub fn get(&self, kid: &str) -> Option<[u8; 32]> {
        self.configured
            .iter()
            .chain(&self.fetched)
            .find(|k| k.kid == kid)
            .map(|k| k.public_key)
    }

    /// Replaces the fetched keys: a key the ledger no longer publishes is no longer trusted
    /// (the configured ones stay).
    pub fn replace_fetched(&mut self, keys: Vec<VerifyKey>) {
        self.fetched = keys;
    }

    pub fn fetched(&self) -> usize {
        self.fetched.len()
    }
}

/// The keys of a JWKS body: every member of `keys` that is an Ed25519 JWK named by its
/// thumbprint ([`Jwk::ed25519_public_key`]), others skipped; `None` when the body is not a
/// JWK Set at all.
pub fn parse_jwks(body: &[u8]) -> Option<Vec<VerifyKey>> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let items = value.get("keys")?.as_array()?;
    Some(
        items
            .iter()
            .filter_map(|item| serde_json::from_value::<Jwk>(item.clone()).ok())
            .filter_map(|jwk| VerifyKey::from_jwk(&jwk))
            .take(MAX_FETCHED_KEYS)
            .collect(),
    )
}

/// The headers of the fetch.
pub fn jwks_request_headers(source: &JwksSource) -> Vec<(String, String)> {
    vec![
        (":method".into(), "GET".into()),
        (":path".into(), source.path.clone()),
        (":authority".into(), source.authority.clone()),
        ("accept".into(), "application/json".into()),
    ]
}

/// Where the fetching stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FetchState {
    Idle,
    /// A call with an unknown `keyid` asked for a fetch; the root has not started it yet.
    Requested,
    InFlight,
}

/// What a call with an unknown `keyid` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnUnknown {
    /// A fetch is asked for or under way: wait for it.
    Wait,
    /// Ask the root to fetch, and wait.
    Request,
    /// A fetch started less than [`MIN_REFRESH_GAP_MS`] ago: refuse now.
    Refuse,
}

/// When to fetch the JWKS. Times are milliseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refresh {
    refresh_ms: u64,
    state: FetchState,
    last_started: Option<u64>,
    next_due: u64,
}

impl Refresh {
    /// The first fetch is due at once.
    pub fn new(refresh_ms: u64) -> Refresh {
        Refresh {
            refresh_ms,
            state: FetchState::Idle,
            last_started: None,
            next_due: 0,
        }
    }

    /// A call names an unknown `keyid` at `now`.
    pub fn on_unknown(&mut self, now: u64) -> OnUnknown {
        match self.state {
            FetchState::Requested | FetchState::InFlight => OnUnknown::Wait,
            FetchState::Idle
                if self
                    .last_started
                    .is_some_and(|t| now.saturating_sub(t) < MIN_REFRESH_GAP_MS) =>
            {
                OnUnknown::Refuse
            }
            FetchState::Idle => {
                self.state = FetchState::Requested;
                OnUnknown::Request
            }
        }
    }

    /// Whether the root should start a fetch now (asked for, or due); if so it is started.
    pub fn begin(&mut self, now: u64) -> bool {
        let start = match self.state {
            FetchState::Requested => true,
            FetchState::Idle => now >= self.next_due,
            FetchState::InFlight => false,
        };
        if start {
            self.state = FetchState::InFlight;
            self.last_started = Some(now);
        }
        start
    }

    /// The fetch ended (answered, failed, or could not be started).
    pub fn end(&mut self, now: u64, ok: bool) {
        self.state = FetchState::Idle;
        let wait = if ok {
            self.refresh_ms
        } else {
            self.refresh_ms.min(RETRY_AFTER_FAILURE_MS)
        };
        self.next_due = now.saturating_add(wait);
    }

    pub fn in_flight(&self) -> bool {
        self.state == FetchState::InFlight
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jwk(seed: u8) -> Value {
        serde_json::to_value(Jwk::ed25519(&[seed; 32])).unwrap_or(Value::Null)
    }

    #[test]
    fn only_thumbprint_named_ed25519_keys_are_taken() {
        let mut forged = jwk(2);
        forged["kid"] = "mine".into();
        let rsa = serde_json::json!({"kty": "RSA", "n": "x", "e": "AQAB", "kid": "r"});
        let body = serde_json::json!({"keys": [jwk(1), forged, rsa, 7]}).to_string();
        let keys = parse_jwks(body.as_bytes()).unwrap_or_default();
        assert_eq!(keys.len(), 1);
        assert_eq!(keys[0].public_key, [1; 32]);
        assert_eq!(parse_jwks(b"{\"keys\": {}}"), None);
        assert_eq!(parse_jwks(b"not json"), None);
        let many: Vec<Value> = (0..=MAX_FETCHED_KEYS as u8).map(jwk).collect();
        let body = serde_json::json!({ "keys": many }).to_string();
        assert_eq!(
            parse_jwks(body.as_bytes()).map(|k| k.len()),
            Some(MAX_FETCHED_KEYS)
        );
    }

    #[test]
    fn fetched_keys_replace_the_last_fetch_and_configured_ones_stay() {
        let key = |seed: u8| VerifyKey {
            kid: format!("k{seed}"),
            public_key: [seed; 32],
        };
        let mut set = KeySet::new(vec![key(1)]);
        set.replace_fetched(vec![key(2)]);
        assert_eq!(set.get("k2"), Some([2; 32]));
        set.replace_fetched(vec![key(3)]);
        assert_eq!(set.get("k2"), None);
        assert_eq!(set.get("k1"), Some([1; 32]));
        assert_eq!(set.get("k3"), Some([3; 32]));
    }

    #[test]
    fn one_fetch_at_a_time_and_unknown_keyids_are_rate_limited() {
        let mut r = Refresh::new(60_000);
        // Due at once.
        assert!(r.begin(10_000));
        assert!(!r.begin(10_001), "one at a time");
        assert_eq!(r.on_unknown(10_002), OnUnknown::Wait);
        r.end(10_050, true);
        // Within the gap since the last start: refused without a fetch.
        assert_eq!(r.on_unknown(10_500), OnUnknown::Refuse);
        assert!(!r.begin(10_500), "the timed one is not due");
        // After it: one request, and every other unknown keyid waits for it.
        assert_eq!(r.on_unknown(11_000), OnUnknown::Request);
        assert_eq!(r.on_unknown(11_001), OnUnknown::Wait);
        assert!(r.begin(11_002));
        assert!(r.in_flight());
        r.end(11_010, false);
        // A failure brings the timed fetch closer.
        assert!(!r.begin(16_009));
        assert!(r.begin(16_010));
        r.end(16_020, true);
        assert!(!r.begin(76_019));
        assert!(r.begin(76_020));
    }

    #[test]
    fn the_fetch_asks_the_configured_path_and_authority() {
        let source = JwksSource {
            cluster: "c".into(),
            authority: "ledger".into(),
            path: "/v1/keys".into(),
            refresh_ms: 1000,
            timeout_ms: 10,
        };
        let headers = jwks_request_headers(&source);
        assert!(headers.contains(&(":path".into(), "/v1/keys".into())));
        assert!(headers.contains(&(":authority".into(), "ledger".into())));
        assert!(headers.contains(&(":method".into(), "GET".into())));
    }
}
