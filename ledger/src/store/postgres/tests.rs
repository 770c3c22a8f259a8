//! The PostgreSQL store's tests: the conformance suite, the group transactions, the query
//! plans, migrations and schema versions. They need a server (`DATABASE_URL`) and fail
//! without one, never skip: built only with the `postgres-tests` feature, which `make
//! test-unit` (and so `make test` and CI) turns on.

#![cfg(feature = "postgres-tests")]

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::json;

use super::migrations::{migrations, RELEASED};
use super::rows::{attempts_by_keys_sql, load_attempts_sql, LOCK_PERMITS_OF_ATTEMPTS};
use super::sweep::{due_permits_sql, SHORTEST_RETENTION_SQL};
use super::testing::{self, Cleanup};
use super::{PgOptions, PgStore};
use crate::store::conformance::{self, Harness, LEASE_MS, T0};
use crate::store::schema::{two_versions_ahead_refusal, SCHEMA_VERSION};
use crate::store::Applied;
use crate::store::{Decisions, Reads, Store};

/// The server the PostgreSQL tests use. They never skip: without it they fail.
pub fn database_url() -> String {
    testing::database_url().unwrap_or_else(|m| panic!("{m}"))
}

fn opts(url: &str, schema: &str) -> PgOptions {
    testing::options(url, schema)
}

fn new_schema() -> String {
    testing::new_schema().unwrap()
}

/// A plain client on the database (no schema), for set-up and clean-up.
async fn raw_client(url: &str) -> tokio_postgres::Client {
    testing::raw_client(url)
        .await
        .unwrap_or_else(|m| panic!("{m}"))
}

/// One fresh schema per test: `store` and `second_handle` are two pools on it (like two
/// replicas), `reopen` a new pool; the schema is dropped at the end.
struct PgHarness {
    url: String,
    schema: String,
    /// Whether lone new calls may take the one-statement decision.
    one_statement: bool,
    first: Arc<PgStore>,
}

impl PgHarness {
    /// Every handle as shipped: lone new calls take the one-statement decision.
    async fn new() -> Self {
        Self::with(true).await
    }

    /// Every decision on the locked path.
    async fn locked_only() -> Self {
        Self::with(false).await
    }

    async fn with(one_statement: bool) -> Self {
        let url = database_url();
        let schema = new_schema();
        let options = PgOptions {
            one_statement_decisions: one_statement,
            ..opts(&url, &schema)
        };
        let first = Arc::new(PgStore::connect(&options).await.unwrap());
        PgHarness {
            url,
            schema,
            one_statement,
            first,
        }
    }

    async fn handle(&self) -> Arc<dyn Store> {
        let options = PgOptions {
            one_statement_decisions: self.one_statement,
            ..opts(&self.url, &self.schema)
        };
        Arc::new(PgStore::connect(&options).await.unwrap())
    }
}

impl Drop for PgHarness {
    fn drop(&mut self) {
        testing::drop_schema(self.url.clone(), self.schema.clone());
    }
}

#[async_trait]
impl Harness for PgHarness {
    async fn store(&self) -> Arc<dyn Store> {
        self.first.clone()
    }
    async fn second_handle(&self) -> Arc<dyn Store> {
        self.handle().await
    }
    async fn reopen(&self) -> Arc<dyn Store> {
        self.handle().await
    }
}

crate::conformance_suite!(PgHarness::new().await);

/// The same suite with every decision on the locked path, the one-statement decision's
/// fallback: both paths keep the contract on their own.
mod locked_path {
    use super::PgHarness;

    crate::conformance_suite!(PgHarness::locked_only().await);
}

/// "dispatch", or the denial's code.
fn answer_name(r: atmost_protocol::AuthorizeResponse) -> String {
    match r {
        atmost_protocol::AuthorizeResponse::Dispatch { .. } => "dispatch".to_string(),
        atmost_protocol::AuthorizeResponse::Deny(d) => format!("{:?}", d.code),
        other => format!("{other:?}"),
    }
}

/// Lone new calls under a permit a handle has seen are decided by one statement; a copy that
/// another replica made stale never admits past the cap: its statement does not apply, and
/// the locked path denies.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_statement_decides_lone_calls_and_a_stale_copy_admits_nothing() {
    let h = PgHarness::new().await;
    let a = h.first.clone();
    let b = PgStore::connect(&opts(&h.url, &h.schema)).await.unwrap();
    let mut pol = conformance::policy();
    pol.rules.max_calls.insert("pay".into(), 3);
    let (_, tok) = conformance::make_permit(&*a, pol, T0 + conformance::HOUR).await;
    async fn call_as(s: &PgStore, tok: &str, key: &str) -> String {
        let r = conformance::req(tok, "pay", Some(key), key, json!({}));
        let d = s.authorize(&r, LEASE_MS, T0, conformance::patient()).await;
        answer_name(d.unwrap().response)
    }
    let call = |s, key| call_as(s, &tok, key);
    let counts = |applied, not_applied| Applied {
        applied,
        not_applied,
    };
    // A's first call takes the locked path, which leaves A its copy of the permit.
    assert_eq!(call(&a, "k1").await, "dispatch");
    assert_eq!(a.one_statement_counts().unwrap().decisions, counts(0, 0));
    assert_eq!(call(&a, "k2").await, "dispatch");
    assert_eq!(a.one_statement_counts().unwrap().decisions, counts(1, 0));
    // B takes the last slot; A's copy still says two are held.
    assert_eq!(call(&b, "k3").await, "dispatch");
    // On its copy A would admit a fourth call: the statement finds the slot counter's version
    // moved and applies nothing, and the locked path denies.
    assert_eq!(call(&a, "k4").await, "PermitMaxCallsExceeded");
    assert_eq!(a.one_statement_counts().unwrap().decisions, counts(1, 1));
    let held: i64 = raw_client(&h.url)
        .await
        .query_one(
            &format!(
                "SELECT slots_held FROM {}.permit_tool_usage WHERE tool = 'pay'",
                h.schema
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(held, 3);
    // The key of a call decided by one statement answers as any other: in progress.
    assert_eq!(call(&a, "k2").await, "IdempotencyInProgress");
}

/// A lone report to the replica that wrote its attempt is applied by one statement; one whose
/// attempt another replica moved meanwhile does not apply, and the locked path answers it from
/// what is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_statement_reports_apply_only_to_the_attempt_as_written() {
    use crate::store::conformance::{dispatched, report_of};
    use atmost_protocol::{Outcome, OutcomeAck};
    let h = PgHarness::new().await;
    let a = h.first.clone();
    let b = PgStore::connect(&opts(&h.url, &h.schema)).await.unwrap();
    let (_, tok) =
        conformance::make_permit(&*a, conformance::policy(), T0 + conformance::HOUR).await;
    let mut ids = Vec::new();
    for key in ["k1", "k2"] {
        let r = conformance::req(&tok, "pay", Some(key), key, json!({}));
        let d = a.authorize(&r, LEASE_MS, T0, conformance::patient()).await;
        ids.push(dispatched(&d.unwrap().response));
    }
    let done = |id: &str| {
        report_of(
            id,
            Outcome::Completed {
                receipt: format!("receipt of {id}"),
            },
        )
    };
    let ack = a.record_outcome(&done(&ids[0]), T0 + 1).await.unwrap();
    assert_eq!(ack.ack, OutcomeAck::Applied);
    let reports = |applied, not_applied| Applied {
        applied,
        not_applied,
    };
    assert_eq!(a.one_statement_counts().unwrap().reports, reports(1, 0));
    // The same report again: the copy moves nothing, so the stored attempt answers it.
    let again = a.record_outcome(&done(&ids[0]), T0 + 2).await.unwrap();
    assert_eq!(again.ack, OutcomeAck::AlreadyRecorded);
    assert_eq!(a.one_statement_counts().unwrap().reports, reports(1, 0));
    // B releases the second attempt; A's copy still has it in flight.
    let released = report_of(
        &ids[1],
        Outcome::Released {
            reason: "never sent".into(),
        },
    );
    assert_eq!(
        b.record_outcome(&released, T0 + 3).await.unwrap().ack,
        OutcomeAck::Applied
    );
    let late = a.record_outcome(&done(&ids[1]), T0 + 4).await.unwrap();
    assert_eq!(late.ack, OutcomeAck::Conflict);
    assert_eq!(a.one_statement_counts().unwrap().reports, reports(1, 1));
    let state: String = raw_client(&h.url)
        .await
        .query_one(
            &format!("SELECT state FROM {}.attempts WHERE id = $1", h.schema),
            &[&ids[1]],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(state, "released");
}

/// A client holding the permit's row lock in an open transaction (`COMMIT` releases it),
/// so what the store queues meanwhile forms one group.
async fn hold_permit_lock(h: &PgHarness, permit_id: &str) -> tokio_postgres::Client {
    let raw = raw_client(&h.url).await;
    raw.batch_execute(&format!(
        "BEGIN; SELECT 1 FROM {}.permits WHERE id = '{permit_id}' FOR UPDATE",
        h.schema
    ))
    .await
    .unwrap();
    raw
}

/// Decisions waiting for the next group (`None`: no decision worker runs).
fn queued_decisions(s: &PgStore) -> Option<usize> {
    s.decisions.waiting()
}

/// Outcome reports waiting for the next group (`None`: no outcome worker runs).
fn queued_outcomes(s: &PgStore) -> Option<usize> {
    s.outcomes.waiting()
}

/// Waits until the queue holds `want` jobs. A spawned call may first run at any time, in
/// any order with the others, so the grouping tests order their calls on the queue by
/// waiting for each to arrive there, not by waiting for a while. A call answered
/// meanwhile (it failed, or never queued) fails the test instead of letting it hang.
async fn until_queued<T>(
    queued: impl Fn() -> Option<usize>,
    want: usize,
    calls: &[&tokio::task::JoinHandle<T>],
) {
    while queued() != Some(want) {
        assert!(
            calls.iter().all(|c| !c.is_finished()),
            "a call was answered while {want} were expected in the queue (queued: {:?})",
            queued()
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Decisions queued while the permit's lock is held elsewhere are decided together, in
/// one transaction: each must see what the earlier ones of its group decided (a slot
/// taken, a fingerprint in flight, a key reserved), though none of it is committed yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_group_of_queued_decisions_sees_its_own_earlier_decisions() {
    use crate::model::GuardMode;
    use atmost_protocol::{AuthorizeResponse, DenialCode};
    let h = PgHarness::new().await;
    let s = h.first.clone();
    let mut pol = conformance::policy();
    pol.rules.duplicate_guard = GuardMode::Enforce;
    pol.rules.max_calls.insert("pay".into(), 3);
    let (p, tok) = conformance::make_permit(&*s, pol, T0 + conformance::HOUR).await;
    let raw = hold_permit_lock(&h, &p.id).await;
    let call = |r: atmost_protocol::AuthorizeRequest| {
        let s = s.clone();
        tokio::spawn(async move {
            s.authorize(&r, LEASE_MS, T0, conformance::patient())
                .await
                .unwrap()
                .response
        })
    };
    // The first call is its worker's first group alone, waiting for the lock ...
    let first = call(conformance::req(
        &tok,
        "other",
        Some("k0"),
        "fp-0",
        json!({}),
    ));
    until_queued(|| queued_decisions(&s), 0, &[&first]).await;
    // ... so these queue behind it and form the next group.
    let mut calls = Vec::new();
    for i in 0..8 {
        let key = format!("d{i}");
        calls.push((
            "dup",
            call(conformance::req(
                &tok,
                "x",
                Some(&key),
                "one-print",
                json!({}),
            )),
        ));
    }
    for i in 0..8 {
        let (key, fp) = (format!("c{i}"), format!("fp-c{i}"));
        calls.push((
            "cap",
            call(conformance::req(&tok, "pay", Some(&key), &fp, json!({}))),
        ));
    }
    // One key with other arguments each time (so only the key ties them together).
    for i in 0..4 {
        let fp = format!("fp-k{i}");
        calls.push((
            "key",
            call(conformance::req(&tok, "y", Some("same"), &fp, json!({}))),
        ));
    }
    let waiting: Vec<_> = calls.iter().map(|(_, c)| c).chain([&first]).collect();
    until_queued(|| queued_decisions(&s), calls.len(), &waiting).await;
    raw.batch_execute("COMMIT").await.unwrap();
    assert!(matches!(
        first.await.unwrap(),
        AuthorizeResponse::Dispatch { .. }
    ));
    let mut got = std::collections::BTreeMap::<(&str, String), usize>::new();
    for (kind, c) in calls {
        let outcome = answer_name(c.await.unwrap());
        *got.entry((kind, outcome)).or_default() += 1;
    }
    let want: std::collections::BTreeMap<(&str, String), usize> = [
        (("dup", "dispatch".to_string()), 1),
        (
            (
                "dup",
                format!("{:?}", DenialCode::DuplicateRequestSuspected),
            ),
            7,
        ),
        (("cap", "dispatch".to_string()), 3),
        (
            ("cap", format!("{:?}", DenialCode::PermitMaxCallsExceeded)),
            5,
        ),
        (("key", "dispatch".to_string()), 1),
        (
            ("key", format!("{:?}", DenialCode::IdempotencyKeyConflict)),
            3,
        ),
    ]
    .into_iter()
    .collect();
    assert_eq!(got, want);
    let counters = s.permit_counters(&p.id).await.unwrap().unwrap();
    assert_eq!(counters.slots_held.get("pay"), Some(&3));
}

/// Version 3's partial indexes carry the model's state lists, and the sweeper's queries
/// (as generic plans, the way prepared statements end up) are answered from them.
#[tokio::test]
async fn sweeper_queries_read_the_partial_indexes() {
    use crate::model::AttemptState;
    let v3 = RELEASED.iter().find(|m| m.version == 3).unwrap().sql;
    // Version 12 built the leased index anew when the approval states joined the list.
    let v12 = RELEASED.iter().find(|m| m.version == 12).unwrap().sql;
    let leased = AttemptState::sql_list(AttemptState::leased);
    let replays = AttemptState::sql_list(AttemptState::replays);
    assert!(v12.contains(&format!("WHERE state IN {leased};")), "{v12}");
    assert!(
        v3.contains(&format!("WHERE pruned_at IS NULL AND state IN {replays};")),
        "{v3}"
    );
    assert_plans_use(&[
        ("attempts_leased", "(text, bigint)", "('p', 0)", format!(
            "SELECT a.id FROM attempts a WHERE a.state IN {leased} AND a.lease_expires_at <= $2 AND a.permit_id = $1"
        )),
        ("attempts_prunable", "(text, bigint)", "('p', 0)", format!(
            "SELECT a.id FROM attempts a WHERE a.pruned_at IS NULL AND a.state IN {replays} \
             AND COALESCE(a.finished_at, a.updated_at) <= $2 AND a.permit_id = $1"
        )),
    ])
    .await;
}

/// Each query's plan (generic, sequential scans off) on a fresh schema reads its index:
/// (index, parameter types, arguments, SQL).
async fn assert_plans_use(queries: &[(&str, &str, &str, String)]) {
    let h = PgHarness::new().await;
    let c = raw_client(&h.url).await;
    c.batch_execute(&format!(
        "SET search_path = {}; SET plan_cache_mode = force_generic_plan; SET enable_seqscan = off",
        h.schema
    ))
    .await
    .unwrap();
    for (n, (index, types, args, sql)) in queries.iter().enumerate() {
        c.batch_execute(&format!("PREPARE q{n}{types} AS {sql}"))
            .await
            .unwrap();
        let plan = explain(&c, &format!("EXECUTE q{n}{args}")).await;
        assert!(plan.contains(index), "{index}: {plan}");
    }
}

/// One group holds the calls of several permits: keys, fingerprints, slots and budgets
/// stay each permit's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_group_of_several_permits_keeps_each_permits_own_keys_and_counters() {
    use crate::model::GuardMode;
    use atmost_protocol::AuthorizeResponse;
    let h = PgHarness::new().await;
    let s = h.first.clone();
    let mut pol = conformance::policy();
    pol.rules.duplicate_guard = GuardMode::Enforce;
    pol.rules.max_calls.insert("pay".into(), 2);
    pol.rules.budget = Some(10);
    pol.rules.cost_default = 4;
    let (pa, ta) = conformance::make_permit(&*s, pol.clone(), T0 + conformance::HOUR).await;
    let (pb, tb) = conformance::make_permit(&*s, pol, T0 + conformance::HOUR).await;
    let raw = hold_permit_lock(&h, &pa.id).await;
    let call = |tok: &str, key: &str, fp: &str| {
        let (s, r) = (
            s.clone(),
            conformance::req(tok, "pay", Some(key), fp, json!({})),
        );
        tokio::spawn(async move {
            s.authorize(&r, LEASE_MS, T0, conformance::patient())
                .await
                .unwrap()
                .response
        })
    };
    // Waits for the lock alone; the rest queue behind it as one group.
    let first = call(&ta, "k0", "same");
    until_queued(|| queued_decisions(&s), 0, &[&first]).await;
    // Permit b's key k0 and its call with fingerprint "same" under another key are other
    // calls than permit a's (already committed); each permit has two slots and budget
    // for two calls (4 each, of 10). They join the queue in this order: each is spawned
    // once the one before it is there, so the group decides them in this order.
    let mut calls = Vec::new();
    for (tok, key, fp) in [
        (&ta, "k1", "fp-a1"),
        (&tb, "k0", "fp-b0"),
        (&tb, "kb", "same"),
        (&ta, "k2", "fp-a2"),
        (&tb, "k3", "fp-b3"),
    ] {
        calls.push(call(tok, key, fp));
        let waiting: Vec<_> = calls.iter().chain([&first]).collect();
        until_queued(|| queued_decisions(&s), calls.len(), &waiting).await;
    }
    raw.batch_execute("COMMIT").await.unwrap();
    assert!(matches!(
        first.await.unwrap(),
        AuthorizeResponse::Dispatch { .. }
    ));
    let mut got = Vec::new();
    for c in calls {
        got.push(answer_name(c.await.unwrap()));
    }
    // a: the first call and k1, then no slot for k2; b: k0 and kb, then none for k3.
    assert_eq!(
        got,
        [
            "dispatch",
            "dispatch",
            "dispatch",
            "PermitMaxCallsExceeded",
            "PermitMaxCallsExceeded"
        ]
    );
    for p in [&pa, &pb] {
        let c = s.permit_counters(&p.id).await.unwrap().unwrap();
        assert_eq!(
            (c.slots_held.get("pay"), c.reserved),
            (Some(&2), 8),
            "{}",
            p.id
        );
    }
}

/// Outcome batches sent while the permit's lock is held elsewhere are applied together,
/// in the order they arrived, each answered for its own reports.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn outcome_batches_queued_together_are_applied_in_order() {
    use crate::model::AttemptState;
    use atmost_protocol::{AuthorizeResponse, Outcome, OutcomeAck, OutcomeReport};
    let h = PgHarness::new().await;
    let s = h.first.clone();
    let (p, tok) =
        conformance::make_permit(&*s, conformance::policy(), T0 + conformance::HOUR).await;
    let mut ids = Vec::new();
    for i in 0..3 {
        let key = format!("k{i}");
        let r = conformance::req(&tok, "pay", Some(&key), &key, json!({}));
        match conformance::auth(&*s, &r, T0).await {
            AuthorizeResponse::Dispatch { attempt_id, .. } => ids.push(attempt_id),
            other => panic!("{other:?}"),
        }
    }
    let raw = hold_permit_lock(&h, &p.id).await;
    let done = |r: &str| Outcome::Completed { receipt: r.into() };
    let gone = || Outcome::Released {
        reason: "connection_refused".into(),
    };
    let batches = vec![
        vec![(0, done("R0")), (1, gone())],
        vec![(2, done("R2")), (0, gone())],
        vec![(1, done("late")), (2, done("R2"))],
    ];
    let mut calls = Vec::new();
    // In this order: the first waits for the lock alone, in its worker's first group;
    // each later batch is sent once the one before it is in the queue.
    let mut want_queued = 0;
    for (n, batch) in batches.into_iter().enumerate() {
        let reports: Vec<OutcomeReport> = batch
            .into_iter()
            .map(|(i, outcome)| conformance::report_of(&ids[i], outcome))
            .collect();
        let s = s.clone();
        let sent = reports.len();
        calls.push(tokio::spawn(async move {
            s.record_outcomes(&reports, T0 + 1).await.unwrap()
        }));
        if n > 0 {
            want_queued += sent;
        }
        let waiting: Vec<_> = calls.iter().collect();
        until_queued(|| queued_outcomes(&h.first), want_queued, &waiting).await;
    }
    raw.batch_execute("COMMIT").await.unwrap();
    let mut acks = Vec::new();
    for c in calls {
        acks.push(
            c.await
                .unwrap()
                .into_iter()
                .map(|r| r.ack)
                .collect::<Vec<_>>(),
        );
    }
    assert_eq!(
        acks,
        vec![
            vec![OutcomeAck::Applied, OutcomeAck::Applied],
            vec![OutcomeAck::Applied, OutcomeAck::Conflict],
            vec![OutcomeAck::Conflict, OutcomeAck::AlreadyRecorded],
        ]
    );
    let counts = s.attempt_counts().await.unwrap();
    assert_eq!(counts.get(&AttemptState::Completed), Some(&2));
    assert_eq!(counts.get(&AttemptState::Released), Some(&1));
    assert_eq!(counts.get(&AttemptState::InFlight).copied().unwrap_or(0), 0);
    let c = s.permit_counters(&p.id).await.unwrap().unwrap();
    assert_eq!(c.slots_held.get("pay"), Some(&2));
}

/// The plan PostgreSQL would run `sql` with, as `EXPLAIN` prints it.
async fn explain(c: &tokio_postgres::Client, sql: &str) -> String {
    let lines: Vec<String> = c
        .query(&format!("EXPLAIN {sql}"), &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    lines.join("\n")
}

/// The lookups of a list of ids or keys probe the unique index once per element, also
/// when the statistics know nothing of the permit (never analyzed: PostgreSQL then guesses
/// that one permit holds 0.5 % of the keys, when it holds all of them).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn list_lookups_probe_the_index_per_element_whatever_the_statistics() {
    let h = PgHarness::new().await;
    let c = raw_client(&h.url).await;
    c.batch_execute(&format!(
        "SET search_path = {s}; \
         ALTER TABLE attempts SET (autovacuum_enabled = false); \
         ALTER TABLE idempotency_keys SET (autovacuum_enabled = false); \
         INSERT INTO permits (id, token_hash, label, created_at, expires_at, retention_ms, policy) \
             VALUES ('p', 'h', 'l', 0, 1, 1, '{{}}'); \
         INSERT INTO attempts (id, permit_id, tool, key_hash, fingerprint, cost, state, created_at, \
             updated_at, lease_expires_at) \
             SELECT 'a' || g, 'p', 't', 'k' || g, 'f' || g, 0, 'completed', g, g, g \
             FROM generate_series(1, 20000) g; \
         INSERT INTO idempotency_keys (permit_id, key_hash, attempt_id) \
             SELECT 'p', 'k' || g, 'a' || g FROM generate_series(1, 20000) g; \
         SET plan_cache_mode = force_custom_plan",
        s = h.schema
    ))
    .await
    .unwrap();
    let list: Vec<String> = (1..=64).map(|i| format!("'k{i}'")).collect();
    let ids: Vec<String> = (1..=64).map(|i| format!("'a{i}'")).collect();
    let statements = [
        (
            "keys",
            attempts_by_keys_sql()
                .replace(
                    "$1::TEXT[]",
                    &format!("ARRAY[{}]", vec!["'p'"; 64].join(",")),
                )
                .replace("$2::TEXT[]", &format!("ARRAY[{}]", list.join(","))),
        ),
        (
            "lock",
            LOCK_PERMITS_OF_ATTEMPTS.replace("$1::TEXT[]", &format!("ARRAY[{}]", ids.join(","))),
        ),
        (
            "load",
            load_attempts_sql().replace("$1::TEXT[]", &format!("ARRAY[{}]", ids.join(","))),
        ),
    ];
    for (name, sql) in statements {
        let text = explain(&c, &sql).await;
        assert!(!text.contains("Seq Scan on attempts"), "{name}: {text}");
        assert!(
            !text.contains("Seq Scan on idempotency_keys"),
            "{name}: {text}"
        );
        assert!(!text.contains("Filter: (key_hash"), "{name}: {text}");
        assert!(text.contains("Nested Loop"), "{name}: {text}");
    }
}

/// The sweep's search for permits with work reads the indexes, not the tables, once the
/// tables are large and analyzed: 20,000 completed attempts under 2,000 permits, none due.
/// (Written as a join with an upper bound alone, PostgreSQL guessed a third of the attempts
/// due, read the table whole and hashed every permit.) So does its bound, the shortest
/// retention (before schema version 10, a read of every permit).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_sweeps_search_reads_the_indexes_of_large_tables() {
    let h = PgHarness::new().await;
    let c = raw_client(&h.url).await;
    let now: i64 = 1_000_000_000;
    c.batch_execute(&format!(
        "SET search_path = {s}; \
         INSERT INTO permits (id, token_hash, label, created_at, expires_at, retention_ms, policy) \
             SELECT 'p' || g, 'h' || g, 'l', 0, {now} * 2, 600000 + g, '{{}}' \
             FROM generate_series(1, 2000) g; \
         INSERT INTO attempts (id, permit_id, tool, key_hash, fingerprint, cost, state, created_at, \
             updated_at, lease_expires_at, finished_at) \
             SELECT 'a' || g, 'p' || (g % 2000 + 1), 't', 'k' || g, 'f' || g, 0, 'completed', \
             {now} - g, {now} - g, {now} - g, {now} - g \
             FROM generate_series(1, 20000) g; \
         ANALYZE permits; ANALYZE attempts; \
         SET plan_cache_mode = force_custom_plan",
        s = h.schema
    ))
    .await
    .unwrap();
    let text = explain(&c, SHORTEST_RETENTION_SQL).await;
    assert!(!text.contains("Seq Scan on permits"), "{text}");
    assert!(text.contains("permits_by_retention"), "{text}");
    let shortest: i64 = c
        .query_one(SHORTEST_RETENTION_SQL, &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(shortest, 600_001);
    let sql = due_permits_sql()
        .replace("$1", &now.to_string())
        .replace("$2", &(now - shortest).to_string());
    let text = explain(&c, &sql).await;
    assert!(!text.contains("Seq Scan on attempts"), "{text}");
    assert!(!text.contains("Seq Scan on permits"), "{text}");
    assert!(text.contains("attempts_prunable"), "{text}");
    let due = c.query(&sql, &[]).await.unwrap();
    assert!(due.is_empty(), "nothing is due yet: {due:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn migrations_are_versioned_idempotent_and_safe_when_replicas_start_together() {
    let url = database_url();
    let schema = new_schema();
    let _cleanup = Cleanup(url.clone(), schema.clone());
    let starts: Vec<_> = (0..4)
        .map(|_| {
            let o = opts(&url, &schema);
            tokio::spawn(async move { PgStore::connect(&o).await.map(|_| ()) })
        })
        .collect();
    for s in starts {
        s.await.unwrap().unwrap();
    }
    PgStore::connect(&opts(&url, &schema)).await.unwrap();
    let c = raw_client(&url).await;
    let rows = c
        .query(
            &format!("SELECT version FROM {schema}.atmost_migrations ORDER BY version"),
            &[],
        )
        .await
        .unwrap();
    let versions: Vec<i32> = rows.iter().map(|r| r.get(0)).collect();
    let known: Vec<i32> = migrations().map(|m| m.version).collect();
    assert_eq!(versions, known);
}

/// Migrations are not decisions: a replica that starts while another holds the migration
/// lock for longer than the session's timeouts (bounded by the callout timeout) waits for it under
/// `--pg-statement-timeout` and starts, instead of failing its start on `lock_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_waits_for_migrations_past_the_session_timeouts() {
    let url = database_url();
    let schema = new_schema();
    let _cleanup = Cleanup(url.clone(), schema.clone());
    PgStore::connect(&opts(&url, &schema)).await.unwrap();
    let mut holder = raw_client(&url).await;
    // The holder sits idle in its transaction while the other replica starts.
    holder
        .batch_execute("SET idle_in_transaction_session_timeout = 0")
        .await
        .unwrap();
    let tx = holder.transaction().await.unwrap();
    tx.execute(
        "SELECT pg_advisory_xact_lock($1)",
        &[&super::migrations::MIGRATION_LOCK],
    )
    .await
    .unwrap();
    let short = PgOptions {
        // Session timeouts of 90 ms (statements, locks) and 50 ms (idle); the migrations' own: 10 s.
        callout_timeout: Duration::from_millis(100),
        statement_timeout: Duration::from_secs(10),
        ..opts(&url, &schema)
    };
    let start = tokio::spawn(async move { PgStore::connect(&short).await.map(|_| ()) });
    tokio::time::sleep(Duration::from_millis(600)).await;
    if start.is_finished() {
        panic!("the start did not wait for the lock: {:?}", start.await);
    }
    tx.rollback().await.unwrap();
    start.await.unwrap().unwrap();
}

/// The `i`th call of `pay` under the permit, with a key and fingerprint of its own.
fn nth_pay(tok: &str, i: usize) -> atmost_protocol::AuthorizeRequest {
    conformance::req(
        tok,
        "pay",
        Some(&format!("k{i}")),
        &format!("f{i}"),
        json!({}),
    )
}

/// A migration as the next release might add: a column on the hottest table.
static NEXT_COLUMN: super::migrations::Migration = super::migrations::Migration {
    version: 1000,
    compatible_from: 1,
    description: "a test's column on attempts",
    sql: "ALTER TABLE attempts ADD COLUMN gave_way TEXT;",
};

/// A migration whose `ALTER TABLE` waits for a lock that a long transaction holds (here a
/// read) gives way after a short wait and tries again later, so the decisions that queue
/// behind its waiting `ALTER` go through meanwhile; it is applied once the holder ends.
/// Without giving way, every decision on the table waits for the holder (and, with the
/// session's `lock_timeout`, fails).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_migration_gives_way_to_a_long_transaction_and_decisions_go_on() {
    let h = PgHarness::new().await;
    let s = h.store().await;
    let (_p, tok) = conformance::make_permit(&*s, conformance::policy(), T0 + 3_600_000).await;
    let holder = raw_client(&h.url).await;
    holder
        .batch_execute(&format!(
            "SET idle_in_transaction_session_timeout = 0; BEGIN; SELECT count(*) FROM {}.attempts",
            h.schema
        ))
        .await
        .unwrap();
    let store = h.first.clone();
    let schema = h.schema.clone();
    let migration = tokio::spawn(async move {
        let list: Vec<&super::migrations::Migration> =
            migrations().chain(std::iter::once(&NEXT_COLUMN)).collect();
        store.migrate_to(Some(&schema), &list, 1000).await
    });
    // The migration has tried (and waits or pauses) before the decisions arrive.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for i in 0..5 {
        let r = nth_pay(&tok, i);
        let decided = tokio::time::timeout(
            Duration::from_secs(5),
            s.authorize(&r, LEASE_MS, T0, conformance::patient()),
        )
        .await;
        assert!(
            matches!(decided, Ok(Ok(_))),
            "decision {i} while the migration waited: {decided:?}"
        );
    }
    assert!(
        !migration.is_finished(),
        "applied while the holder held its lock?"
    );
    holder.batch_execute("ROLLBACK").await.unwrap();
    migration.await.unwrap().unwrap();
    let version: i32 = holder
        .query_one(
            &format!("SELECT max(version) FROM {}.atmost_migrations", h.schema),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(version, 1000);
    holder
        .batch_execute(&format!("SELECT gave_way FROM {}.attempts", h.schema))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_sweeping_at_once_move_each_attempt_once() {
    let h = PgHarness::new().await;
    let s = h.store().await;
    let (_p, tok) = conformance::make_permit(&*s, conformance::policy(), T0 + 3_600_000).await;
    for i in 0..20 {
        let r = nth_pay(&tok, i);
        s.authorize(&r, LEASE_MS, T0, conformance::patient())
            .await
            .unwrap();
    }
    let replicas = vec![s.clone(), h.handle().await, h.handle().await];
    let later = T0 + i64::try_from(LEASE_MS).unwrap();
    let sweeps: Vec<_> = replicas
        .into_iter()
        .map(|r| tokio::spawn(async move { r.sweep(later).await.unwrap() }))
        .collect();
    let mut expired = 0;
    for sw in sweeps {
        expired += sw.await.unwrap().leases_expired;
    }
    assert_eq!(expired, 20);
    let counts = s.attempt_counts().await.unwrap();
    assert_eq!(counts[&crate::model::AttemptState::Uncertain], 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unreachable_database_fails_at_start() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut o = PgOptions::new(format!("postgres://atmost@127.0.0.1:{port}/none"));
    o.connect_timeout = Duration::from_millis(500);
    o.statement_timeout = Duration::from_millis(500);
    let err = tokio::time::timeout(HANG_GUARD, PgStore::connect(&o))
        .await
        .expect("connecting to a closed port never hangs")
        .unwrap_err();
    assert!(
        matches!(err, crate::error::LedgerError::Unavailable(_)),
        "{err}"
    );
    assert!(err.to_string().contains("error connecting"), "{err}");
}

/// How long a test waits for an answer that must come: far past every deadline under test, so
/// reaching it means a hang, not a slow machine.
const HANG_GUARD: Duration = Duration::from_secs(60);

#[test]
fn outage_sqlstates_are_transient_and_others_are_not() {
    for outage in [
        "08006", "53100", "53300", "57P01", "57014", "25006", "55P03", "40001",
    ] {
        assert!(super::errors::transient_sqlstate(outage), "{outage}");
    }
    for bug in ["23505", "42P01", "42601", "22003", "XX000"] {
        assert!(!super::errors::transient_sqlstate(bug), "{bug}");
    }
}

/// The inbox's reads follow their partial indexes, as the sweeper's do.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn inbox_queries_read_their_partial_indexes() {
    let sql = crate::store::reads::ReadSql::new(super::reads::DIALECT);
    assert_plans_use(&[
        (
            "attempts_uncertain",
            "(bigint)",
            "(0)",
            sql.uncertain(0).sql,
        ),
        (
            "attempts_leased",
            "(bigint, bigint)",
            "(0, 1)",
            sql.stuck(0, 1).sql,
        ),
        ("attempts_resolved", "(bigint)", "(0)", sql.resolved(0).sql),
        ("attempts_uncertain", "", "", sql.oldest_uncertain().sql),
        ("attempts_leased", "", "", sql.awaiting_approval().sql),
    ])
    .await;
}

/// A database at version 4 (attempts and a resolution written before the inbox) migrates to
/// version 5 and reads back as the conformance suite expects.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn migration_from_version_4_keeps_attempts_and_resolutions() {
    let url = database_url();
    let schema = new_schema();
    let _cleanup = Cleanup(url.clone(), schema.clone());
    let c = raw_client(&url).await;
    c.batch_execute(&format!(
        "CREATE SCHEMA {schema}; SET search_path = {schema}; \
         CREATE TABLE atmost_migrations (version INTEGER PRIMARY KEY, description TEXT NOT NULL, \
         applied_at TIMESTAMPTZ NOT NULL DEFAULT now());"
    ))
    .await
    .unwrap();
    for m in RELEASED.iter().filter(|m| m.version <= 4) {
        c.batch_execute(m.sql).await.unwrap();
        c.execute(
            "INSERT INTO atmost_migrations (version, description) VALUES ($1, $2)",
            &[&m.version, &m.description],
        )
        .await
        .unwrap();
    }
    c.batch_execute(conformance::VERSION_4_ROWS).await.unwrap();
    let s = PgStore::connect(&opts(&url, &schema)).await.unwrap();
    let versions: Vec<(i32, i32)> = c
        .query(
            "SELECT version, compatible_from FROM atmost_migrations ORDER BY version",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    // The rows an older ledger wrote without `compatible_from` get the declared values.
    let declared: Vec<(i32, i32)> = migrations()
        .map(|m| (m.version, m.compatible_from))
        .collect();
    assert_eq!(versions, declared);
    assert_eq!(
        &versions[..6],
        [(1, 1), (2, 2), (3, 3), (4, 4), (5, 4), (6, 4)]
    );
    conformance::reads_version_4_rows(&s).await;
}

#[test]
fn the_newest_migration_is_the_schema_version() {
    let versions: Vec<i64> = migrations().map(|m| i64::from(m.version)).collect();
    let expected: Vec<i64> = (1..=SCHEMA_VERSION).collect();
    assert_eq!(versions, expected);
    assert!(migrations().all(|m| m.compatible_from <= m.version && m.compatible_from >= 1));
}

/// Records a migration a newer release would have applied (nothing else of it is needed:
/// the ledger decides from `atmost_migrations` alone).
async fn record_newer_migration(url: &str, schema: &str, version: i64, compatible_from: i64) {
    let c = raw_client(url).await;
    c.execute(
        &format!(
            "INSERT INTO {schema}.atmost_migrations (version, description, compatible_from) \
             VALUES ($1, 'a newer release', $2)"
        ),
        &[
            &i32::try_from(version).unwrap(),
            &i32::try_from(compatible_from).unwrap(),
        ],
    )
    .await
    .unwrap();
}

/// A newer release migrated the database additively (its migration still admits this
/// ledger's version): this ledger serves on it, decisions included. Once a later release
/// applied a migration that needs a ledger of its own version, this ledger refuses to
/// start, naming the versions, and writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_newer_schema_is_served_when_additive_and_refused_otherwise() {
    let url = database_url();
    let schema = new_schema();
    let _cleanup = Cleanup(url.clone(), schema.clone());
    drop(PgStore::connect(&opts(&url, &schema)).await.unwrap());
    record_newer_migration(&url, &schema, SCHEMA_VERSION + 1, SCHEMA_VERSION).await;
    let s = PgStore::connect(&opts(&url, &schema)).await.unwrap();
    let (_p, tok) = conformance::make_permit(&s, conformance::policy(), T0 + 3_600_000).await;
    let r = conformance::req(&tok, "pay", Some("k-newer"), "f", json!({}));
    assert_eq!(
        answer_name(
            s.authorize(&r, LEASE_MS, T0, conformance::patient())
                .await
                .unwrap()
                .response
        ),
        "dispatch"
    );
    drop(s);
    record_newer_migration(&url, &schema, SCHEMA_VERSION + 2, SCHEMA_VERSION + 1).await;
    let refused = PgStore::connect(&opts(&url, &schema))
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(refused, two_versions_ahead_refusal());
    let c = raw_client(&url).await;
    let rows: i64 = c
        .query_one(
            &format!("SELECT COUNT(*) FROM {schema}.atmost_migrations"),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, SCHEMA_VERSION + 2);
}

/// A group waiting for a permit's lock past its caller's deadline is answered when the
/// deadline passes, not when the lock comes, and commits nothing even once it comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_decision_waiting_past_its_deadline_is_answered_then_and_commits_nothing() {
    let h = PgHarness::new().await;
    let s = h.first.clone();
    let (p, tok) =
        conformance::make_permit(&*s, conformance::policy(), T0 + conformance::HOUR).await;
    // A first call leaves the handle its copy of the permit, so the waiting call takes the
    // one-statement path first: its statement, too, waits for the lock and commits nothing.
    let first = conformance::req(&tok, "pay", Some("k0"), "fp-0", json!({}));
    let d = s
        .authorize(&first, LEASE_MS, T0, conformance::patient())
        .await;
    conformance::dispatched(&d.unwrap().response);
    let raw = hold_permit_lock(&h, &p.id).await;
    let r = conformance::req(&tok, "pay", Some("k1"), "fp-1", json!({}));
    let started = std::time::Instant::now();
    let deadline = crate::clock::Deadline::after(Duration::from_millis(300));
    let err = tokio::time::timeout(HANG_GUARD, s.authorize(&r, LEASE_MS, T0, deadline))
        .await
        .expect("answered")
        .unwrap_err();
    let waited = started.elapsed();
    assert!(
        matches!(err, crate::error::LedgerError::DeadlinePassed(_)),
        "{err}"
    );
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(5),
        "answered after {waited:?}, the deadline was 300 ms"
    );
    assert_eq!(s.one_statement_counts().unwrap().decisions.not_applied, 1);
    raw.batch_execute("COMMIT").await.unwrap();
    // The lock is free: a waiting caller's decision goes through (on a fresh connection)...
    let d = s
        .authorize(&r, LEASE_MS, T0, conformance::patient())
        .await
        .unwrap();
    conformance::dispatched(&d.response);
    // ... and with the first it is the only attempt: the late one never committed.
    let rows = raw
        .query(
            &format!(
                "SELECT count(*) FROM {}.attempts WHERE permit_id = $1",
                h.schema
            ),
            &[&p.id],
        )
        .await
        .unwrap();
    assert_eq!(rows[0].get::<_, i64>(0), 2);
}

/// The group's COMMIT carries its budget: the server refuses it once that much time has
/// passed since the transaction began, however late the message reached it, and the
/// transaction's writes are rolled back; within its budget it commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_commit_reaching_the_server_after_its_budget_rolls_back() {
    use super::group_tx::GroupTx;
    let h = PgHarness::new().await;
    let raw = raw_client(&h.url).await;
    let table = format!("{}.guard_probe", h.schema);
    raw.batch_execute(&format!("CREATE TABLE {table} (x INT)"))
        .await
        .unwrap();
    let count = || async {
        let rows = raw
            .query(&format!("SELECT count(*) FROM {table}"), &[])
            .await
            .unwrap();
        rows[0].get::<_, i64>(0)
    };
    for (budget, commits) in [(Duration::from_millis(20), false), (HANG_GUARD, true)] {
        let tx = GroupTx::start(&h.first.pool).await.unwrap();
        tx.begin().await.unwrap();
        tx.client()
            .unwrap()
            .batch_execute(&format!("INSERT INTO {table} VALUES (1)"))
            .await
            .unwrap();
        // The COMMIT leaves later than the budget allows (as if held on the way).
        tokio::time::sleep(Duration::from_millis(50)).await;
        let committed = tx.commit(Some(budget)).await;
        match committed {
            Ok(()) => tx.committed(),
            Err(e) => assert!(
                matches!(e, crate::error::LedgerError::DeadlinePassed(_)),
                "{e}"
            ),
        }
        drop(tx);
        assert_eq!(count().await, i64::from(commits), "budget {budget:?}");
    }
}
