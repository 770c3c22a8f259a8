//! Micro-benchmarks of what signing a dispatch costs the ledger per governed call, on the
//! path its authorize handler takes: the check of the request's dispatch target, then the
//! signature of the Dispatch answer (the nonce, `Signature-Input` and the RFC 9421 base built
//! by `atmost_protocol::signature`, and ring's Ed25519 signature over it). Apart: the
//! Ed25519 signature alone over the same base, and the JSON the signature adds to an
//! authorize exchange (the request's `dispatch` read, the answer's `signature` written).
//!
//! `cargo bench -p atmost-ledger --bench signing`
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;

use atmost_ledger::keys::SigningKey;
use atmost_ledger::signing::{check_dispatch, sign_answer};
use atmost_ledger::token;
use atmost_protocol::signature::DispatchTarget;
use atmost_protocol::{AuthorizeRequest, AuthorizeResponse, KeyCarrier, KeyCarriers};
use criterion::{criterion_group, criterion_main, Criterion};
use serde_json::json;

/// Unix milliseconds of the benchmark's clock: any fixed time serves, signing reads no clock.
const NOW_MS: i64 = 1_764_680_000_000;

/// An authorize request as the gateway sends it for the bench's `echo` call under the default
/// `upstream_key` mode: a 64-hex forwarded key, and the dispatch target naming it.
fn request(signed: bool) -> AuthorizeRequest {
    let body = br#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"echo","arguments":{"text":"k-1"},"_meta":{"dev.atmost/idempotency-key":"k-1"}}}"#;
    let forwarded = token::sha256_hex("fwd:k-1");
    AuthorizeRequest {
        reports: Vec::new(),
        permit_token: token::new_token("pmt_0123456789abcdef01234567").unwrap(),
        tool: "echo".into(),
        idempotency_key: Some("k-1".into()),
        fingerprint: token::sha256_hex("k-1"),
        arguments: json!({"text": "k-1"}),
        key_required: false,
        continuation: false,
        forwarded_key: Some(forwarded.clone()),
        forwarded_key_carriers: KeyCarriers::NONE.with(KeyCarrier::Header),
        dispatch: signed.then(|| DispatchTarget {
            method: "POST".into(),
            authority: "127.0.0.1:10000".into(),
            path: "/mcp".into(),
            body_sha256: hex_sha256(body),
            idempotency_key: Some(forwarded),
            validity_s: 15,
        }),
    }
}

fn hex_sha256(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(bytes))
}

/// A Dispatch answer as the store gives it, before it is signed.
fn answer() -> AuthorizeResponse {
    AuthorizeResponse::Dispatch {
        attempt_id: "att_019ad0c8e3a07f2b9c4d5e6f70819a2b".into(),
        permit_id: "pmt_0123456789abcdef01234567".into(),
        lease_ms: 120_000,
        round: 1,
        capability: token::sha256_hex("capability"),
        limits: None,
        signature: None,
        credential: None,
    }
}

fn signing(c: &mut Criterion) {
    let (key, _row) = SigningKey::generate(NOW_MS).unwrap();
    let req = request(true);
    c.bench_function("signing/check_dispatch+sign_answer", |b| {
        b.iter(|| {
            let req = black_box(&req);
            check_dispatch(req).unwrap();
            let mut response = answer();
            let recorded = req.dispatch.as_ref().map(|d| d.body_sha256.as_str());
            assert!(sign_answer(req, &mut response, &key, NOW_MS, recorded).unwrap());
            response
        })
    });

    // The curve operation alone, over the base of the same dispatch.
    let mut signed = answer();
    let recorded = req.dispatch.as_ref().map(|d| d.body_sha256.clone());
    sign_answer(&req, &mut signed, &key, NOW_MS, recorded.as_deref()).unwrap();
    let base = {
        use atmost_protocol::signature::{content_digest_from_hex, SignatureInput, SignedRequest};
        let AuthorizeResponse::Dispatch {
            signature: Some(s), ..
        } = &signed
        else {
            panic!("not signed")
        };
        let target = req.dispatch.as_ref().unwrap();
        let digest = content_digest_from_hex(&target.body_sha256).unwrap();
        let input = SignatureInput::parse(&s.signature_input).unwrap();
        SignedRequest {
            method: &target.method,
            authority: &target.authority,
            path: &target.path,
            content_digest: &digest,
            idempotency_key: target.idempotency_key.as_deref(),
        }
        .signature_base(&input)
        .unwrap()
    };
    c.bench_function("signing/ed25519_sign_base", |b| {
        b.iter(|| key.sign(black_box(base.as_bytes())))
    });

    // The JSON around it: the authorize request read and the Dispatch answer written, with
    // and without what signing adds.
    for (name, signed_req, response) in [
        ("unsigned", request(false), answer()),
        ("signed", req.clone(), signed.clone()),
    ] {
        let body = serde_json::to_vec(&signed_req).unwrap();
        c.bench_function(&format!("signing/authorize_json_{name}"), |b| {
            b.iter(|| {
                let parsed: AuthorizeRequest = serde_json::from_slice(black_box(&body)).unwrap();
                black_box(parsed);
                serde_json::to_vec(black_box(&response)).unwrap()
            })
        });
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = signing
}
criterion_main!(benches);
