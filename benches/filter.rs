//! Micro-benchmarks of the filter's per-call work, natively (the wasm build runs the same
//! code in V8, slower by a constant factor): parsing an MCP body, the RFC 8785
//! fingerprint, and one governed `tools/call` through the whole state machine (request →
//! authorize callout → dispatch → JSON response → completed report); and the verifier at
//! the tool (`role: "verify"`): the check of one signed governed call (its headers read, the
//! body's digest, the Ed25519 signature with ed25519-compact as the module runs it), that
//! signature alone, and the call through the verifier's whole machine.
//!
//! `cargo bench -p atmost-filter --bench filter`
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;
use std::rc::Rc;

use atmost_config::Config;
use atmost_filter::parse::fingerprint::fingerprint;
use atmost_filter::parse::mcp::{self, Mirrored};
use criterion::{criterion_group, criterion_main, Criterion};
use serde_json::{json, Map, Value};

// The same call as the call-cost driver of `make bench` (instructions per call).
#[path = "../bench/callcost/src/one_call.rs"]
mod one_call;
use one_call::{one_call, CALL, CONFIG};
// The same signed call as `atmost-bench-callcost verify`.
#[path = "../bench/callcost/src/one_verify.rs"]
mod one_verify;
use one_verify::SignedCall;

const LIST: &[u8] = br#"{"jsonrpc":"2.0","id":2,"method":"tools/list","params":{}}"#;

fn big_arguments() -> Map<String, Value> {
    let mut m = Map::new();
    for i in 0..32 {
        m.insert(
            format!("field_{i:02}"),
            json!({"text": "x".repeat(16), "n": i, "nested": {"b": [1, 2, 3], "a": true}}),
        );
    }
    m
}

fn parse(c: &mut Criterion) {
    let mirrored = Mirrored::default();
    c.bench_function("parse/tools_call", |b| {
        b.iter(|| mcp::parse(black_box(CALL), &mirrored))
    });
    c.bench_function("parse/tools_list", |b| {
        b.iter(|| mcp::parse(black_box(LIST), &mirrored))
    });
}

fn fingerprints(c: &mut Criterion) {
    let small = json!({"invoice": "INV-1", "amount": 250, "memo": "quarterly"});
    let small = small.as_object().cloned().unwrap();
    let big = big_arguments();
    c.bench_function("fingerprint/3_fields", |b| {
        b.iter(|| fingerprint(black_box("pay_invoice"), black_box(&small)))
    });
    c.bench_function("fingerprint/32_nested_fields", |b| {
        b.iter(|| fingerprint(black_box("pay_invoice"), black_box(&big)))
    });
}

fn whole_call(c: &mut Criterion) {
    let config = Rc::new(Config::parse(CONFIG).unwrap());
    c.bench_function("call/tools_call_request_to_completed_report", |b| {
        b.iter(|| assert!(black_box(one_call(&config))))
    });
}

fn verifier(c: &mut Criterion) {
    let mut signed = SignedCall::new().unwrap();
    assert!(signed.check(), "the bench's signed call does not verify");
    c.bench_function("verify/check_signed_call", |b| {
        b.iter(|| assert!(black_box(&signed).check()))
    });
    c.bench_function("verify/read_without_signature", |b| {
        b.iter(|| black_box(&signed).read().unwrap())
    });
    let presented = signed.read().unwrap();
    c.bench_function("verify/ed25519_signature_only", |b| {
        b.iter(|| black_box(&presented).verify(&signed.public_key).unwrap())
    });
    c.bench_function("verify/tools_call_through_the_verifier", |b| {
        b.iter(|| assert!(signed.one_verify()))
    });
}

criterion_group!(benches, parse, fingerprints, whole_call, verifier);
criterion_main!(benches);
