//! Micro-benchmarks of the filter's per-call work, natively (the wasm build runs the same
//! code in V8, slower by a constant factor): parsing an MCP body, the RFC 8785
//! fingerprint, and one governed `tools/call` through the whole state machine (request →
//! authorize callout → dispatch → JSON response → completed report).
//!
//! `cargo bench -p atmost-filter --bench filter`
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::hint::black_box;
use std::rc::Rc;

use atmost_filter::call::{BodyStep, Call, RequestHead, ResponseHead};
use atmost_filter::config::Config;
use atmost_filter::fingerprint::fingerprint;
use atmost_filter::ledger::LedgerReply;
use atmost_filter::mcp::{self, Mirrored};
use criterion::{criterion_group, criterion_main, Criterion};
use serde_json::{json, Map, Value};

const CALL: &[u8] = br#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"pay_invoice","arguments":{"invoice":"INV-1","amount":250,"memo":"quarterly"},"_meta":{"dev.atmost/idempotency-key":"task-4417-pay"}}}"#;
const LIST: &[u8] = br#"{"jsonrpc":"2.0","id":2,"method":"tools/list","params":{}}"#;
const CONFIG: &[u8] = br#"{"ledger":{"cluster":"atmost_ledger","service_token":"svc"},"upstream_key":{"mode":"hmac","secret":"0123456789abcdef0123"}}"#;

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
    let dispatch = LedgerReply {
        status: Some(200),
        body: br#"{"decision":"dispatch","attempt_id":"att-1","permit_id":"p1","lease_ms":120000}"#
            .to_vec(),
    };
    let response = br#"{"jsonrpc":"2.0","id":3,"result":{"content":[{"type":"text","text":"ok"}],"isError":false}}"#;
    c.bench_function("call/tools_call_request_to_completed_report", |b| {
        b.iter(|| {
            let mut call = Call::new(Rc::clone(&config));
            call.on_request_headers(RequestHead {
                method: "POST".into(),
                permit: vec![b"p1.secret".to_vec()],
                content_length: Some(CALL.len() as u64),
                ..RequestHead::default()
            });
            let BodyStep::Read { .. } = call.on_request_body(CALL.len(), true) else {
                panic!("body not read")
            };
            let step = call.on_request_body_data(CALL);
            assert!(step.callout.is_some());
            call.on_ledger_reply(&dispatch);
            call.on_response_headers(ResponseHead {
                content_type: Some("application/json".into()),
                end_of_stream: false,
            });
            let _ = call.on_response_body(response.len(), true);
            black_box(call.on_response_body_data(response, true))
        })
    });
}

criterion_group!(benches, parse, fingerprints, whole_call);
criterion_main!(benches);
