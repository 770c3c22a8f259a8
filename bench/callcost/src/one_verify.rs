//! One signed governed `tools/call` through the verifier (`role: "verify"`), shared by the
//! criterion bench (`benches/filter.rs`, by path) and the call-cost driver
//! (`atmost-bench-callcost verify N`).
//!
//! The request is signed once, as the ledger signs a dispatch (the protocol's one base,
//! Ed25519), with ed25519-compact's deterministic signing from a fixed seed: signing is the
//! ledger's work, not the verifier's. Every pass checks the same request; the replay cache's
//! slots forget what they are given ([`ForgetfulSlots`]), so each pass records its nonce into
//! an empty slot (as in a cache far from full) instead of being refused as a replay.

use std::hint::black_box;
use std::rc::Rc;

use atmost_config::{PluginConfig, VerifyConfig};
use atmost_filter::call::{BodyStep, Effect, RequestHead};
use atmost_filter::stats::Stat;
use atmost_filter::verify::check::{self, Presented, Received, SignedHead};
use atmost_filter::verify::replay::{SharedSlots, SlotValue};
use atmost_filter::verify::{Verdict, Verifier, VerifyCall};
use atmost_protocol::signature::{
    content_digest_of, signature_header, DispatchNonce, Jwk, SignatureParams, SignedRequest,
};
use ed25519_compact::{KeyPair, Seed};
use serde_json::json;

/// The bench's call as the gateway sends it upstream: the key rewritten to the HMAC form.
pub const VERIFY_CALL: &[u8] = br#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"echo","arguments":{"text":"k-1"},"_meta":{"dev.atmost/idempotency-key":"3f1b9c2e5d7a8046b1c3e5f7091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c"}}}"#;
const AUTHORITY: &str = "127.0.0.1:10000";
const KEY: &str = "3f1b9c2e5d7a8046b1c3e5f7091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c";
/// Unix seconds of the verifier's clock; the signature was made a second before.
pub const NOW_S: u64 = 1_764_680_000;

/// Replay-cache slots that are always there and always empty: every record succeeds.
#[derive(Debug, Default)]
pub struct ForgetfulSlots;

impl SharedSlots for ForgetfulSlots {
    fn get(&mut self, _key: &str) -> Option<SlotValue> {
        Some(SlotValue {
            bytes: Vec::new(),
            version: 1,
        })
    }
    fn set(&mut self, _key: &str, value: &[u8], _version: u32) -> bool {
        black_box(value);
        true
    }
    fn create(&mut self, _key: &str) {}
}

/// A verifier trusting one key inline, and one request signed by it.
pub struct SignedCall {
    pub config: Rc<VerifyConfig>,
    pub verifier: Verifier,
    pub slots: ForgetfulSlots,
    /// The request's header lines as Envoy hands them to the module.
    pub headers: Vec<(String, Vec<u8>)>,
    pub public_key: [u8; 32],
}

impl SignedCall {
    /// `None` if the configuration or the signature cannot be made (a bug in the driver).
    pub fn new() -> Option<SignedCall> {
        let pair = KeyPair::from_seed(Seed::new([7; 32]));
        let jwk = Jwk::ed25519(pair.pk.as_ref());
        let digest = content_digest_of(VERIFY_CALL);
        let request = SignedRequest {
            method: "POST",
            authority: AUTHORITY,
            path: "/mcp",
            content_digest: &digest,
            idempotency_key: Some(KEY),
        };
        let input = request.signature_params(&SignatureParams {
            created: NOW_S - 1,
            expires: NOW_S - 1 + 15,
            keyid: jwk.kid.clone(),
            nonce: DispatchNonce {
                attempt_id: "att_019ad0c8e3a07f2b9c4d5e6f70819a2b".into(),
                round: 1,
                permit_id: "pmt_0123456789abcdef01234567".into(),
                tool: "echo".into(),
            }
            .encode(),
        });
        let base = request.signature_base(&input)?;
        let signature = pair.sk.sign(base.as_bytes(), None);
        let plugin = json!({"role": "verify", "verify": {"keys": {"keys": [jwk]}, "authorities": [AUTHORITY]},
                            "governed_tools": ["echo"]});
        let Ok(PluginConfig::Verify(config)) = PluginConfig::parse(plugin.to_string().as_bytes())
        else {
            return None;
        };
        let config = Rc::new(config);
        let headers: Vec<(String, Vec<u8>)> = [
            (":method", "POST".to_string()),
            (":path", "/mcp".into()),
            (":authority", AUTHORITY.into()),
            (":scheme", "http".into()),
            ("content-type", "application/json".into()),
            ("accept", "application/json, text/event-stream".into()),
            ("content-length", VERIFY_CALL.len().to_string()),
            ("idempotency-key", KEY.into()),
            ("content-digest", digest),
            ("signature-input", input.header_value()),
            ("signature", signature_header(signature.as_ref())),
            ("x-forwarded-proto", "http".into()),
            (
                "x-request-id",
                "6f1c2a3b-4d5e-4f60-8192-a3b4c5d6e7f8".into(),
            ),
        ]
        .into_iter()
        .map(|(n, v)| (n.to_string(), v.into_bytes()))
        .collect();
        let mut public_key = [0u8; 32];
        public_key.copy_from_slice(pair.pk.as_ref());
        Some(SignedCall {
            verifier: Verifier::new(Rc::clone(&config)),
            config,
            slots: ForgetfulSlots,
            headers,
            public_key,
        })
    }

    /// The check alone: the headers read, the signature's form, window and body digest
    /// ([`check::read`]), then the Ed25519 signature ([`Presented::verify`]).
    pub fn check(&self) -> bool {
        self.read()
            .is_some_and(|presented| presented.verify(&self.public_key).is_ok())
    }

    /// Everything but the signature: the headers read, the form, window and body digest.
    pub fn read(&self) -> Option<Presented> {
        let signed = SignedHead::from_headers(self.headers.iter().map(|(n, v)| (n.as_str(), v)));
        let received = Received {
            method: "POST",
            path: "/mcp",
            body: VERIFY_CALL,
            tool: "echo",
        };
        check::read(&signed, received, NOW_S, 5, &self.config.authorities).ok()
    }

    /// One request through the verifier's machine as the adapter drives it: headers, body,
    /// the body parsed, the check, the replay cache. `true` if it was let through verified.
    pub fn one_verify(&mut self) -> bool {
        let signed = SignedHead::from_headers(self.headers.iter().map(|(n, v)| (n.as_str(), v)));
        let head = RequestHead::from_headers(self.headers.iter().cloned(), "", false);
        let mut call = VerifyCall::new(Rc::clone(&self.config));
        call.on_request_headers(head, signed);
        let BodyStep::Read { .. } = call.on_request_body(VERIFY_CALL.len(), true) else {
            return false;
        };
        let verdict = call.on_request_body_data(
            VERIFY_CALL,
            &mut self.verifier,
            1,
            NOW_S * 1000,
            &mut self.slots,
        );
        matches!(verdict, Verdict::Now(step) if step.effects.contains(&Effect::Count(Stat::Verified)))
    }
}
