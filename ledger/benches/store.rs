//! Micro-benchmarks of the store: one authorize (fresh key) followed by its `completed`
//! report, one at a time, on the embedded SQLite store (each is its own durable
//! transaction, so this is mostly the cost of a commit); a replay (read-mostly); and, when
//! DATABASE_URL is set, the same pair on PostgreSQL (schema `atmost_bench_criterion`).
//!
//! `cargo bench -p atmost-ledger --bench store`
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use atmost_ledger::clock::Deadline;
use atmost_ledger::model::{GuardMode, Permit, Policy};
use atmost_ledger::store::postgres::{PgOptions, PgStore};
use atmost_ledger::store::sqlite::SqliteStore;
use atmost_ledger::store::Store;
use atmost_ledger::token;
use atmost_protocol::{AuthorizeRequest, AuthorizeResponse, Outcome, OutcomeReport};
use criterion::{criterion_group, criterion_main, Criterion};
use serde_json::json;

const LEASE_MS: u64 = 120_000;

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

async fn permit(store: &dyn Store) -> String {
    let id = token::new_permit_id().unwrap();
    let tok = token::new_token(&id).unwrap();
    let now = now_ms();
    let p = Permit {
        token_hash: token::sha256_hex(&tok),
        id,
        label: "bench".into(),
        created_at_ms: now,
        expires_at_ms: now + 86_400_000,
        revoked_at_ms: None,
        policy: Policy::builder()
            .duplicate_guard(GuardMode::Log)
            .retention_ms(86_400_000)
            .build(),
    };
    store.create_permit(&p).await.unwrap();
    tok
}

fn request(tok: &str, key: &str) -> AuthorizeRequest {
    AuthorizeRequest {
        reports: Vec::new(),
        permit_token: tok.into(),
        tool: "echo".into(),
        idempotency_key: Some(key.into()),
        fingerprint: token::sha256_hex(key),
        arguments: json!({"text": key}),
        key_required: false,
        continuation: false,
        // What the filter sends under the default upstream_key mode: a 64-hex value.
        forwarded_key: Some(token::sha256_hex(&format!("fwd:{key}"))),
        forwarded_key_carriers: atmost_protocol::KeyCarriers::NONE
            .with(atmost_protocol::KeyCarrier::Header),
        dispatch: None,
    }
}

async fn pair(store: &dyn Store, tok: &str, key: &str) {
    let d = store
        .authorize(
            &request(tok, key),
            LEASE_MS,
            now_ms(),
            Deadline::after(Duration::from_secs(60)),
        )
        .await
        .unwrap();
    let AuthorizeResponse::Dispatch {
        attempt_id,
        round,
        capability,
        ..
    } = d.response
    else {
        panic!("not dispatched: {:?}", d.response)
    };
    let report = OutcomeReport {
        attempt_id,
        round,
        capability,
        outcome: Outcome::Completed {
            receipt: r#"{"jsonrpc":"2.0","id":1,"result":{"content":[],"isError":false}}"#.into(),
        },
    };
    store.record_outcome(&report, now_ms()).await.unwrap();
}

fn bench_store(c: &mut Criterion, name: &str, rt: &tokio::runtime::Runtime, store: Arc<dyn Store>) {
    let tok = rt.block_on(permit(store.as_ref()));
    let seq = AtomicU64::new(0);
    let run = now_ms();
    c.bench_function(&format!("{name}/authorize_fresh_key+complete"), |b| {
        b.iter(|| {
            let key = format!("k-{run}-{}", seq.fetch_add(1, Ordering::Relaxed));
            rt.block_on(pair(store.as_ref(), &tok, &key))
        })
    });
    let replay_key = format!("replay-{run}");
    rt.block_on(pair(store.as_ref(), &tok, &replay_key));
    let req = request(&tok, &replay_key);
    c.bench_function(&format!("{name}/authorize_replay"), |b| {
        b.iter(|| {
            rt.block_on(store.authorize(
                &req,
                LEASE_MS,
                now_ms(),
                Deadline::after(Duration::from_secs(60)),
            ))
            .unwrap()
        })
    });
}

fn stores(c: &mut Criterion) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let sqlite: Arc<dyn Store> = Arc::new(SqliteStore::open_dir(dir.path()).unwrap());
    bench_store(c, "sqlite", &rt, sqlite);
    if let Ok(url) = std::env::var("DATABASE_URL") {
        let mut opts = PgOptions::new(url);
        opts.schema = Some("atmost_bench_criterion".into());
        let pg: Arc<dyn Store> = Arc::new(rt.block_on(PgStore::connect(&opts)).unwrap());
        bench_store(c, "postgres", &rt, pg);
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = stores
}
criterion_main!(benches);
