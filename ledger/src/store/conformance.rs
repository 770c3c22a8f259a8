//! The store conformance suite, written once over `Arc<dyn Store>`.
//!
//! A store's test module implements [`Harness`] and calls [`conformance_suite!`] once; every
//! check below then runs against it: SQLite's in `store/sqlite/tests.rs` (always built),
//! PostgreSQL's in `store/postgres/tests.rs` (built with the `postgres-tests` feature). Both
//! the decisions and the shared reads are checked through `dyn Store`.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};

use async_trait::async_trait;
use atmost_protocol::{
    AuthorizeRequest, AuthorizeResponse, Denial, DenialCode, DispatchGrant, KeyCarrier,
    KeyCarriers, Outcome, OutcomeAck, OutcomeReport,
};
use serde_json::{json, Value};

use super::{AttemptFilter, PurgeReport, Store};
use crate::clock;
use crate::credentials::{CredentialForm, CredentialUse, StoredCredential};
use crate::decide::{Notice, ResolveInput};
use crate::error::ResolveError;
use crate::keys::PUBLISHED_AFTER_RETIREMENT_MS;
use crate::model::{
    AttemptState, CostRule, GuardMode, Permit, PermitDetail, Policy, ResolutionSource,
};
use crate::token;

pub const T0: i64 = 1_800_000_000_000;
pub const MIN: i64 = 60_000;
pub const HOUR: i64 = 60 * MIN;
pub const LEASE_MS: u64 = 60_000;

/// The deadline of a caller that waits long enough for any test's decision.
pub fn patient() -> clock::Deadline {
    clock::Deadline::after(std::time::Duration::from_secs(60))
}

/// What a store under test provides.
#[async_trait]
pub trait Harness: Send + Sync {
    /// The store, empty at the start of each test.
    async fn store(&self) -> Arc<dyn Store>;
    /// Another handle on the same data (another connection, process or replica).
    async fn second_handle(&self) -> Arc<dyn Store>;
    /// Reopens the durable data after every handle was dropped.
    async fn reopen(&self) -> Arc<dyn Store>;
}

/// Instantiates every conformance test for a harness expression.
#[macro_export]
macro_rules! conformance_suite {
    ($make:expr) => {
        $crate::conformance_suite!(@tests $make;
            decision_table, expiry_scope_and_key_required, budget_reserve_spend_release,
            duplicate_guard_modes, outcome_acks, outcome_batch, race_cap_of_one_distinct_keys, race_cap_of_three_distinct_keys, race_same_key,
            race_duplicate_guard, race_budget, sweeper_expires_leases_to_uncertain, retention_tombstones_and_uncertain_kept,
            resolution, durability_across_reopen, permit_admin, input_required_continuations,
            accepted_task_handles, race_continuations, counters_match_recount_after_random_operations,
            state_counts_and_pruning_per_permit_retention, rounds_and_capabilities,
            race_report_against_lease_expiry, race_conflicting_reports_from_two_handles,
            race_resolution_against_late_report, race_revocation_against_authorization,
            race_released_key_dispatched_again, permit_limits_in_answers, inbox_reads,
            uncertain_pages, signing_keys_rotation_and_publication, race_signing_keys,
            inbox_sessions, decisions_past_their_deadline_commit_nothing, purge_of_ended_permits,
            purge_in_bounded_batches, refusals_at_the_tool, dispatch_bodies_recorded,
            credentials_versions_and_reads, race_credential_versions, attempts_keep_their_credential);
    };
    (@tests $make:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                let h = $make;
                $crate::store::conformance::$name(&h).await;
            }
        )*
    };
}

/// Every tool, no cap, no budget, no cost, the duplicate guard logging, a day's retention.
pub fn policy() -> Policy {
    Policy::builder().retention_ms(24 * HOUR).build()
}

/// Stores a permit with `policy`, returns it and its token.
pub async fn make_permit(store: &dyn Store, policy: Policy, expires_at: i64) -> (Permit, String) {
    let id = token::new_permit_id().unwrap();
    let tok = token::new_token(&id).unwrap();
    let p = Permit {
        token_hash: token::sha256_hex(&tok),
        id,
        label: "conformance".into(),
        created_at_ms: T0,
        expires_at_ms: expires_at,
        revoked_at_ms: None,
        policy,
    };
    store.create_permit(&p).await.unwrap();
    (p, tok)
}

pub fn req(tok: &str, tool: &str, key: Option<&str>, fp: &str, args: Value) -> AuthorizeRequest {
    AuthorizeRequest {
        permit_token: tok.into(),
        tool: tool.into(),
        idempotency_key: key.map(String::from),
        fingerprint: fp.into(),
        arguments: args,
        key_required: false,
        continuation: false,
        forwarded_key: None,
        forwarded_key_carriers: Default::default(),
        dispatch: None,
    }
}

/// The store's answer without its permit figures ([`permit_limits_in_answers`] checks those).
pub async fn auth(store: &dyn Store, r: &AuthorizeRequest, now: i64) -> AuthorizeResponse {
    let mut response = auth_with_limits(store, r, now).await;
    match &mut response {
        AuthorizeResponse::Dispatch { limits, .. } | AuthorizeResponse::Replay { limits, .. } => {
            *limits = None
        }
        AuthorizeResponse::Deny(d) => d.limits = None,
    }
    response
}

/// The store's whole answer.
pub async fn auth_with_limits(
    store: &dyn Store,
    r: &AuthorizeRequest,
    now: i64,
) -> AuthorizeResponse {
    let response = store
        .authorize(r, LEASE_MS, now, patient())
        .await
        .unwrap()
        .response;
    remember(&response);
    response
}

/// The round and capability of every Dispatch answer these tests saw, by attempt id: the
/// reports they send speak for the latest round, as the filter's would.
fn grants() -> &'static Mutex<HashMap<String, DispatchGrant>> {
    static GRANTS: OnceLock<Mutex<HashMap<String, DispatchGrant>>> = OnceLock::new();
    GRANTS.get_or_init(Mutex::default)
}

/// Keeps the grant of a Dispatch answer (anything else is ignored).
pub fn remember(r: &AuthorizeResponse) {
    if let AuthorizeResponse::Dispatch {
        attempt_id,
        round,
        capability,
        ..
    } = r
    {
        let grant = DispatchGrant {
            attempt_id: attempt_id.clone(),
            round: *round,
            capability: capability.clone(),
        };
        grants().lock().unwrap().insert(attempt_id.clone(), grant);
    }
}

/// A report about the latest dispatched round of attempt `id`, with its capability (a made-up
/// round 1 without one for an id never dispatched).
pub fn report_of(id: &str, outcome: Outcome) -> OutcomeReport {
    let grant = grants().lock().unwrap().get(id).cloned();
    let grant = grant.unwrap_or(DispatchGrant {
        attempt_id: id.into(),
        round: 1,
        capability: String::new(),
    });
    grant.report(outcome)
}

pub fn dispatched(r: &AuthorizeResponse) -> String {
    remember(r);
    match r {
        AuthorizeResponse::Dispatch { attempt_id, .. } => attempt_id.clone(),
        other => panic!("expected dispatch, got {other:?}"),
    }
}

fn denied(r: &AuthorizeResponse) -> DenialCode {
    match r {
        AuthorizeResponse::Deny(d) => d.code,
        other => panic!("expected a denial, got {other:?}"),
    }
}

fn denial_data(r: &AuthorizeResponse) -> serde_json::Map<String, Value> {
    match r {
        AuthorizeResponse::Deny(d) => d.data.clone(),
        other => panic!("expected a denial, got {other:?}"),
    }
}

async fn report(store: &dyn Store, id: &str, outcome: Outcome, now: i64) -> OutcomeAck {
    store
        .record_outcome(&report_of(id, outcome), now)
        .await
        .unwrap()
        .ack
}

fn completed(r: &str) -> Outcome {
    Outcome::Completed { receipt: r.into() }
}

fn released() -> Outcome {
    Outcome::Released {
        reason: "connection_refused".into(),
    }
}

fn uncertain() -> Outcome {
    Outcome::Uncertain {
        reason: "upstream_reset".into(),
    }
}

async fn calls_made(store: &dyn Store, permit: &str, tool: &str) -> u64 {
    let d = store.permit_detail(permit).await.unwrap().unwrap();
    d.usage.get(tool).map(|u| u.calls_made).unwrap_or(0)
}

async fn state_of(store: &dyn Store, attempt: &str) -> AttemptState {
    store.get_attempt(attempt).await.unwrap().unwrap().state
}

async fn receipt_kept(store: &dyn Store, attempt: &str) -> bool {
    store
        .get_attempt(attempt)
        .await
        .unwrap()
        .unwrap()
        .receipt
        .is_some()
}

pub async fn decision_table(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.max_calls.insert("pay".into(), 3);
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let now = T0;

    // nothing → dispatch; in_flight same fp → in progress; different fp → conflict.
    let a1 = dispatched(&auth(&*s, &req(&tok, "pay", Some("k1"), "A", json!({})), now).await);
    let r = auth(&*s, &req(&tok, "pay", Some("k1"), "A", json!({})), now).await;
    assert_eq!(denied(&r), DenialCode::IdempotencyInProgress);
    assert!(denial_data(&r)["retry_after"].as_i64().unwrap() >= 1);
    assert_eq!(
        denied(&auth(&*s, &req(&tok, "pay", Some("k1"), "B", json!({})), now).await),
        DenialCode::IdempotencyKeyConflict
    );

    // completed same fp → replay, no slot; different fp → conflict.
    assert_eq!(
        report(&*s, &a1, completed("R1"), now).await,
        OutcomeAck::Applied
    );
    for _ in 0..2 {
        let r = auth(&*s, &req(&tok, "pay", Some("k1"), "A", json!({})), now).await;
        assert_eq!(
            r,
            AuthorizeResponse::Replay {
                attempt_id: a1.clone(),
                receipt: "R1".into(),
                limits: None,
            }
        );
    }
    assert_eq!(s.get_attempt(&a1).await.unwrap().unwrap().replay_count, 2);
    let r = auth(&*s, &req(&tok, "pay", Some("k1"), "B", json!({})), now).await;
    assert_eq!(denied(&r), DenialCode::IdempotencyKeyConflict);
    assert!(!serde_json::to_string(&r).unwrap().contains("R1"));
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 1);

    // uncertain same fp → delivery_uncertain with the attempt id.
    let a2 = dispatched(&auth(&*s, &req(&tok, "pay", Some("k2"), "C", json!({})), now).await);
    report(&*s, &a2, uncertain(), now).await;
    let r = auth(&*s, &req(&tok, "pay", Some("k2"), "C", json!({})), now).await;
    assert_eq!(denied(&r), DenialCode::DeliveryUncertain);
    assert_eq!(denial_data(&r)["attempt_id"], json!(a2));
    assert_eq!(
        denied(&auth(&*s, &req(&tok, "pay", Some("k2"), "Z", json!({})), now).await),
        DenialCode::IdempotencyKeyConflict
    );

    // released same fp → new attempt under the same key; the key now maps to it.
    let a3 = dispatched(&auth(&*s, &req(&tok, "pay", Some("k3"), "D", json!({})), now).await);
    report(&*s, &a3, released(), now).await;
    assert_eq!(
        denied(&auth(&*s, &req(&tok, "pay", Some("k3"), "E", json!({})), now).await),
        DenialCode::IdempotencyKeyConflict
    );
    let a3b = dispatched(&auth(&*s, &req(&tok, "pay", Some("k3"), "D", json!({})), now).await);
    assert_ne!(a3, a3b);
    assert_eq!(
        denied(&auth(&*s, &req(&tok, "pay", Some("k3"), "D", json!({})), now).await),
        DenialCode::IdempotencyInProgress
    );
    assert_eq!(state_of(&*s, &a3).await, AttemptState::Released);

    // slots: completed + uncertain + in_flight = 3 = cap.
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 3);
    let r = auth(&*s, &req(&tok, "pay", Some("k4"), "F", json!({})), now).await;
    assert_eq!(denied(&r), DenialCode::PermitMaxCallsExceeded);
    let d = denial_data(&r);
    assert_eq!(
        (
            d["tool"].clone(),
            d["limit"].clone(),
            d["calls_made"].clone()
        ),
        (json!("pay"), json!(3), json!(3))
    );
    // Another tool has no cap here; the key scope is the permit.
    dispatched(&auth(&*s, &req(&tok, "search", Some("k4"), "G", json!({})), now).await);
    // Same key and same fp still replay at the cap.
    assert!(matches!(
        auth(&*s, &req(&tok, "pay", Some("k1"), "A", json!({})), now).await,
        AuthorizeResponse::Replay { .. }
    ));

    // Keys are scoped to the permit: another permit's k1 is new.
    let (_p2, tok2) = make_permit(&*s, policy(), T0 + HOUR).await;
    dispatched(&auth(&*s, &req(&tok2, "pay", Some("k1"), "A", json!({})), now).await);

    // unknown token, wrong secret, revoked → permit_invalid.
    assert_eq!(
        denied(
            &auth(
                &*s,
                &req(
                    "atmp_pmt_nope_00000000000000000000000000000000",
                    "pay",
                    None,
                    "A",
                    json!({})
                ),
                now
            )
            .await
        ),
        DenialCode::PermitInvalid
    );
    let wrong = format!("atmp_{}_{}", p.id, "0".repeat(64));
    assert_eq!(
        denied(&auth(&*s, &req(&wrong, "pay", None, "A", json!({})), now).await),
        DenialCode::PermitInvalid
    );
    s.revoke_permit(&p.id, now).await.unwrap();
    assert_eq!(
        denied(&auth(&*s, &req(&tok, "pay", Some("k1"), "A", json!({})), now).await),
        DenialCode::PermitInvalid
    );
}

pub async fn expiry_scope_and_key_required(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.tools = vec!["pay".into()];
    let (_p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    assert_eq!(
        denied(&auth(&*s, &req(&tok, "search", None, "A", json!({})), T0).await),
        DenialCode::PermitToolNotAllowed
    );
    let mut r = req(&tok, "pay", None, "A", json!({}));
    r.key_required = true;
    assert_eq!(
        denied(&auth(&*s, &r, T0).await),
        DenialCode::IdempotencyKeyRequired
    );
    r.idempotency_key = Some("k".into());
    let a = dispatched(&auth(&*s, &r, T0).await);
    report(&*s, &a, completed("R"), T0).await;
    // After expiry: new calls denied, the completed key still replays.
    let later = T0 + HOUR;
    assert_eq!(
        denied(&auth(&*s, &req(&tok, "pay", Some("k2"), "B", json!({})), later).await),
        DenialCode::PermitExpired
    );
    assert!(matches!(
        auth(&*s, &r, later).await,
        AuthorizeResponse::Replay { .. }
    ));
}

pub async fn budget_reserve_spend_release(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.budget = Some(10);
    pol.rules
        .cost
        .insert("pay".into(), CostRule::Pointer("/amount".into()));
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let a = dispatched(
        &auth(
            &*s,
            &req(&tok, "pay", Some("a"), "A", json!({"amount": 6})),
            T0,
        )
        .await,
    );
    let r = auth(
        &*s,
        &req(&tok, "pay", Some("b"), "B", json!({"amount": 5})),
        T0,
    )
    .await;
    assert_eq!(denied(&r), DenialCode::PermitBudgetExceeded);
    let d = denial_data(&r);
    assert_eq!(
        (
            d["budget"].clone(),
            d["spent"].clone(),
            d["reserved"].clone(),
            d["cost"].clone()
        ),
        (json!(10), json!(0), json!(6), json!(5))
    );
    let r = auth(
        &*s,
        &req(&tok, "pay", Some("c"), "C", json!({"amount": "x"})),
        T0,
    )
    .await;
    assert_eq!(denial_data(&r)["error"], json!("cost_unresolvable"));

    // Released: budget back.
    report(&*s, &a, released(), T0).await;
    let b = dispatched(
        &auth(
            &*s,
            &req(&tok, "pay", Some("b"), "B", json!({"amount": 5})),
            T0,
        )
        .await,
    );
    let det = s.permit_detail(&p.id).await.unwrap().unwrap();
    assert_eq!((det.budget.spent, det.budget.reserved), (0, 5));
    // Completed: reserved → spent.
    report(&*s, &b, completed("R"), T0).await;
    let det = s.permit_detail(&p.id).await.unwrap().unwrap();
    assert_eq!((det.budget.spent, det.budget.reserved), (5, 0));
    // Uncertain: counts as spent.
    let c = dispatched(
        &auth(
            &*s,
            &req(&tok, "pay", Some("c"), "C", json!({"amount": 4})),
            T0,
        )
        .await,
    );
    report(&*s, &c, uncertain(), T0).await;
    let det = s.permit_detail(&p.id).await.unwrap().unwrap();
    assert_eq!((det.budget.spent, det.budget.reserved), (9, 0));
    assert_eq!(
        denied(
            &auth(
                &*s,
                &req(&tok, "pay", Some("d"), "D", json!({"amount": 2})),
                T0
            )
            .await
        ),
        DenialCode::PermitBudgetExceeded
    );
    // Resolved not executed: budget back.
    s.resolve_attempt(
        &c,
        &ResolveInput {
            executed: false,
            receipt: None,
            note: None,
            by: "t".into(),
            source: Default::default(),
        },
        T0,
    )
    .await
    .unwrap();
    dispatched(
        &auth(
            &*s,
            &req(&tok, "pay", Some("d"), "D", json!({"amount": 2})),
            T0,
        )
        .await,
    );
}

pub async fn duplicate_guard_modes(h: &dyn Harness) {
    let s = h.store().await;
    for mode in [GuardMode::Off, GuardMode::Log, GuardMode::Enforce] {
        let mut pol = policy();
        pol.rules.duplicate_guard = mode;
        let (_p, tok) = make_permit(&*s, pol, T0 + 100 * HOUR).await;
        let a = dispatched(&auth(&*s, &req(&tok, "pay", Some("k1"), "X", json!({})), T0).await);
        report(&*s, &a, completed("R"), T0).await;
        let d = s
            .authorize(
                &req(&tok, "pay", Some("k2"), "X", json!({})),
                LEASE_MS,
                T0 + 1,
                patient(),
            )
            .await
            .unwrap();
        match mode {
            GuardMode::Off => {
                dispatched(&d.response);
                assert!(d.notices.is_empty());
            }
            GuardMode::Log => {
                dispatched(&d.response);
                assert_eq!(
                    d.notices,
                    vec![Notice::DuplicateLogged {
                        earlier_attempt_id: a.clone()
                    }]
                );
            }
            GuardMode::Enforce => {
                assert_eq!(denied(&d.response), DenialCode::DuplicateRequestSuspected);
                // No key at all is a different key too; another fingerprint passes.
                assert_eq!(
                    denied(&auth(&*s, &req(&tok, "pay", None, "X", json!({})), T0 + 1).await),
                    DenialCode::DuplicateRequestSuspected
                );
                dispatched(&auth(&*s, &req(&tok, "pay", Some("k3"), "Y", json!({})), T0 + 1).await);
                // A released attempt does not count; outside the retention window neither.
                let r = dispatched(
                    &auth(&*s, &req(&tok, "pay", Some("k4"), "W", json!({})), T0 + 1).await,
                );
                report(&*s, &r, released(), T0 + 1).await;
                dispatched(&auth(&*s, &req(&tok, "pay", Some("k5"), "W", json!({})), T0 + 2).await);
                dispatched(
                    &auth(
                        &*s,
                        &req(&tok, "pay", Some("k6"), "X", json!({})),
                        T0 + 25 * HOUR,
                    )
                    .await,
                );
            }
        }
    }
}

pub async fn outcome_acks(h: &dyn Harness) {
    let s = h.store().await;
    let (_p, tok) = make_permit(&*s, policy(), T0 + HOUR).await;
    let a = dispatched(&auth(&*s, &req(&tok, "pay", None, "A", json!({})), T0).await);
    assert_eq!(
        report(&*s, &a, completed("R"), T0).await,
        OutcomeAck::Applied
    );
    assert_eq!(
        report(&*s, &a, completed("R"), T0).await,
        OutcomeAck::AlreadyRecorded
    );
    assert_eq!(report(&*s, &a, released(), T0).await, OutcomeAck::Conflict);
    assert_eq!(report(&*s, &a, uncertain(), T0).await, OutcomeAck::Conflict);
    assert_eq!(state_of(&*s, &a).await, AttemptState::Completed);
    assert_eq!(
        report(&*s, "att_unknown", released(), T0).await,
        OutcomeAck::UnknownAttempt
    );
    let b = dispatched(&auth(&*s, &req(&tok, "pay", None, "B", json!({})), T0).await);
    assert_eq!(report(&*s, &b, released(), T0).await, OutcomeAck::Applied);
    assert_eq!(
        report(&*s, &b, released(), T0).await,
        OutcomeAck::AlreadyRecorded
    );
    assert_eq!(
        report(&*s, &b, completed("late"), T0).await,
        OutcomeAck::Conflict
    );
    let got = s.get_attempt(&b).await.unwrap().unwrap();
    assert_eq!((got.state, got.receipt), (AttemptState::Released, None));
}

/// One batch of reports: applied in order, each attempt written once with its last state.
pub async fn outcome_batch(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.budget = Some(100);
    pol.rules.cost_default = 2;
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let a = dispatched(&auth(&*s, &req(&tok, "pay", Some("a"), "A", json!({})), T0).await);
    let b = dispatched(&auth(&*s, &req(&tok, "pay", Some("b"), "B", json!({})), T0).await);
    let c = dispatched(&auth(&*s, &req(&tok, "pay", Some("c"), "C", json!({})), T0).await);
    let batch = [
        (a.as_str(), completed("RA")),
        (b.as_str(), released()),
        (a.as_str(), completed("RA")),
        ("att_unknown", completed("X")),
        (c.as_str(), input_required("Q")),
        (b.as_str(), completed("late")),
    ]
    .into_iter()
    .map(|(id, outcome)| report_of(id, outcome))
    .collect::<Vec<_>>();
    let acks: Vec<OutcomeAck> = s
        .record_outcomes(&batch, T0 + 5)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.ack)
        .collect();
    assert_eq!(
        acks,
        vec![
            OutcomeAck::Applied,
            OutcomeAck::Applied,
            OutcomeAck::AlreadyRecorded,
            OutcomeAck::UnknownAttempt,
            OutcomeAck::Applied,
            OutcomeAck::Conflict,
        ]
    );
    let got = |id: String| {
        let s = s.clone();
        async move { s.get_attempt(&id).await.unwrap().unwrap() }
    };
    let (ga, gb, gc) = (got(a).await, got(b).await, got(c).await);
    assert_eq!(
        (ga.state, ga.receipt.as_deref(), ga.finished_at_ms),
        (AttemptState::Completed, Some("RA"), Some(T0 + 5))
    );
    assert_eq!(
        (gb.state, gb.receipt, gb.reason.as_deref()),
        (AttemptState::Released, None, Some("connection_refused"))
    );
    assert_eq!(
        (gc.state, gc.receipt.as_deref()),
        (AttemptState::AwaitingInput, Some("Q"))
    );
    let det = s.permit_detail(&p.id).await.unwrap().unwrap();
    // a spent, c still reserved, b given back.
    assert_eq!((det.budget.spent, det.budget.reserved), (2, 2));
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 2);
}

/// Runs `n` authorize calls at once, split over two handles of the same data.
async fn race(h: &dyn Harness, reqs: Vec<AuthorizeRequest>) -> Vec<AuthorizeResponse> {
    let s1 = h.store().await;
    let s2 = h.second_handle().await;
    let barrier = Arc::new(tokio::sync::Barrier::new(reqs.len()));
    let mut tasks = Vec::new();
    for (i, r) in reqs.into_iter().enumerate() {
        let s = if i % 2 == 0 { s1.clone() } else { s2.clone() };
        let b = barrier.clone();
        tasks.push(tokio::spawn(async move {
            b.wait().await;
            s.authorize(&r, LEASE_MS, T0, patient())
                .await
                .unwrap()
                .response
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

fn count(rs: &[AuthorizeResponse], code: Option<DenialCode>) -> usize {
    rs.iter()
        .filter(|r| match (r, code) {
            (AuthorizeResponse::Dispatch { .. }, None) => true,
            (AuthorizeResponse::Deny(d), Some(c)) => d.code == c,
            _ => false,
        })
        .count()
}

/// `n` calls with distinct keys race for a tool capped at `cap`: exactly `cap` go through.
async fn race_cap(h: &dyn Harness, cap: u64) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.max_calls.insert("pay".into(), cap);
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let n = 32;
    let reqs = (0..n)
        .map(|i| {
            req(
                &tok,
                "pay",
                Some(&format!("key-{i}")),
                &format!("fp-{i}"),
                json!({}),
            )
        })
        .collect();
    let rs = race(h, reqs).await;
    let cap = usize::try_from(cap).unwrap();
    assert_eq!(count(&rs, None), cap, "{rs:?}");
    assert_eq!(
        count(&rs, Some(DenialCode::PermitMaxCallsExceeded)),
        n - cap
    );
    assert_eq!(calls_made(&*s, &p.id, "pay").await, cap as u64);
}

pub async fn race_cap_of_one_distinct_keys(h: &dyn Harness) {
    race_cap(h, 1).await;
}

/// Several slots: a store that decides queued calls together must count the slots taken
/// earlier in the same group, not only those already written.
pub async fn race_cap_of_three_distinct_keys(h: &dyn Harness) {
    race_cap(h, 3).await;
}

pub async fn race_same_key(h: &dyn Harness) {
    let s = h.store().await;
    let (p, tok) = make_permit(&*s, policy(), T0 + HOUR).await;
    let reqs = (0..32)
        .map(|_| req(&tok, "pay", Some("one-key"), "A", json!({})))
        .collect();
    let rs = race(h, reqs).await;
    assert_eq!(count(&rs, None), 1, "{rs:?}");
    assert_eq!(count(&rs, Some(DenialCode::IdempotencyInProgress)), 31);
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 1);
}

/// Calls with distinct keys and one fingerprint race under the enforcing duplicate guard: the
/// first goes through, every later one is the duplicate of a call in flight.
pub async fn race_duplicate_guard(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.duplicate_guard = GuardMode::Enforce;
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let reqs = (0..32)
        .map(|i| req(&tok, "pay", Some(&format!("key-{i}")), "same", json!({})))
        .collect();
    let rs = race(h, reqs).await;
    assert_eq!(count(&rs, None), 1, "{rs:?}");
    assert_eq!(count(&rs, Some(DenialCode::DuplicateRequestSuspected)), 31);
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 1);
}

pub async fn race_budget(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.budget = Some(10);
    pol.rules.cost_default = 3;
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let reqs = (0..32)
        .map(|i| {
            req(
                &tok,
                "pay",
                Some(&format!("key-{i}")),
                &format!("fp-{i}"),
                json!({}),
            )
        })
        .collect();
    let rs = race(h, reqs).await;
    assert_eq!(count(&rs, None), 3, "{rs:?}");
    assert_eq!(count(&rs, Some(DenialCode::PermitBudgetExceeded)), 29);
    let det = s.permit_detail(&p.id).await.unwrap().unwrap();
    assert_eq!(det.budget.reserved, 9);
}

pub async fn sweeper_expires_leases_to_uncertain(h: &dyn Harness) {
    let s = h.store().await;
    let (p, tok) = make_permit(&*s, policy(), T0 + HOUR).await;
    let a = dispatched(&auth(&*s, &req(&tok, "pay", Some("k"), "A", json!({})), T0).await);
    let b = dispatched(&auth(&*s, &req(&tok, "pay", Some("k2"), "B", json!({})), T0).await);
    report(&*s, &b, completed("R"), T0).await;
    let lease = i64::try_from(LEASE_MS).unwrap();
    assert_eq!(s.sweep(T0 + lease - 1).await.unwrap().leases_expired, 0);
    assert_eq!(state_of(&*s, &a).await, AttemptState::InFlight);
    assert_eq!(s.sweep(T0 + lease).await.unwrap().leases_expired, 1);
    let got = s.get_attempt(&a).await.unwrap().unwrap();
    assert_eq!(got.state, AttemptState::Uncertain);
    assert_eq!(
        got.reason.as_deref(),
        Some(crate::decide::LEASE_EXPIRED_REASON)
    );
    assert_eq!(state_of(&*s, &b).await, AttemptState::Completed);
    // A late report does not change it; the same key gets the same unknown; the slot stays.
    assert_eq!(
        report(&*s, &a, completed("late"), T0 + lease).await,
        OutcomeAck::Conflict
    );
    assert_eq!(
        report(&*s, &a, released(), T0 + lease).await,
        OutcomeAck::Conflict
    );
    assert_eq!(
        denied(
            &auth(
                &*s,
                &req(&tok, "pay", Some("k"), "A", json!({})),
                T0 + lease
            )
            .await
        ),
        DenialCode::DeliveryUncertain
    );
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 2);
    assert_eq!(s.sweep(T0 + 10 * lease).await.unwrap().leases_expired, 0);
    let listed = s
        .list_attempts(&AttemptFilter {
            state: Some(AttemptState::Uncertain),
            permit_id: Some(p.id.clone()),
            limit: None,
        })
        .await
        .unwrap();
    assert_eq!(
        listed.iter().map(|x| x.id.clone()).collect::<Vec<_>>(),
        vec![a]
    );
}

pub async fn retention_tombstones_and_uncertain_kept(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.retention_ms = HOUR;
    pol.rules.max_calls.insert("pay".into(), 5);
    let (p, tok) = make_permit(&*s, pol, T0 + 100 * HOUR).await;
    let a = dispatched(&auth(&*s, &req(&tok, "pay", Some("done"), "A", json!({})), T0).await);
    report(&*s, &a, completed("R"), T0).await;
    let u = dispatched(&auth(&*s, &req(&tok, "pay", Some("unk"), "U", json!({})), T0).await);
    report(&*s, &u, uncertain(), T0).await;

    let r = s.sweep(T0 + HOUR - 1).await.unwrap();
    assert_eq!(r.receipts_pruned, 0);
    assert!(matches!(
        auth(
            &*s,
            &req(&tok, "pay", Some("done"), "A", json!({})),
            T0 + HOUR - 1
        )
        .await,
        AuthorizeResponse::Replay { .. }
    ));
    let r = s.sweep(T0 + HOUR).await.unwrap();
    assert_eq!(r.receipts_pruned, 1);
    let t = s.get_attempt(&a).await.unwrap().unwrap();
    assert_eq!(
        (t.state, t.receipt.is_none(), t.pruned_at_ms.is_some()),
        (AttemptState::Completed, true, true)
    );
    for fp in ["A", "other"] {
        assert_eq!(
            denied(
                &auth(
                    &*s,
                    &req(&tok, "pay", Some("done"), fp, json!({})),
                    T0 + HOUR
                )
                .await
            ),
            DenialCode::IdempotencyKeyExpired
        );
    }
    // The tombstone keeps its slot; the uncertain attempt is never pruned.
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 2);
    assert_eq!(s.sweep(T0 + 1000 * HOUR).await.unwrap().receipts_pruned, 0);
    assert_eq!(state_of(&*s, &u).await, AttemptState::Uncertain);
    assert_eq!(
        denied(
            &auth(
                &*s,
                &req(&tok, "pay", Some("unk"), "U", json!({})),
                T0 + 99 * HOUR
            )
            .await
        ),
        DenialCode::DeliveryUncertain
    );
}

pub async fn resolution(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.max_calls.insert("pay".into(), 2);
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let a = dispatched(&auth(&*s, &req(&tok, "pay", Some("a"), "A", json!({})), T0).await);
    let b = dispatched(&auth(&*s, &req(&tok, "pay", Some("b"), "B", json!({})), T0).await);
    report(&*s, &a, uncertain(), T0).await;
    report(&*s, &b, uncertain(), T0).await;
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 2);

    let exec = ResolveInput {
        executed: true,
        receipt: Some("PROVIDER-RECEIPT".into()),
        note: Some("found charge ch_1".into()),
        by: "alice".into(),
        source: Default::default(),
    };
    let got = s.resolve_attempt(&a, &exec, T0 + 5).await.unwrap();
    assert_eq!(got.state, AttemptState::ResolvedExecuted);
    let res = got.resolution.clone().unwrap();
    assert_eq!(
        (res.by.as_str(), res.at_ms, res.note.as_deref()),
        ("alice", T0 + 5, Some("found charge ch_1"))
    );
    // Stored, not just returned.
    assert_eq!(s.get_attempt(&a).await.unwrap().unwrap(), got);
    assert_eq!(
        auth(&*s, &req(&tok, "pay", Some("a"), "A", json!({})), T0 + 6).await,
        AuthorizeResponse::Replay {
            attempt_id: a.clone(),
            receipt: "PROVIDER-RECEIPT".into(),
            limits: None,
        }
    );
    assert!(matches!(
        s.resolve_attempt(&a, &exec, T0).await,
        Err(ResolveError::NotUncertain(AttemptState::ResolvedExecuted))
    ));
    assert!(matches!(
        s.resolve_attempt("att_nope", &exec, T0).await,
        Err(ResolveError::UnknownAttempt)
    ));
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 2);

    let not = ResolveInput {
        executed: false,
        receipt: None,
        note: None,
        by: "bob".into(),
        source: Default::default(),
    };
    s.resolve_attempt(&b, &not, T0 + 7).await.unwrap();
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 1);
    // The same key may now try again.
    let b2 = dispatched(&auth(&*s, &req(&tok, "pay", Some("b"), "B", json!({})), T0 + 8).await);
    assert_ne!(b, b2);
    // Resolving an in_flight attempt is refused.
    assert!(matches!(
        s.resolve_attempt(&b2, &not, T0).await,
        Err(ResolveError::NotUncertain(AttemptState::InFlight))
    ));
    let det = s.permit_detail(&p.id).await.unwrap().unwrap();
    assert_eq!(
        det.attempts_by_state.get(&AttemptState::ResolvedExecuted),
        Some(&1)
    );
    assert_eq!(
        det.attempts_by_state
            .get(&AttemptState::ResolvedNotExecuted),
        Some(&1)
    );
    assert_eq!(det.attempts_by_state.get(&AttemptState::InFlight), Some(&1));
}

pub async fn durability_across_reopen(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.max_calls.insert("pay".into(), 2);
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let a = dispatched(&auth(&*s, &req(&tok, "pay", Some("a"), "A", json!({})), T0).await);
    report(&*s, &a, completed("R"), T0).await;
    let b = dispatched(&auth(&*s, &req(&tok, "pay", Some("b"), "B", json!({})), T0).await);
    drop(s);
    let s = h.reopen().await;
    assert_eq!(
        auth(&*s, &req(&tok, "pay", Some("a"), "A", json!({})), T0).await,
        AuthorizeResponse::Replay {
            attempt_id: a,
            receipt: "R".into(),
            limits: None,
        }
    );
    assert_eq!(state_of(&*s, &b).await, AttemptState::InFlight);
    assert_eq!(
        denied(&auth(&*s, &req(&tok, "pay", Some("c"), "C", json!({})), T0).await),
        DenialCode::PermitMaxCallsExceeded
    );
    assert_eq!(s.list_permits().await.unwrap().len(), 1);
    assert_eq!(s.permit_detail(&p.id).await.unwrap().unwrap().permit, p);
}

pub async fn permit_admin(h: &dyn Harness) {
    let s = h.store().await;
    s.ping().await.unwrap();
    let mut pol = policy();
    pol.rules.max_calls.insert("pay".into(), 1);
    pol.rules
        .cost
        .insert("pay".into(), CostRule::Pointer("/a".into()));
    pol.rules.budget = Some(7);
    let (p1, _) = make_permit(&*s, pol, T0 + HOUR).await;
    let (p2, _) = make_permit(&*s, policy(), T0 + HOUR).await;
    let list = s.list_permits().await.unwrap();
    assert_eq!(list.len(), 2);
    assert!(list.contains(&p1) && list.contains(&p2));
    let d = s.permit_detail(&p1.id).await.unwrap().unwrap();
    assert_eq!(d.permit, p1);
    assert_eq!(d.usage.get("pay").map(|u| u.calls_made), Some(0));
    assert!(s.permit_detail("pmt_nope").await.unwrap().is_none());
    assert_eq!(s.get_permit(&p2.id).await.unwrap(), Some(p2.clone()));
    assert!(s.get_permit("pmt_nope").await.unwrap().is_none());
    let r = s.revoke_permit(&p1.id, T0 + 1).await.unwrap().unwrap();
    assert_eq!(r.revoked_at_ms, Some(T0 + 1));
    let r = s.revoke_permit(&p1.id, T0 + 2).await.unwrap().unwrap();
    assert_eq!(
        r.revoked_at_ms,
        Some(T0 + 1),
        "revoking twice keeps the first time"
    );
    assert!(s.revoke_permit("pmt_nope", T0).await.unwrap().is_none());
    let counts = s.attempt_counts().await.unwrap();
    assert_eq!(counts.values().sum::<u64>(), 0);
}

/// The per-state counts follow every transition, and the pruner finds each permit's receipts
/// when that permit's retention has run out (not the shortest one's).
pub async fn state_counts_and_pruning_per_permit_retention(h: &dyn Harness) {
    let s = h.store().await;
    let count =
        |c: &std::collections::BTreeMap<AttemptState, u64>, st| c.get(&st).copied().unwrap_or(0);
    let mut short = policy();
    short.retention_ms = HOUR;
    let mut long = policy();
    long.retention_ms = 10 * HOUR;
    let (_, tok_short) = make_permit(&*s, short, T0 + 100 * HOUR).await;
    let (_, tok_long) = make_permit(&*s, long, T0 + 100 * HOUR).await;
    let a = dispatched(&auth(&*s, &req(&tok_short, "pay", Some("s"), "S", json!({})), T0).await);
    let b = dispatched(&auth(&*s, &req(&tok_long, "pay", Some("l"), "L", json!({})), T0).await);
    let c = dispatched(&auth(&*s, &req(&tok_long, "pay", Some("u"), "U", json!({})), T0).await);
    let counts = s.attempt_counts().await.unwrap();
    assert_eq!(count(&counts, AttemptState::InFlight), 3);
    report(&*s, &a, completed("RA"), T0).await;
    report(&*s, &b, completed("RB"), T0).await;
    let counts = s.attempt_counts().await.unwrap();
    assert_eq!(
        (
            count(&counts, AttemptState::InFlight),
            count(&counts, AttemptState::Completed)
        ),
        (1, 2)
    );
    // `c` never reports: its lease runs out and the sweeper makes it uncertain.
    let r = s.sweep(T0 + HOUR).await.unwrap();
    assert_eq!((r.leases_expired, r.receipts_pruned), (1, 1));
    assert_eq!(state_of(&*s, &c).await, AttemptState::Uncertain);
    assert!(!receipt_kept(&*s, &a).await);
    assert!(receipt_kept(&*s, &b).await);
    assert_eq!(
        s.sweep(T0 + 10 * HOUR - 1).await.unwrap().receipts_pruned,
        0
    );
    assert_eq!(s.sweep(T0 + 10 * HOUR).await.unwrap().receipts_pruned, 1);
    assert!(!receipt_kept(&*s, &b).await);
    let counts = s.attempt_counts().await.unwrap();
    assert_eq!(
        (
            count(&counts, AttemptState::InFlight),
            count(&counts, AttemptState::Completed),
            count(&counts, AttemptState::Uncertain),
        ),
        (0, 2, 1)
    );
    assert_eq!(counts.values().sum::<u64>(), 3);
}

fn continued(mut r: AuthorizeRequest) -> AuthorizeRequest {
    r.continuation = true;
    r
}

fn input_required(r: &str) -> Outcome {
    Outcome::InputRequired { receipt: r.into() }
}

/// `input_required` keeps the slot and reserved budget; the continuation with the same key
/// dispatches again under the same attempt, even at the cap; the sweeper turns an
/// abandoned one `uncertain`.
pub async fn input_required_continuations(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.max_calls.insert("pay".into(), 1);
    pol.rules.budget = Some(100);
    pol.rules.cost.insert("pay".into(), CostRule::Fixed(30));
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let now = T0;
    let first = req(&tok, "pay", Some("k1"), "A", json!({}));
    let a = dispatched(&auth(&*s, &first, now).await);
    assert_eq!(
        report(&*s, &a, input_required("ASK"), now + 1000).await,
        OutcomeAck::Applied
    );
    let att = s.get_attempt(&a).await.unwrap().unwrap();
    assert_eq!(att.state, AttemptState::AwaitingInput);
    assert_eq!(att.lease_expires_at_ms, now + 1000 + LEASE_MS as i64);
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 1);
    let d = s.permit_detail(&p.id).await.unwrap().unwrap();
    assert_eq!((d.budget.reserved, d.budget.spent), (30, 0));
    assert_eq!(
        d.attempts_by_state.get(&AttemptState::AwaitingInput),
        Some(&1)
    );
    // Without the continuation flag: in progress; other arguments: conflict; another key: cap.
    let r = auth(&*s, &first, now + 2000).await;
    assert_eq!(denied(&r), DenialCode::IdempotencyInProgress);
    assert_eq!(denial_data(&r)["awaiting_input"], json!(true));
    assert_eq!(
        denied(
            &auth(
                &*s,
                &continued(req(&tok, "pay", Some("k1"), "B", json!({}))),
                now
            )
            .await
        ),
        DenialCode::IdempotencyKeyConflict
    );
    assert_eq!(
        denied(
            &auth(
                &*s,
                &continued(req(&tok, "pay", Some("k2"), "A", json!({}))),
                now
            )
            .await
        ),
        DenialCode::PermitMaxCallsExceeded
    );
    // The continuation: same attempt, no new slot, no new budget.
    let again = dispatched(&auth(&*s, &continued(first.clone()), now + 3000).await);
    assert_eq!(again, a);
    assert_eq!(state_of(&*s, &a).await, AttemptState::InFlight);
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 1);
    let d = s.permit_detail(&p.id).await.unwrap().unwrap();
    assert_eq!((d.budget.reserved, d.budget.spent), (30, 0));
    assert_eq!(
        s.list_attempts(&AttemptFilter {
            permit_id: Some(p.id.clone()),
            ..AttemptFilter::default()
        })
        .await
        .unwrap()
        .len(),
        1
    );
    // While it runs again, a second continuation is in progress.
    assert_eq!(
        denied(&auth(&*s, &continued(first.clone()), now + 3500).await),
        DenialCode::IdempotencyInProgress
    );
    // Done: replay, budget spent once.
    assert_eq!(
        report(&*s, &a, completed("FINAL"), now + 4000).await,
        OutcomeAck::Applied
    );
    assert_eq!(
        auth(&*s, &continued(first.clone()), now + 5000).await,
        AuthorizeResponse::Replay {
            attempt_id: a.clone(),
            receipt: "FINAL".into(),
            limits: None,
        }
    );
    let d = s.permit_detail(&p.id).await.unwrap().unwrap();
    assert_eq!((d.budget.reserved, d.budget.spent), (0, 30));

    // Abandoned: the sweeper turns it uncertain after the renewed lease, never released.
    let (_p2, tok2) = make_permit(&*s, policy(), T0 + 10 * HOUR).await;
    let r2 = req(&tok2, "pay", Some("k9"), "Z", json!({}));
    let b = dispatched(&auth(&*s, &r2, now).await);
    report(&*s, &b, input_required("ASK"), now + 10_000).await;
    s.sweep(now + LEASE_MS as i64 + 5_000).await.unwrap();
    assert_eq!(state_of(&*s, &b).await, AttemptState::AwaitingInput);
    let swept = s.sweep(now + 10_000 + LEASE_MS as i64).await.unwrap();
    assert_eq!(swept.leases_expired, 1);
    let att = s.get_attempt(&b).await.unwrap().unwrap();
    assert_eq!(att.state, AttemptState::Uncertain);
    assert_eq!(
        att.reason.as_deref(),
        Some(crate::decide::INPUT_ABANDONED_REASON)
    );
    assert_eq!(
        denied(&auth(&*s, &continued(r2), now + 20 * MIN).await),
        DenialCode::DeliveryUncertain
    );
}

/// A task handle is recorded `accepted`: slot kept, budget spent, the handle replayed.
pub async fn accepted_task_handles(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.max_calls.insert("job".into(), 1);
    pol.rules.budget = Some(100);
    pol.rules.cost.insert("job".into(), CostRule::Fixed(40));
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let now = T0;
    let r = req(&tok, "job", Some("k1"), "A", json!({}));
    let a = dispatched(&auth(&*s, &r, now).await);
    assert_eq!(
        report(
            &*s,
            &a,
            Outcome::Accepted {
                receipt: "HANDLE".into()
            },
            now
        )
        .await,
        OutcomeAck::Applied
    );
    assert_eq!(state_of(&*s, &a).await, AttemptState::Accepted);
    assert_eq!(
        auth(&*s, &r, now).await,
        AuthorizeResponse::Replay {
            attempt_id: a.clone(),
            receipt: "HANDLE".into(),
            limits: None,
        }
    );
    assert_eq!(calls_made(&*s, &p.id, "job").await, 1);
    let d = s.permit_detail(&p.id).await.unwrap().unwrap();
    assert_eq!((d.budget.reserved, d.budget.spent), (0, 40));
    assert_eq!(
        denied(&auth(&*s, &req(&tok, "job", Some("k2"), "B", json!({})), now).await),
        DenialCode::PermitMaxCallsExceeded
    );
    // A late `completed` for the same attempt does not overwrite the handle.
    assert_eq!(
        report(&*s, &a, completed("LATE"), now).await,
        OutcomeAck::Conflict
    );
    // Accepted receipts are pruned past retention like completed ones.
    let swept = s.sweep(now + 25 * HOUR).await.unwrap();
    assert_eq!(swept.receipts_pruned, 1);
    assert_eq!(
        denied(&auth(&*s, &r, now + 25 * HOUR).await),
        DenialCode::IdempotencyKeyExpired
    );
}

/// Concurrent continuations of one awaiting attempt: exactly one dispatches.
pub async fn race_continuations(h: &dyn Harness) {
    let s = h.store().await;
    let (_p, tok) = make_permit(&*s, policy(), T0 + HOUR).await;
    let first = req(&tok, "pay", Some("k1"), "A", json!({}));
    let a = dispatched(&auth(&*s, &first, T0).await);
    report(&*s, &a, input_required("ASK"), T0).await;
    let rs = race(h, (0..16).map(|_| continued(first.clone())).collect()).await;
    assert_eq!(count(&rs, None), 1, "{rs:?}");
    assert_eq!(count(&rs, Some(DenialCode::IdempotencyInProgress)), 15);
}

/// Asserts that the permit's stored O(1) counters (slots held per tool, reserved and spent
/// budget) equal a recount from its attempts; returns the recount.
pub async fn counters_match_recount(store: &dyn Store, permit_id: &str) -> PermitDetail {
    let detail = store.permit_detail(permit_id).await.unwrap().unwrap();
    let counters = store.permit_counters(permit_id).await.unwrap().unwrap();
    let recount: BTreeMap<String, i64> = detail
        .usage
        .iter()
        .filter(|(_, u)| u.calls_made > 0)
        .map(|(t, u)| (t.clone(), u.calls_made as i64))
        .collect();
    let stored: BTreeMap<String, i64> = counters
        .slots_held
        .iter()
        .filter(|(_, n)| **n != 0)
        .map(|(t, n)| (t.clone(), *n))
        .collect();
    assert_eq!(stored, recount, "slots held per tool");
    assert_eq!(counters.reserved, detail.budget.reserved as i64, "reserved");
    assert_eq!(counters.spent, detail.budget.spent as i64, "spent");
    detail
}

/// The O(1) counters equal a recount from the attempts after a long random sequence of
/// authorizations (new keys, reused keys, continuations), outcome reports (single and batched),
/// resolutions and sweeps, on two permits.
pub async fn counters_match_recount_after_random_operations(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.max_calls.insert("pay".into(), 6);
    pol.rules.max_calls_default = Some(40);
    pol.rules.budget = Some(400);
    pol.rules.cost.insert("pay".into(), CostRule::Fixed(17));
    pol.rules
        .cost
        .insert("ship".into(), CostRule::Pointer("/n".into()));
    pol.rules.cost_default = 3;
    pol.rules.duplicate_guard = GuardMode::Off;
    let (p1, tok1) = make_permit(&*s, pol.clone(), T0 + 100 * HOUR).await;
    pol.rules.budget = None;
    pol.retention_ms = 10 * MIN;
    let (p2, tok2) = make_permit(&*s, pol, T0 + 100 * HOUR).await;
    // A small deterministic generator (no extra dependency).
    let mut seed: u64 = 0x5eed_1234_abcd_0001;
    let mut next = move |n: u64| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % n
    };
    let tools = ["pay", "ship", "read"];
    let mut attempts: Vec<String> = Vec::new();
    let mut now = T0;
    for i in 0..400u64 {
        now += 7_000;
        let tok = if next(2) == 0 { &tok1 } else { &tok2 };
        match next(10) {
            0..=3 => {
                let tool = tools[next(3) as usize];
                let k = next(25);
                let key = format!("k{k}");
                let key = if next(6) == 0 {
                    None
                } else {
                    Some(key.as_str())
                };
                let mut r = req(tok, tool, key, &format!("{tool}-{k}"), json!({"n": k}));
                r.continuation = next(4) == 0;
                let d = s.authorize(&r, LEASE_MS, now, patient()).await.unwrap();
                remember(&d.response);
                if let AuthorizeResponse::Dispatch { attempt_id, .. } = d.response {
                    attempts.push(attempt_id);
                }
            }
            4..=6 if !attempts.is_empty() => {
                let id = attempts[next(attempts.len() as u64) as usize].clone();
                let outcome = match next(5) {
                    0 => completed("{}"),
                    1 => released(),
                    2 => uncertain(),
                    3 => input_required("{}"),
                    _ => Outcome::Accepted {
                        receipt: "{}".into(),
                    },
                };
                report(&*s, &id, outcome, now).await;
            }
            7 if !attempts.is_empty() => {
                let batch: Vec<OutcomeReport> = (0..1 + next(4))
                    .map(|_| {
                        report_of(
                            &attempts[next(attempts.len() as u64) as usize],
                            if next(2) == 0 {
                                completed("{}")
                            } else {
                                released()
                            },
                        )
                    })
                    .collect();
                let acks = s.record_outcomes(&batch, now).await.unwrap();
                assert_eq!(acks.len(), batch.len());
            }
            8 if !attempts.is_empty() => {
                let id = attempts[next(attempts.len() as u64) as usize].clone();
                let input = ResolveInput {
                    executed: next(2) == 0,
                    receipt: Some("{}".into()),
                    note: None,
                    by: "test".into(),
                    source: Default::default(),
                };
                let _ = s.resolve_attempt(&id, &input, now).await;
            }
            _ => {
                if i % 3 == 0 {
                    now += 2 * MIN;
                }
                s.sweep(now).await.unwrap();
            }
        }
    }
    for p in [&p1, &p2] {
        let detail = counters_match_recount(&*s, &p.id).await;
        assert!(
            detail.attempts_by_state.values().sum::<u64>() > 20,
            "the sequence did something: {:?}",
            detail.attempts_by_state
        );
    }
}

/// Each dispatch of an attempt is a round with its own capability: only a report that names
/// the current round and carries its capability moves the attempt; a continuation that never
/// left goes back to `awaiting_input`, never `released`; all of it survives a reopen.
pub async fn rounds_and_capabilities(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.max_calls.insert("pay".into(), 1);
    pol.rules.budget = Some(100);
    pol.rules.cost.insert("pay".into(), CostRule::Fixed(30));
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let first = req(&tok, "pay", Some("k1"), "A", json!({}));
    let r1 = auth(&*s, &first, T0).await;
    let a = dispatched(&r1);
    assert!(matches!(r1, AuthorizeResponse::Dispatch { round: 1, .. }));
    let round_1_report = |o| report_of(&a, o);
    let late_release = round_1_report(released());
    let late_ask = round_1_report(input_required("ASK again"));
    assert_eq!(
        s.record_outcome(&round_1_report(input_required("ASK")), T0 + 1)
            .await
            .unwrap()
            .ack,
        OutcomeAck::Applied
    );
    let r2 = auth(&*s, &continued(first.clone()), T0 + 2).await;
    assert_eq!(dispatched(&r2), a);
    let AuthorizeResponse::Dispatch {
        round: 2,
        capability: cap2,
        ..
    } = &r2
    else {
        panic!("expected round 2, got {r2:?}")
    };
    assert_ne!(
        cap2, &late_release.capability,
        "a fresh capability per round"
    );
    // Late reports of round 1 change nothing, whatever they say.
    for late in [&late_release, &late_ask] {
        assert_eq!(
            s.record_outcome(late, T0 + 3).await.unwrap().ack,
            OutcomeAck::StaleRound
        );
    }
    // The service token without the capability: refused.
    let mut forged = report_of(&a, released());
    forged.capability = "f".repeat(64);
    assert_eq!(
        s.record_outcome(&forged, T0 + 3).await.unwrap().ack,
        OutcomeAck::Refused
    );
    assert_eq!(state_of(&*s, &a).await, AttemptState::InFlight);
    // Round 2 never left: back to waiting for input, the slot and budget still held.
    assert_eq!(
        report(&*s, &a, released(), T0 + 4).await,
        OutcomeAck::Applied
    );
    assert_eq!(state_of(&*s, &a).await, AttemptState::AwaitingInput);
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 1);
    let d = s.permit_detail(&p.id).await.unwrap().unwrap();
    assert_eq!((d.budget.reserved, d.budget.spent), (30, 0));
    // The key is not free again: the first request is still in progress, a new key is capped.
    assert_eq!(
        denied(&auth(&*s, &first, T0 + 5).await),
        DenialCode::IdempotencyInProgress
    );
    assert_eq!(
        denied(&auth(&*s, &req(&tok, "pay", Some("k2"), "B", json!({})), T0 + 5).await),
        DenialCode::PermitMaxCallsExceeded
    );
    // Round 3 completes; the round and its capability survive a reopen.
    let r3 = auth(&*s, &continued(first.clone()), T0 + 6).await;
    assert!(matches!(r3, AuthorizeResponse::Dispatch { round: 3, .. }));
    dispatched(&r3);
    let done = report_of(&a, completed("R"));
    assert_eq!(
        s.record_outcome(&done, T0 + 7).await.unwrap().ack,
        OutcomeAck::Applied
    );
    drop(s);
    let s = h.reopen().await;
    let att = s.get_attempt(&a).await.unwrap().unwrap();
    assert_eq!((att.state, att.round), (AttemptState::Completed, 3));
    assert_eq!(
        s.record_outcome(&done, T0 + 8).await.unwrap().ack,
        OutcomeAck::AlreadyRecorded
    );
    let mut forged = done.clone();
    forged.capability = "0".repeat(64);
    assert_eq!(
        s.record_outcome(&forged, T0 + 8).await.unwrap().ack,
        OutcomeAck::Refused
    );
}

/// How many times each two-sided race below runs, each time on fresh attempts.
const RACE_ROUNDS: usize = 30;

/// Two handles on the same data; `sides(i)` gives them in turn one order and the other, so
/// each side of a race runs on either replica.
struct Sides {
    one: Arc<dyn Store>,
    two: Arc<dyn Store>,
}

impl Sides {
    async fn of(h: &dyn Harness) -> Sides {
        Sides {
            one: h.store().await,
            two: h.second_handle().await,
        }
    }

    fn sides(&self, i: usize) -> (Arc<dyn Store>, Arc<dyn Store>) {
        if i.is_multiple_of(2) {
            (self.one.clone(), self.two.clone())
        } else {
            (self.two.clone(), self.one.clone())
        }
    }
}

/// Runs two operations at once: both wait on one barrier, then each goes its own way.
async fn together<A, B>(
    a: impl std::future::Future<Output = A> + Send + 'static,
    b: impl std::future::Future<Output = B> + Send + 'static,
) -> (A, B)
where
    A: Send + 'static,
    B: Send + 'static,
{
    let barrier = Arc::new(tokio::sync::Barrier::new(2));
    let (ba, bb) = (barrier.clone(), barrier);
    let ta = tokio::spawn(async move {
        ba.wait().await;
        a.await
    });
    let tb = tokio::spawn(async move {
        bb.wait().await;
        b.await
    });
    (ta.await.unwrap(), tb.await.unwrap())
}

/// A permit with a budget and a cost, so every race moves slots and budget.
async fn race_permit(store: &dyn Store) -> (Permit, String) {
    let mut pol = policy();
    pol.rules.max_calls.insert("pay".into(), 1000);
    pol.rules.budget = Some(1_000_000);
    pol.rules.cost.insert("pay".into(), CostRule::Fixed(7));
    make_permit(store, pol, T0 + 100 * HOUR).await
}

/// An outcome report against the sweeper's lease expiry: either the report is applied and the
/// sweep finds nothing, or the sweep makes the attempt `uncertain` and the report is a
/// conflict; never both.
pub async fn race_report_against_lease_expiry(h: &dyn Harness) {
    let hs = Sides::of(h).await;
    let s = hs.one.clone();
    let (p, tok) = race_permit(&*s).await;
    let lease = i64::try_from(LEASE_MS).unwrap();
    for i in 0..RACE_ROUNDS {
        let r = req(
            &tok,
            "pay",
            Some(&format!("k{i}")),
            &format!("f{i}"),
            json!({}),
        );
        let a = dispatched(&auth(&*s, &r, T0).await);
        let (outcome, target) = if i % 4 < 2 {
            (completed(&format!("R{i}")), AttemptState::Completed)
        } else {
            (released(), AttemptState::Released)
        };
        let rep = report_of(&a, outcome);
        let (x, y) = hs.sides(i);
        let (ack, swept) = together(
            async move { x.record_outcome(&rep, T0 + lease).await.unwrap().ack },
            async move { y.sweep(T0 + lease).await.unwrap().leases_expired },
        )
        .await;
        let got = s.get_attempt(&a).await.unwrap().unwrap();
        match (ack, swept, got.state) {
            (OutcomeAck::Applied, 0, state) if state == target => {}
            (OutcomeAck::Conflict, 1, AttemptState::Uncertain) => {
                assert_eq!(
                    got.reason.as_deref(),
                    Some(crate::decide::LEASE_EXPIRED_REASON)
                );
            }
            other => panic!("round {i}: not a serialization of report and sweep: {other:?}"),
        }
        counters_match_recount(&*s, &p.id).await;
    }
}

/// Two handles report different outcomes of the same round at once: exactly one is applied,
/// the other is a conflict, and the attempt holds the applied one's state.
pub async fn race_conflicting_reports_from_two_handles(h: &dyn Harness) {
    let hs = Sides::of(h).await;
    let s = hs.one.clone();
    let (p, tok) = race_permit(&*s).await;
    for i in 0..RACE_ROUNDS {
        let r = req(
            &tok,
            "pay",
            Some(&format!("k{i}")),
            &format!("f{i}"),
            json!({}),
        );
        let a = dispatched(&auth(&*s, &r, T0).await);
        let (first, second) = match i % 3 {
            0 => (completed(&format!("R{i}")), released()),
            1 => (completed(&format!("R{i}")), uncertain()),
            _ => (released(), uncertain()),
        };
        let (rx, ry) = (report_of(&a, first.clone()), report_of(&a, second.clone()));
        let (x, y) = hs.sides(i);
        let (ack_x, ack_y) = together(
            async move { x.record_outcome(&rx, T0 + 1).await.unwrap().ack },
            async move { y.record_outcome(&ry, T0 + 1).await.unwrap().ack },
        )
        .await;
        let winner = match (ack_x, ack_y) {
            (OutcomeAck::Applied, OutcomeAck::Conflict) => first,
            (OutcomeAck::Conflict, OutcomeAck::Applied) => second,
            other => panic!("round {i}: both or neither report applied: {other:?}"),
        };
        let got = s.get_attempt(&a).await.unwrap().unwrap();
        assert_eq!(
            got.state,
            crate::decide::outcome_state(&winner),
            "round {i}"
        );
        let receipt = match &winner {
            Outcome::Completed { receipt } => Some(receipt.clone()),
            _ => None,
        };
        assert_eq!(got.receipt, receipt, "round {i}");
        counters_match_recount(&*s, &p.id).await;
    }
}

/// A resolution against a late report. On an `uncertain` attempt the resolution always wins
/// and the late report is a conflict. On an `in_flight` attempt the report always applies;
/// the resolution then succeeds only if the report made it `uncertain` first, and is refused
/// `NotUncertain` otherwise.
pub async fn race_resolution_against_late_report(h: &dyn Harness) {
    let hs = Sides::of(h).await;
    let s = hs.one.clone();
    let (p, tok) = race_permit(&*s).await;
    for i in 0..RACE_ROUNDS {
        let r = req(
            &tok,
            "pay",
            Some(&format!("k{i}")),
            &format!("f{i}"),
            json!({}),
        );
        let a = dispatched(&auth(&*s, &r, T0).await);
        let executed = i.is_multiple_of(2);
        let resolved = if executed {
            AttemptState::ResolvedExecuted
        } else {
            AttemptState::ResolvedNotExecuted
        };
        let variant = i % 3;
        let late = match variant {
            0 => {
                assert_eq!(report(&*s, &a, uncertain(), T0).await, OutcomeAck::Applied);
                report_of(&a, completed("late"))
            }
            1 => report_of(&a, uncertain()),
            _ => report_of(&a, completed(&format!("R{i}"))),
        };
        let input = ResolveInput {
            executed,
            receipt: Some("checked".into()),
            note: None,
            by: "race".into(),
            source: Default::default(),
        };
        let (x, y) = hs.sides(i);
        let id = a.clone();
        let (resolution, ack) = together(
            async move { x.resolve_attempt(&id, &input, T0 + 1).await },
            async move { y.record_outcome(&late, T0 + 1).await.unwrap().ack },
        )
        .await;
        let state = state_of(&*s, &a).await;
        match (variant, &resolution, ack, state) {
            (0, Ok(att), OutcomeAck::Conflict, st) if st == resolved && att.state == resolved => {}
            (1, Ok(att), OutcomeAck::Applied, st) if st == resolved && att.state == resolved => {}
            (
                1,
                Err(ResolveError::NotUncertain(AttemptState::InFlight)),
                OutcomeAck::Applied,
                AttemptState::Uncertain,
            ) => {}
            (
                2,
                Err(ResolveError::NotUncertain(AttemptState::InFlight | AttemptState::Completed)),
                OutcomeAck::Applied,
                AttemptState::Completed,
            ) => {}
            _ => panic!(
                "round {i}: not a serialization of resolution and report: \
                 {resolution:?}, {ack:?}, {state:?}"
            ),
        }
        counters_match_recount(&*s, &p.id).await;
    }
}

/// A revocation against an authorization: either the call dispatched before the revocation
/// (its attempt exists) or it is denied `permit_invalid` and no attempt exists; afterwards
/// every handle denies the permit.
pub async fn race_revocation_against_authorization(h: &dyn Harness) {
    let hs = Sides::of(h).await;
    let s = hs.one.clone();
    for i in 0..RACE_ROUNDS {
        let (p, tok) = race_permit(&*s).await;
        let r = req(&tok, "pay", Some("k"), "f", json!({}));
        let (x, y) = hs.sides(i);
        let (pid, ar) = (p.id.clone(), r.clone());
        let (revoked, answer) = together(
            async move { x.revoke_permit(&pid, T0 + 1).await.unwrap() },
            async move {
                y.authorize(&ar, LEASE_MS, T0 + 1, patient())
                    .await
                    .unwrap()
                    .response
            },
        )
        .await;
        assert_eq!(revoked.unwrap().revoked_at_ms, Some(T0 + 1), "round {i}");
        let attempts = s
            .list_attempts(&AttemptFilter {
                permit_id: Some(p.id.clone()),
                ..AttemptFilter::default()
            })
            .await
            .unwrap();
        let ids: Vec<String> = attempts.iter().map(|a| a.id.clone()).collect();
        match &answer {
            AuthorizeResponse::Dispatch { attempt_id, .. } => {
                assert_eq!(ids, vec![attempt_id.clone()], "round {i}");
                assert_eq!(attempts[0].state, AttemptState::InFlight);
            }
            AuthorizeResponse::Deny(d) if d.code == DenialCode::PermitInvalid => {
                assert!(ids.is_empty(), "round {i}: denied, yet {ids:?}");
            }
            other => panic!("round {i}: neither dispatched nor permit_invalid: {other:?}"),
        }
        for handle in [&hs.one, &hs.two] {
            for key in ["k", "other"] {
                let again = req(&tok, "pay", Some(key), "f", json!({}));
                assert_eq!(
                    denied(&auth(&**handle, &again, T0 + 2).await),
                    DenialCode::PermitInvalid,
                    "round {i}"
                );
            }
        }
        counters_match_recount(&*s, &p.id).await;
    }
}

/// A released key dispatched again: concurrent authorizations of it from both handles
/// dispatch once, as a new attempt that the key then names.
pub async fn race_released_key_dispatched_again(h: &dyn Harness) {
    let hs = Sides::of(h).await;
    let s = hs.one.clone();
    let (p, tok) = race_permit(&*s).await;
    for i in 0..RACE_ROUNDS {
        let r = req(
            &tok,
            "pay",
            Some(&format!("k{i}")),
            &format!("f{i}"),
            json!({}),
        );
        let a = dispatched(&auth(&*s, &r, T0).await);
        assert_eq!(report(&*s, &a, released(), T0).await, OutcomeAck::Applied);
        let barrier = Arc::new(tokio::sync::Barrier::new(4));
        let tasks: Vec<_> = (0..4)
            .map(|j| {
                let (x, _) = hs.sides(i + j);
                let (b, r) = (barrier.clone(), r.clone());
                tokio::spawn(async move {
                    b.wait().await;
                    x.authorize(&r, LEASE_MS, T0 + 1, patient())
                        .await
                        .unwrap()
                        .response
                })
            })
            .collect();
        let mut rs = Vec::new();
        for t in tasks {
            rs.push(t.await.unwrap());
        }
        assert_eq!(count(&rs, None), 1, "round {i}: {rs:?}");
        assert_eq!(
            count(&rs, Some(DenialCode::IdempotencyInProgress)),
            3,
            "round {i}: {rs:?}"
        );
        let again = rs
            .iter()
            .find(|r| matches!(r, AuthorizeResponse::Dispatch { .. }))
            .map(dispatched)
            .unwrap();
        assert_ne!(again, a, "round {i}: a new attempt");
        assert_eq!(state_of(&*s, &a).await, AttemptState::Released);
        assert_eq!(
            report(&*s, &again, completed(&format!("R{i}")), T0 + 2).await,
            OutcomeAck::Applied
        );
        assert_eq!(
            auth(&*hs.two, &r, T0 + 3).await,
            AuthorizeResponse::Replay {
                attempt_id: again,
                receipt: format!("R{i}"),
                limits: None,
            }
        );
        counters_match_recount(&*s, &p.id).await;
        assert_eq!(calls_made(&*s, &p.id, "pay").await, i as u64 + 1);
    }
}

/// The figures of `r` as (calls left, budget left).
fn figures(r: &AuthorizeResponse) -> (Option<u64>, Option<u64>) {
    let limits = match r {
        AuthorizeResponse::Dispatch { limits, .. } | AuthorizeResponse::Replay { limits, .. } => {
            limits.as_ref()
        }
        AuthorizeResponse::Deny(d) => d.limits.as_ref(),
    };
    let l = limits.unwrap_or_else(|| panic!("no figures in {r:?}"));
    assert_eq!(l.expires_at, clock::rfc3339(T0 + HOUR));
    (l.calls_left, l.budget_left)
}

/// Every answer under an authenticated permit carries what the permit still allows for the
/// tool, counted by the store as the decision left it: a dispatch after its own reservation,
/// a replay or a denial as things stand; a release gives the figures back.
pub async fn permit_limits_in_answers(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.max_calls.insert("pay".into(), 2);
    pol.rules.budget = Some(100);
    pol.rules
        .cost
        .insert("pay".into(), CostRule::Pointer("/amount".into()));
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let call = |key: &'static str, amount: u64| {
        req(&tok, "pay", Some(key), key, json!({"amount": amount}))
    };
    let first = auth_with_limits(&*s, &call("a", 30), T0).await;
    assert_eq!(figures(&first), (Some(1), Some(70)));
    let a = dispatched(&first);
    assert_eq!(
        figures(&auth_with_limits(&*s, &call("a", 30), T0).await),
        (Some(1), Some(70)),
        "in progress: nothing more taken"
    );
    report(&*s, &a, completed("R"), T0).await;
    let replay = auth_with_limits(&*s, &call("a", 30), T0).await;
    assert!(matches!(replay, AuthorizeResponse::Replay { .. }));
    assert_eq!(figures(&replay), (Some(1), Some(70)));
    let b = dispatched(&auth_with_limits(&*s, &call("b", 50), T0).await);
    let capped = auth_with_limits(&*s, &call("c", 1), T0).await;
    assert_eq!(denied(&capped), DenialCode::PermitMaxCallsExceeded);
    assert_eq!(figures(&capped), (Some(0), Some(20)));
    report(&*s, &b, released(), T0).await;
    let echo = auth_with_limits(&*s, &req(&tok, "echo", None, "E", json!({})), T0).await;
    assert_eq!(figures(&echo), (None, Some(70)), "no cap on echo");
    let mut wrong = call("d", 1);
    wrong.permit_token = format!("{tok}x");
    assert_eq!(
        auth_with_limits(&*s, &wrong, T0).await,
        AuthorizeResponse::Deny(Denial::new(
            DenialCode::PermitInvalid,
            "the permit token is unknown or revoked"
        ))
    );
    let counters = s.permit_counters(&p.id).await.unwrap().unwrap();
    assert_eq!((counters.reserved, counters.spent), (0, 30));
}

/// The request of a filter that forwards `forwarded` in the `Idempotency-Key` header.
fn forwarding(mut r: AuthorizeRequest, forwarded: &str) -> AuthorizeRequest {
    r.forwarded_key = Some(forwarded.into());
    r.forwarded_key_carriers = KeyCarriers::NONE.with(KeyCarrier::Header);
    r
}

/// The same request with the forwarded key in `carriers` instead.
fn carried_in(mut r: AuthorizeRequest, carriers: &[KeyCarrier]) -> AuthorizeRequest {
    r.forwarded_key_carriers = carriers.iter().copied().collect();
    r
}

fn carriers_of(a: &crate::model::Attempt) -> Vec<KeyCarrier> {
    a.forwarded_key_carriers.iter().collect()
}

/// The reconciliation inbox's reads: every attempt keeps the key its upstream received, where
/// it went, and its arguments (a continuation keeps the first round's key and carriers; past
/// retention the arguments go with the receipt); `open_attempts` lists `uncertain` attempts and `awaiting_input`
/// ones stuck since the given time, oldest first; `resolved_attempts` the latest resolution
/// first, with who, when, the note and (for the reconciler) the provider's answer;
/// `oldest_uncertain` follows. All of it survives a reopen.
pub async fn inbox_reads(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.retention_ms = HOUR;
    let (_, tok) = make_permit(&*s, pol, T0 + 100 * HOUR).await;
    let args = json!({"invoice": "INV-1", "amount": 250, "card": {"number": "4242"}});
    let pay = |key: &str, fp: &str| {
        forwarding(
            req(&tok, "pay", Some(key), fp, args.clone()),
            &format!("fwd-{key}"),
        )
    };
    let a = dispatched(&auth(&*s, &pay("a", "A"), T0).await);
    let b = dispatched(&auth(&*s, &carried_in(pay("b", "B"), &[KeyCarrier::Meta]), T0).await);
    let w = dispatched(&auth(&*s, &pay("w", "W"), T0).await);
    let f = dispatched(&auth(&*s, &pay("f", "F"), T0).await);
    let nokey = dispatched(&auth(&*s, &req(&tok, "pay", None, "N", json!({})), T0).await);
    let got = s.get_attempt(&a).await.unwrap().unwrap();
    assert_eq!(got.forwarded_key.as_deref(), Some("fwd-a"));
    assert_eq!(carriers_of(&got), [KeyCarrier::Header]);
    assert_eq!(
        carriers_of(&s.get_attempt(&b).await.unwrap().unwrap()),
        [KeyCarrier::Meta]
    );
    let kept: Value = serde_json::from_str(got.arguments.as_deref().unwrap()).unwrap();
    assert_eq!(kept, args);
    let nokey_attempt = s.get_attempt(&nokey).await.unwrap().unwrap();
    assert_eq!(nokey_attempt.forwarded_key, None);
    assert!(nokey_attempt.forwarded_key_carriers.is_empty());

    // a turns uncertain last, b first; w waits for input; f completes; nokey stays in flight.
    report(&*s, &b, uncertain(), T0 + 5).await;
    report(&*s, &a, uncertain(), T0 + 10).await;
    report(&*s, &w, input_required("ASK"), T0 + 3).await;
    report(&*s, &f, completed("R"), T0 + 4).await;
    let ids = |v: Vec<crate::model::Attempt>| v.into_iter().map(|a| a.id).collect::<Vec<_>>();
    // w has not waited long enough (since T0 + 3, stuck only from T0 + 2 back).
    assert_eq!(
        ids(s.open_attempts(T0 + 2, 50).await.unwrap()),
        [b.clone(), a.clone()]
    );
    assert_eq!(
        ids(s.open_attempts(T0 + 3, 50).await.unwrap()),
        [w.clone(), b.clone(), a.clone()]
    );
    assert_eq!(
        ids(s.open_attempts(T0 + 3, 2).await.unwrap()),
        [w.clone(), b.clone()]
    );
    assert_eq!(s.oldest_uncertain().await.unwrap(), Some(T0 + 5));

    // The continuation says another forwarded value (say the upstream secret rotated): the
    // attempt keeps the first, which is what the provider saw when the call was first sent.
    // So are the carriers it went in, from the same round.
    let again = continued(carried_in(
        forwarding(req(&tok, "pay", Some("w"), "W", args.clone()), "fwd-other"),
        &[KeyCarrier::IdempotencyKeyParam],
    ));
    assert_eq!(dispatched(&auth(&*s, &again, T0 + 6).await), w);
    let continued_w = s.get_attempt(&w).await.unwrap().unwrap();
    assert_eq!(continued_w.forwarded_key.as_deref(), Some("fwd-w"));
    assert_eq!(carriers_of(&continued_w), [KeyCarrier::Header]);
    assert_eq!(
        ids(s.open_attempts(T0 + 100, 50).await.unwrap()),
        [b.clone(), a.clone()]
    );

    // A person resolves b, the reconciler a (with the provider's answer as evidence).
    let person = ResolveInput {
        executed: false,
        receipt: None,
        note: Some("no charge for INV-1".into()),
        by: "ana".into(),
        source: ResolutionSource::Person,
    };
    s.resolve_attempt(&b, &person, T0 + 30).await.unwrap();
    assert_eq!(s.oldest_uncertain().await.unwrap(), Some(T0 + 10));
    let answer = r#"{"structuredContent":{"status":"paid"}}"#;
    let reconciler = ResolveInput {
        executed: true,
        receipt: None,
        note: Some("lookup_payment: status paid".into()),
        by: "payments-rule".into(),
        source: ResolutionSource::Reconciler {
            provider_answer: answer.into(),
        },
    };
    s.resolve_attempt(&a, &reconciler, T0 + 40).await.unwrap();
    assert_eq!(s.oldest_uncertain().await.unwrap(), None);
    assert!(s.open_attempts(T0, 50).await.unwrap().is_empty());

    drop(s);
    let s = h.reopen().await;
    let resolved = s.resolved_attempts(10).await.unwrap();
    assert_eq!(ids(resolved.clone()), [a.clone(), b.clone()]);
    let ra = resolved[0].resolution.clone().unwrap();
    assert_eq!(
        (ra.by.as_str(), ra.at_ms, ra.executed),
        ("payments-rule", T0 + 40, true)
    );
    assert_eq!(ra.source.provider_answer(), Some(answer));
    let rb = resolved[1].resolution.clone().unwrap();
    assert_eq!(
        (rb.by.as_str(), rb.note.as_deref(), rb.source),
        ("ana", Some("no charge for INV-1"), ResolutionSource::Person)
    );
    assert_eq!(resolved[0].forwarded_key.as_deref(), Some("fwd-a"));
    assert_eq!(carriers_of(&resolved[0]), [KeyCarrier::Header]);
    assert_eq!(carriers_of(&resolved[1]), [KeyCarrier::Meta]);
    assert_eq!(ids(s.resolved_attempts(1).await.unwrap()), [a]);

    // Past retention the receipt and the arguments go; the forwarded key stays for lookups.
    assert_eq!(s.sweep(T0 + 4 + HOUR).await.unwrap().receipts_pruned, 1);
    let pruned = s.get_attempt(&f).await.unwrap().unwrap();
    assert_eq!((pruned.receipt, pruned.arguments), (None, None));
    assert_eq!(pruned.forwarded_key.as_deref(), Some("fwd-f"));
    assert_eq!(
        pruned.forwarded_key_carriers.iter().collect::<Vec<_>>(),
        [KeyCarrier::Header]
    );
}

/// Rows a version 4 store held (SQL both stores run; SQLite spells `TRUE` as 1): a permit,
/// an attempt resolved by a person then, and one still `uncertain`.
pub const VERSION_4_ROWS: &str = "\
    INSERT INTO permits (id, token_hash, label, created_at, expires_at, retention_ms, policy) \
    VALUES ('p1', 'h', 'l', 0, 1, 0, '{\"tools\":[\"*\"],\"retention_ms\":0}'); \
    INSERT INTO attempts (id, permit_id, tool, fingerprint, cost, state, created_at, updated_at, \
    lease_expires_at, resolved_executed, resolved_by, resolved_at, resolution_note) \
    VALUES ('r1', 'p1', 'pay', 'f', 1, 'resolved_executed', 0, 5, 0, TRUE, 'ops', 5, 'found it'); \
    INSERT INTO attempts (id, permit_id, tool, fingerprint, cost, state, created_at, updated_at, \
    lease_expires_at) VALUES ('u1', 'p1', 'pay', 'g', 1, 'uncertain', 0, 7, 0);";

/// After migrating [`VERSION_4_ROWS`]: no forwarded key or arguments, the old resolution a
/// person's, and the inbox's reads find both attempts.
pub async fn reads_version_4_rows(s: &dyn Store) {
    let r = s.get_attempt("r1").await.unwrap().unwrap();
    let res = r.resolution.unwrap();
    assert_eq!(
        (res.by.as_str(), res.note.as_deref(), res.source),
        ("ops", Some("found it"), ResolutionSource::Person)
    );
    assert_eq!((r.forwarded_key, r.arguments), (None, None));
    assert!(r.forwarded_key_carriers.is_empty());
    let open = s.open_attempts(0, 10).await.unwrap();
    assert!(open.iter().all(|a| a.forwarded_key_carriers.is_empty()));
    assert_eq!(
        open.iter()
            .map(|a| (a.id.as_str(), a.state))
            .collect::<Vec<_>>(),
        [("u1", AttemptState::Uncertain)]
    );
    assert_eq!(s.oldest_uncertain().await.unwrap(), Some(7));
    let resolved = s.resolved_attempts(10).await.unwrap();
    assert_eq!(resolved.len(), 1);
    assert_eq!(resolved[0].id, "r1");
}

/// `uncertain_after` pages through every uncertain attempt in the inbox's order (when each
/// turned so, then id), after a given key, at most `limit` a page: attempts that turned
/// uncertain at the same moment are split across pages by id, and no attempt in another
/// state is ever listed.
pub async fn uncertain_pages(h: &dyn Harness) {
    let s = h.store().await;
    let (_, tok) = make_permit(&*s, policy(), T0 + 100 * HOUR).await;
    let mut uncertain_ids = Vec::new();
    for i in 0..5 {
        let key = format!("u{i}");
        let id = dispatched(&auth(&*s, &req(&tok, "pay", Some(&key), &key, json!({})), T0).await);
        // Two pairs turn uncertain at the same moment, so the id breaks the tie.
        report(&*s, &id, uncertain(), T0 + 10 + i / 2).await;
        uncertain_ids.push((T0 + 10 + i / 2, id));
    }
    let done = dispatched(&auth(&*s, &req(&tok, "pay", Some("c"), "C", json!({})), T0).await);
    report(&*s, &done, completed("R"), T0 + 1).await;
    let _in_flight = dispatched(&auth(&*s, &req(&tok, "pay", Some("f"), "F", json!({})), T0).await);
    uncertain_ids.sort();
    let expected: Vec<String> = uncertain_ids.iter().map(|(_, id)| id.clone()).collect();

    let mut walked = Vec::new();
    let mut after: (crate::clock::Millis, String) = (crate::clock::Millis::MIN, String::new());
    for _ in 0..10 {
        let page = s.uncertain_after((after.0, &after.1), 2).await.unwrap();
        assert!(page.len() <= 2, "a page holds at most the limit");
        let Some(last) = page.last() else { break };
        after = (last.updated_at_ms, last.id.clone());
        walked.extend(page.into_iter().map(|a| {
            assert_eq!(a.state, AttemptState::Uncertain);
            a.id
        }));
    }
    assert_eq!(walked, expected, "every uncertain attempt once, in order");
    // From the middle: only what comes after that key.
    let (at, id) = &uncertain_ids[2];
    let rest: Vec<String> = s
        .uncertain_after((*at, id), 10)
        .await
        .unwrap()
        .into_iter()
        .map(|a| a.id)
        .collect();
    assert_eq!(rest, expected[3..].to_vec());
}

/// The kids a store publishes at `now`, newest first.
async fn published_kids(store: &dyn Store, now: i64) -> Vec<String> {
    store
        .published_signing_keys(now)
        .await
        .unwrap()
        .into_iter()
        .map(|k| k.kid)
        .collect()
}

/// One key is active and shared by every handle; a rotation retires it at `now` and makes a
/// new one active at once; the retired key stays published until its window ends (the last
/// instant included), then not; every key stays listed, and survives a reopen.
pub async fn signing_keys_rotation_and_publication(h: &dyn Harness) {
    let s = h.store().await;
    let other = h.second_handle().await;
    assert!(s.active_signing_key().await.unwrap().is_none());
    assert!(s.published_signing_keys(T0).await.unwrap().is_empty());

    let first = s.ensure_signing_key(T0).await.unwrap();
    let kid1 = first.kid().to_string();
    assert_eq!(first.public().created_at_ms, T0);
    // Making sure again, from either handle, finds the same key.
    assert_eq!(
        other.ensure_signing_key(T0 + MIN).await.unwrap().kid(),
        kid1
    );
    assert_eq!(s.ensure_signing_key(T0 + MIN).await.unwrap().kid(), kid1);
    assert_eq!(
        other.active_signing_key().await.unwrap().unwrap().kid(),
        kid1
    );
    assert_eq!(
        published_kids(&*other, T0 + 1000 * HOUR).await,
        vec![kid1.clone()]
    );
    let jwk = s.published_signing_keys(T0).await.unwrap()[0]
        .jwk()
        .unwrap();
    assert_eq!(jwk.kid, kid1);

    let retire_at = T0 + HOUR;
    let rotation = other.rotate_signing_key(retire_at).await.unwrap();
    let kid2 = rotation.active.kid().to_string();
    assert_ne!(kid2, kid1);
    let retired = rotation.retired.unwrap();
    assert_eq!(retired.kid, kid1);
    assert_eq!(retired.retired_at_ms, Some(retire_at));
    assert_eq!(
        retired.published_until_ms(),
        Some(retire_at + PUBLISHED_AFTER_RETIREMENT_MS)
    );
    // Both handles sign with the new key from now on.
    assert_eq!(s.active_signing_key().await.unwrap().unwrap().kid(), kid2);
    assert_eq!(s.ensure_signing_key(retire_at).await.unwrap().kid(), kid2);
    let until = retire_at + PUBLISHED_AFTER_RETIREMENT_MS;
    for now in [retire_at, retire_at + MIN, until] {
        assert_eq!(
            published_kids(&*s, now).await,
            vec![kid2.clone(), kid1.clone()],
            "at {now}"
        );
    }
    assert_eq!(published_kids(&*s, until + 1).await, vec![kid2.clone()]);
    assert_eq!(
        published_kids(&*other, until + HOUR).await,
        vec![kid2.clone()]
    );

    let listed = s.signing_keys().await.unwrap();
    assert_eq!(
        listed
            .iter()
            .map(|k| (k.kid.as_str(), k.retired_at_ms))
            .collect::<Vec<_>>(),
        vec![(kid2.as_str(), None), (kid1.as_str(), Some(retire_at))]
    );
    drop((s, other));
    let s = h.reopen().await;
    assert_eq!(s.active_signing_key().await.unwrap().unwrap().kid(), kid2);
    assert_eq!(s.signing_keys().await.unwrap().len(), 2);
}

/// Replicas starting together on an empty store each make sure of a key: one key results,
/// active, and every one of them answers it. Rotations at the same time each retire the key
/// before them: one active key remains, and every other is retired.
pub async fn race_signing_keys(h: &dyn Harness) {
    let sides = Sides::of(h).await;
    let mut calls = Vec::new();
    for i in 0..8 {
        let (store, _) = sides.sides(i);
        calls.push(tokio::spawn(async move {
            store
                .ensure_signing_key(T0)
                .await
                .unwrap()
                .kid()
                .to_string()
        }));
    }
    let mut kids = Vec::new();
    for c in calls {
        kids.push(c.await.unwrap());
    }
    kids.dedup();
    assert_eq!(kids.len(), 1, "{kids:?}");
    let keys = sides.one.signing_keys().await.unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert_eq!(keys[0].retired_at_ms, None);

    let mut rotations = Vec::new();
    for i in 0..6 {
        let (store, _) = sides.sides(i);
        rotations.push(tokio::spawn(async move {
            store
                .rotate_signing_key(T0 + MIN)
                .await
                .unwrap()
                .active
                .kid()
                .to_string()
        }));
    }
    let mut new_kids = Vec::new();
    for r in rotations {
        new_kids.push(r.await.unwrap());
    }
    let keys = sides.two.signing_keys().await.unwrap();
    assert_eq!(keys.len(), 7, "{keys:?}");
    let active: Vec<_> = keys.iter().filter(|k| k.retired_at_ms.is_none()).collect();
    assert_eq!(active.len(), 1, "{keys:?}");
    assert!(new_kids.contains(&active[0].kid));
    assert_eq!(
        sides.one.active_signing_key().await.unwrap().unwrap().kid(),
        active[0].kid
    );
}

/// Inbox sessions: open until they expire, end one by one or all at once, seen by every
/// handle; expired ones are dropped when a new one opens.
pub async fn inbox_sessions(h: &dyn Harness) {
    let s = h.store().await;
    let other = h.second_handle().await;
    assert!(!s.inbox_session_open("a", T0).await.unwrap());
    s.open_inbox_session("a", T0, T0 + HOUR).await.unwrap();
    s.open_inbox_session("b", T0, T0 + MIN).await.unwrap();
    assert!(other.inbox_session_open("a", T0 + 1).await.unwrap());
    assert!(other.inbox_session_open("b", T0 + 1).await.unwrap());
    assert!(
        !s.inbox_session_open("b", T0 + MIN).await.unwrap(),
        "expired"
    );
    // One ends (its sign-out): gone for every handle; ending it again finds nothing.
    assert!(other.end_inbox_session("a").await.unwrap());
    assert!(!s.inbox_session_open("a", T0 + 1).await.unwrap());
    assert!(!s.end_inbox_session("a").await.unwrap());
    // Every one ends: only those still open are counted.
    s.open_inbox_session("c", T0 + 2 * MIN, T0 + HOUR)
        .await
        .unwrap();
    s.open_inbox_session("d", T0 + 2 * MIN, T0 + HOUR)
        .await
        .unwrap();
    assert_eq!(other.end_all_inbox_sessions(T0 + 2 * MIN).await.unwrap(), 2);
    for id in ["b", "c", "d"] {
        assert!(
            !s.inbox_session_open(id, T0 + 2 * MIN).await.unwrap(),
            "{id}"
        );
    }
    assert_eq!(s.end_all_inbox_sessions(T0 + 2 * MIN).await.unwrap(), 0);
}

/// A decision whose caller's deadline passed is neither decided nor committed: it fails
/// with `DeadlinePassed` (an outage to the caller) and takes nothing. Decisions whose
/// callers still wait, alongside it or after it, are decided as usual.
pub async fn decisions_past_their_deadline_commit_nothing(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.max_calls.insert("pay".into(), 1);
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let gone = clock::Deadline::at(std::time::Instant::now());
    let first = req(&tok, "pay", Some("k1"), "fp-1", json!({}));
    let err = s.authorize(&first, LEASE_MS, T0, gone).await.unwrap_err();
    assert!(
        matches!(err, crate::error::LedgerError::DeadlinePassed(_)),
        "{err}"
    );
    assert!(err.is_transient(), "answered as an outage: {err}");
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 0);
    // A late caller beside a waiting one: the cap of 1 goes to the one still waiting, and the
    // key the late call named is free (a fresh dispatch, not a replay of an attempt).
    let late = req(&tok, "pay", Some("k2"), "fp-2", json!({}));
    let (late, timely) = tokio::join!(
        s.authorize(&late, LEASE_MS, T0, gone),
        s.authorize(&first, LEASE_MS, T0, patient())
    );
    assert!(
        matches!(late, Err(crate::error::LedgerError::DeadlinePassed(_))),
        "{late:?}"
    );
    dispatched(&timely.unwrap().response);
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 1);
}

/// A resolution by a person, for the purge tests.
fn resolved_by_person(executed: bool) -> ResolveInput {
    ResolveInput {
        executed,
        receipt: None,
        note: None,
        by: "t".into(),
        source: Default::default(),
    }
}

/// Attempts per state over the whole store, the states with none left out.
async fn nonzero_counts(store: &dyn Store) -> BTreeMap<AttemptState, u64> {
    let mut counts = store.attempt_counts().await.unwrap();
    counts.retain(|_, n| *n > 0);
    counts
}

/// The purge of ended permits (docs/design.md#purging-ended-permits): settled attempts and
/// their keys of permits that expired or were revoked at or before the cut go, and so does
/// each permit once nothing is left under it; attempts that are not settled stay with their
/// permit, whose counters equal a recount throughout; a purged permit's token is denied, and
/// nothing is ever dispatched under an ended permit, before the purge or after it.
pub async fn purge_of_ended_permits(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.max_calls.insert("pay".into(), 10);
    pol.rules.budget = Some(1000);
    pol.rules.cost.insert("pay".into(), CostRule::Fixed(7));
    let ends = T0 + HOUR;
    let (p, tok) = make_permit(&*s, pol.clone(), ends).await;
    let call = |key: &str, fp: &str| req(&tok, "pay", Some(key), fp, json!({"n": 1}));
    let done = dispatched(&auth(&*s, &call("done", "A"), T0).await);
    report(&*s, &done, completed("R"), T0).await;
    // A released key dispatched again: the key points at the second attempt.
    let first = dispatched(&auth(&*s, &call("again", "B"), T0).await);
    report(&*s, &first, released(), T0).await;
    let second = dispatched(&auth(&*s, &call("again", "B"), T0).await);
    report(&*s, &second, completed("R2"), T0).await;
    let keyless = dispatched(&auth(&*s, &req(&tok, "pay", None, "C", json!({})), T0).await);
    report(&*s, &keyless, completed("R3"), T0).await;
    let unc = dispatched(&auth(&*s, &call("unc", "U"), T0).await);
    report(&*s, &unc, uncertain(), T0).await;
    // Still in flight when its permit ends (its lease runs out later, and nothing swept it).
    let flying = dispatched(&auth(&*s, &call("fly", "F"), ends - 1).await);

    // A revoked permit, an expired one never used, and one still active.
    let (q, qtok) = make_permit(&*s, pol.clone(), T0 + 100 * HOUR).await;
    let q_done = dispatched(&auth(&*s, &req(&qtok, "pay", Some("q"), "Q", json!({})), T0).await);
    report(&*s, &q_done, completed("RQ"), T0).await;
    s.revoke_permit(&q.id, T0 + 10 * MIN).await.unwrap();
    let (unused, unused_tok) = make_permit(&*s, pol.clone(), T0 + 30 * MIN).await;
    let (live, live_tok) = make_permit(&*s, pol, T0 + 100 * HOUR).await;
    let live_done =
        dispatched(&auth(&*s, &req(&live_tok, "pay", Some("l"), "L", json!({})), T0).await);
    report(&*s, &live_done, completed("RL"), T0).await;

    // Before the purge, past the expiry: the key replays, a new call is denied.
    assert!(matches!(
        auth(&*s, &call("done", "A"), ends + 1).await,
        AuthorizeResponse::Replay { .. }
    ));
    assert_eq!(
        denied(&auth(&*s, &call("new", "N"), ends + 1).await),
        DenialCode::PermitExpired
    );

    // A cut before P's end purges Q (revoked before it) and the unused permit, not P.
    let r = s.purge(ends - 1, u64::MAX).await.unwrap();
    assert_eq!(
        (r.attempts_purged, r.permits_purged),
        (1, 2),
        "Q's attempt, Q and the unused permit"
    );
    for gone in [&q.id, &unused.id] {
        assert!(s.permit_detail(gone).await.unwrap().is_none(), "{gone}");
        assert!(s.permit_counters(gone).await.unwrap().is_none(), "{gone}");
    }
    assert!(s.get_attempt(&q_done).await.unwrap().is_none());
    assert_eq!(state_of(&*s, &done).await, AttemptState::Completed);
    for (t, key) in [(&qtok, "q"), (&unused_tok, "x")] {
        let r = auth(&*s, &req(t, "pay", Some(key), "Q", json!({})), ends + 1).await;
        assert_eq!(denied(&r), DenialCode::PermitInvalid);
    }

    // At P's end: its settled attempts and their keys go; the uncertain and the in-flight
    // attempt stay, and the permit with them.
    let r = s.purge(ends, u64::MAX).await.unwrap();
    assert_eq!((r.attempts_purged, r.permits_purged), (4, 0));
    for id in [&done, &first, &second, &keyless] {
        assert!(s.get_attempt(id).await.unwrap().is_none(), "{id}");
    }
    assert_eq!(state_of(&*s, &unc).await, AttemptState::Uncertain);
    assert_eq!(state_of(&*s, &flying).await, AttemptState::InFlight);
    let detail = counters_match_recount(&*s, &p.id).await;
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 2);
    assert_eq!((detail.budget.reserved, detail.budget.spent), (7, 7));
    assert_eq!(
        nonzero_counts(&*s).await,
        BTreeMap::from([
            (AttemptState::InFlight, 1),
            (AttemptState::Uncertain, 1),
            (AttemptState::Completed, 1)
        ])
    );
    // The purged keys are denied, never dispatched: the permit has ended. The kept ones
    // answer as before.
    for (key, fp) in [("done", "A"), ("again", "B"), ("new", "N")] {
        assert_eq!(
            denied(&auth(&*s, &call(key, fp), ends + 2).await),
            DenialCode::PermitExpired,
            "{key}"
        );
    }
    assert_eq!(
        denied(&auth(&*s, &call("unc", "U"), ends + 2).await),
        DenialCode::DeliveryUncertain
    );
    assert_eq!(
        denied(&auth(&*s, &call("fly", "F"), ends + 2).await),
        DenialCode::IdempotencyInProgress
    );
    // A late report about a purged attempt changes nothing.
    assert_eq!(
        report(&*s, &done, completed("R"), ends + 2).await,
        OutcomeAck::UnknownAttempt
    );
    // Nothing more to purge until the rest settles; the active permit is never touched.
    assert_eq!(
        s.purge(ends + 10 * HOUR, u64::MAX).await.unwrap(),
        PurgeReport::default()
    );
    assert_eq!(state_of(&*s, &live_done).await, AttemptState::Completed);

    // The in-flight call's report still lands; once the uncertain one is resolved, the
    // permit has nothing left and goes too.
    assert_eq!(
        report(&*s, &flying, completed("RF"), ends + 3).await,
        OutcomeAck::Applied
    );
    s.resolve_attempt(&unc, &resolved_by_person(false), ends + 4)
        .await
        .unwrap();
    let r = s.purge(ends, u64::MAX).await.unwrap();
    assert_eq!((r.attempts_purged, r.permits_purged), (2, 1));
    assert!(s.permit_detail(&p.id).await.unwrap().is_none());
    assert!(s.permit_counters(&p.id).await.unwrap().is_none());
    assert_eq!(
        denied(&auth(&*s, &call("unc", "U"), ends + 5).await),
        DenialCode::PermitInvalid
    );
    assert_eq!(
        nonzero_counts(&*s).await,
        BTreeMap::from([(AttemptState::Completed, 1)])
    );
    let listed: Vec<String> = s
        .list_permits()
        .await
        .unwrap()
        .into_iter()
        .map(|p| p.id)
        .collect();
    assert_eq!(listed, vec![live.id.clone()]);
    counters_match_recount(&*s, &live.id).await;
}

/// The purge deletes at most what it is asked to, and picks up where it stopped.
pub async fn purge_in_bounded_batches(h: &dyn Harness) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.budget = Some(1000);
    pol.rules.cost_default = 2;
    let ends = T0 + HOUR;
    let mut permits = Vec::new();
    for _ in 0..2 {
        let (p, tok) = make_permit(&*s, pol.clone(), ends).await;
        for i in 0..3 {
            let key = format!("k{i}");
            let a =
                dispatched(&auth(&*s, &req(&tok, "pay", Some(&key), &key, json!({})), T0).await);
            report(&*s, &a, completed("R"), T0).await;
        }
        permits.push(p);
    }
    let r = s.purge(ends, 1).await.unwrap();
    assert_eq!((r.attempts_purged, r.permits_purged), (1, 0));
    for p in &permits {
        counters_match_recount(&*s, &p.id).await;
    }
    // The first permit's (in the purge's order) last two, and it; two of the other's, which
    // keeps its third.
    let r = s.purge(ends, 4).await.unwrap();
    assert_eq!((r.attempts_purged, r.permits_purged), (4, 1));
    let left = s.list_permits().await.unwrap();
    assert_eq!(left.len(), 1);
    assert_eq!(
        counters_match_recount(&*s, &left[0].id)
            .await
            .attempts_by_state
            .values()
            .sum::<u64>(),
        1
    );
    let r = s.purge(ends, 100).await.unwrap();
    assert_eq!((r.attempts_purged, r.permits_purged), (1, 1));
    assert!(s.list_permits().await.unwrap().is_empty());
    assert!(nonzero_counts(&*s).await.is_empty());
}

/// A verifier's refusal at the tool, reported by the gateway (docs/design.md#attempt-states):
/// proven (its HMAC checked by the server, its nonce this round's), the slot and the cost come
/// back and the same key dispatches again; unproven, the attempt is `uncertain` and keeps them.
pub async fn refusals_at_the_tool(h: &dyn Harness) {
    use atmost_protocol::signature::DispatchNonce;
    use atmost_protocol::tool_refusal::{Proof, ToolRefusal};
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.max_calls.insert("pay".into(), 1);
    pol.rules.budget = Some(10);
    pol.rules.cost.insert("pay".into(), CostRule::Fixed(4));
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let refusal = |attempt: &str, mac_verified: bool| Outcome::RefusedAtTool {
        refusal: ToolRefusal {
            code: DenialCode::SignatureKeyUnknown,
            proof: Some(Proof {
                nonce: DispatchNonce {
                    attempt_id: attempt.into(),
                    round: 1,
                    permit_id: p.id.clone(),
                    tool: "pay".into(),
                }
                .encode(),
                mac: "0f".repeat(32),
            }),
        }
        .header_value(),
        mac_verified,
    };
    let call = || req(&tok, "pay", Some("k"), "F", json!({}));
    let a = dispatched(&auth(&*s, &call(), T0).await);
    assert_eq!(
        report(&*s, &a, refusal(&a, true), T0 + 1).await,
        OutcomeAck::Applied
    );
    let refused = s.get_attempt(&a).await.unwrap().unwrap();
    assert_eq!(refused.state, AttemptState::RefusedAtTool);
    assert_eq!(refused.receipt, None);
    assert_eq!(
        refused.reason.as_deref(),
        Some("refused_at_tool: signature_key_unknown")
    );
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 0);
    let det = counters_match_recount(&*s, &p.id).await;
    assert_eq!((det.budget.spent, det.budget.reserved), (0, 0));
    let counts = s.attempt_counts().await.unwrap();
    assert_eq!(counts.get(&AttemptState::RefusedAtTool).copied(), Some(1));

    // The same key goes again, as a new attempt, and takes the one slot.
    let b = dispatched(&auth(&*s, &call(), T0 + 2).await);
    assert_ne!(a, b);
    // A refusal the server could not verify (a plain upstream's): no slot back.
    assert_eq!(
        report(&*s, &b, refusal(&b, false), T0 + 3).await,
        OutcomeAck::Applied
    );
    assert_eq!(state_of(&*s, &b).await, AttemptState::Uncertain);
    assert_eq!(calls_made(&*s, &p.id, "pay").await, 1);
    let det = counters_match_recount(&*s, &p.id).await;
    assert_eq!((det.budget.spent, det.budget.reserved), (4, 0));
    assert_eq!(
        denied(&auth(&*s, &call(), T0 + 4).await),
        DenialCode::DeliveryUncertain
    );
    // The refused attempt is kept as it was after a reopen.
    drop(s);
    let s = h.reopen().await;
    assert_eq!(state_of(&*s, &a).await, AttemptState::RefusedAtTool);
}

/// Each round's attempt records the SHA-256 of the body it is signed over (the dispatch
/// target's), a continuation its own; kept across a reopen; none for a round sent unsigned.
pub async fn dispatch_bodies_recorded(h: &dyn Harness) {
    use atmost_protocol::signature::DispatchTarget;
    let s = h.store().await;
    let (_, tok) = make_permit(&*s, policy(), T0 + HOUR).await;
    let target = |body: &str| DispatchTarget {
        method: "POST".into(),
        authority: "tools.example:8000".into(),
        path: "/mcp".into(),
        body_sha256: token::sha256_hex(body),
        idempotency_key: None,
        validity_s: 15,
    };
    let signed = |key: &str, body: &str, continuation: bool| AuthorizeRequest {
        dispatch: Some(target(body)),
        continuation,
        ..req(&tok, "pay", Some(key), "F", json!({}))
    };
    let recorded = |a: &str| {
        let s = s.clone();
        let a = a.to_string();
        async move {
            s.get_attempt(&a)
                .await
                .unwrap()
                .unwrap()
                .dispatch_body_sha256
        }
    };
    let a = dispatched(&auth(&*s, &signed("k", "round 1", false), T0).await);
    assert_eq!(recorded(&a).await, Some(token::sha256_hex("round 1")));
    report(
        &*s,
        &a,
        Outcome::InputRequired {
            receipt: "ASK".into(),
        },
        T0 + 1,
    )
    .await;
    let again = dispatched(&auth(&*s, &signed("k", "round 2", true), T0 + 2).await);
    assert_eq!(again, a, "a continuation is the same attempt");
    assert_eq!(recorded(&a).await, Some(token::sha256_hex("round 2")));
    let unsigned = dispatched(&auth(&*s, &req(&tok, "pay", Some("u"), "U", json!({})), T0).await);
    assert_eq!(recorded(&unsigned).await, None);
    drop(s);
    let s = h.reopen().await;
    let kept = s.get_attempt(&a).await.unwrap().unwrap();
    assert_eq!(
        kept.dispatch_body_sha256,
        Some(token::sha256_hex("round 2"))
    );
}

/// A credential as a store receives it: `sealed` stands for a sealed secret (the stores
/// keep it as text and never open it).
fn credential(name: &str, header: &str, sealed: &str, at: i64) -> StoredCredential {
    StoredCredential {
        name: name.into(),
        version: 0,
        header: header.into(),
        form: CredentialForm::Bearer,
        routes: vec!["tool_route".into(), "tool_sse".into()],
        sealed: Some(sealed.into()),
        created_at_ms: at,
    }
}

/// Credentials: each registration of a name is its next version; the newest is read with its
/// sealed secret by name, listed without it; every handle sees them, and they outlive a reopen.
pub async fn credentials_versions_and_reads(h: &dyn Harness) {
    let s = h.store().await;
    let other = h.second_handle().await;
    assert_eq!(s.credential("pay").await.unwrap(), None);
    assert!(s.credentials().await.unwrap().is_empty());
    let v1 = s
        .put_credential(&credential("pay", "authorization", "v1.sealed-a", T0))
        .await
        .unwrap();
    assert_eq!(v1.version, 1);
    let mut given = credential("pay", "x-api-key", "v1.sealed-b", T0 + MIN);
    given.version = 7;
    let v2 = other.put_credential(&given).await.unwrap();
    assert_eq!(v2.version, 2, "the store numbers versions, not the caller");
    let o1 = s
        .put_credential(&credential("search", "x-api-key", "v1.sealed-c", T0))
        .await
        .unwrap();
    assert_eq!(o1.version, 1);

    let newest = s.credential("pay").await.unwrap().unwrap();
    assert_eq!(newest, v2);
    assert_eq!(newest.sealed.as_deref(), Some("v1.sealed-b"));
    assert_eq!(newest.header, "x-api-key");
    assert_eq!(newest.created_at_ms, T0 + MIN);
    assert_eq!(newest.routes, ["tool_route", "tool_sse"]);
    let listed = other.credentials().await.unwrap();
    let shown: Vec<_> = listed
        .iter()
        .map(|c| (c.name.as_str(), c.version, c.sealed.clone()))
        .collect();
    assert_eq!(shown, vec![("pay", 2, None), ("search", 1, None)]);
    drop((s, other));
    let s = h.reopen().await;
    assert_eq!(s.credential("pay").await.unwrap(), Some(v2));
    assert_eq!(s.credential("search").await.unwrap(), Some(o1));
}

/// Registrations of one name from two handles at once each get a version of their own.
pub async fn race_credential_versions(h: &dyn Harness) {
    let sides = Sides::of(h).await;
    let mut puts = Vec::new();
    for i in 0..10 {
        let (store, _) = sides.sides(i);
        puts.push(tokio::spawn(async move {
            let sealed = format!("v1.sealed-{i}");
            store
                .put_credential(&credential("pay", "authorization", &sealed, T0))
                .await
                .unwrap()
                .version
        }));
    }
    let mut versions = Vec::new();
    for p in puts {
        versions.push(p.await.unwrap());
    }
    versions.sort_unstable();
    assert_eq!(versions, (1..=10).collect::<Vec<u32>>());
    let newest = sides.two.credential("pay").await.unwrap().unwrap();
    assert_eq!(newest.version, 10);
}

/// A new attempt keeps the credential its dispatch carried (name and version); one whose
/// permit names none keeps none; every read of attempts shows it.
pub async fn attempts_keep_their_credential(h: &dyn Harness) {
    let s = h.store().await;
    let (_, tok) = make_permit(&*s, policy(), T0 + HOUR).await;
    let carried = CredentialUse {
        name: "pay.eu".into(),
        version: 3,
    };
    let r = req(&tok, "pay", Some("k1"), "fp1", json!({}));
    let answer = s
        .authorize_with(&r, Some(carried.clone()), LEASE_MS, T0, patient())
        .await
        .unwrap()
        .response;
    let with = dispatched(&answer);
    let r = req(&tok, "pay", Some("k2"), "fp2", json!({}));
    let without = dispatched(&auth(&*s, &r, T0).await);
    let other = h.second_handle().await;
    let a = other.get_attempt(&with).await.unwrap().unwrap();
    assert_eq!(a.credential, Some(carried.clone()));
    assert_eq!(
        other
            .get_attempt(&without)
            .await
            .unwrap()
            .unwrap()
            .credential,
        None
    );
    let listed = other
        .list_attempts(&AttemptFilter::default())
        .await
        .unwrap();
    let kept: Vec<_> = listed
        .iter()
        .map(|a| (a.id.clone(), a.credential.clone()))
        .collect();
    assert!(
        kept.contains(&(with.clone(), Some(carried.clone()))),
        "{kept:?}"
    );
    assert!(kept.contains(&(without, None)), "{kept:?}");
    // A replay under the same key carries nothing new and keeps the attempt's record.
    s.record_outcome(
        &report_of(
            &with,
            Outcome::Completed {
                receipt: "{}".into(),
            },
        ),
        T0 + 1,
    )
    .await
    .unwrap();
    let r = req(&tok, "pay", Some("k1"), "fp1", json!({}));
    assert!(matches!(
        s.authorize_with(&r, None, LEASE_MS, T0 + 2, patient())
            .await
            .unwrap()
            .response,
        AuthorizeResponse::Replay { .. }
    ));
    assert_eq!(
        s.get_attempt(&with).await.unwrap().unwrap().credential,
        Some(carried)
    );
}
