//! What every conformance check uses: the harness a store provides, permits, requests and
//! reports made for tests, and the races' machinery.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};

use async_trait::async_trait;
use atmost_protocol::{
    AuthorizeRequest, AuthorizeResponse, DenialCode, DispatchGrant, KeyCarrier, KeyCarriers,
    Outcome, OutcomeAck, OutcomeReport,
};
use serde_json::{json, Value};

use crate::clock;
use crate::credentials::{CredentialForm, StoredCredential};
use crate::decide::ResolveInput;
use crate::model::{AttemptState, CostRule, Permit, PermitDetail, Policy};
use crate::store::Store;
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

/// The `i`th of a run of `pay` calls that differ in key (`key-{i}`) and fingerprint
/// (`fp-{i}`): calls the duplicate guard never takes for one another.
pub fn nth_call(tok: &str, i: impl std::fmt::Display) -> AuthorizeRequest {
    req(
        tok,
        "pay",
        Some(&format!("key-{i}")),
        &format!("fp-{i}"),
        json!({}),
    )
}

pub fn req(tok: &str, tool: &str, key: Option<&str>, fp: &str, args: Value) -> AuthorizeRequest {
    AuthorizeRequest {
        reports: Vec::new(),
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
pub(super) fn grants() -> &'static Mutex<HashMap<String, DispatchGrant>> {
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

pub(super) fn denied(r: &AuthorizeResponse) -> DenialCode {
    match r {
        AuthorizeResponse::Deny(d) => d.code,
        other => panic!("expected a denial, got {other:?}"),
    }
}

pub(super) fn denial_data(r: &AuthorizeResponse) -> serde_json::Map<String, Value> {
    match r {
        AuthorizeResponse::Deny(d) => d.data.clone(),
        other => panic!("expected a denial, got {other:?}"),
    }
}

pub(super) async fn report(store: &dyn Store, id: &str, outcome: Outcome, now: i64) -> OutcomeAck {
    store
        .record_outcome(&report_of(id, outcome), now)
        .await
        .unwrap()
        .ack
}

pub(super) fn completed(r: &str) -> Outcome {
    Outcome::Completed { receipt: r.into() }
}

pub(super) fn released() -> Outcome {
    Outcome::Released {
        reason: "connection_refused".into(),
    }
}

pub(super) fn uncertain() -> Outcome {
    Outcome::Uncertain {
        reason: "upstream_reset".into(),
    }
}

pub(super) async fn calls_made(store: &dyn Store, permit: &str, tool: &str) -> u64 {
    let d = store.permit_detail(permit).await.unwrap().unwrap();
    d.usage.get(tool).map(|u| u.calls_made).unwrap_or(0)
}

pub(super) async fn state_of(store: &dyn Store, attempt: &str) -> AttemptState {
    store.get_attempt(attempt).await.unwrap().unwrap().state
}

pub(super) async fn receipt_kept(store: &dyn Store, attempt: &str) -> bool {
    store
        .get_attempt(attempt)
        .await
        .unwrap()
        .unwrap()
        .receipt
        .is_some()
}

/// Runs `n` authorize calls at once, split over two handles of the same data.
pub(super) async fn race(h: &dyn Harness, reqs: Vec<AuthorizeRequest>) -> Vec<AuthorizeResponse> {
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

pub(super) fn count(rs: &[AuthorizeResponse], code: Option<DenialCode>) -> usize {
    rs.iter()
        .filter(|r| match (r, code) {
            (AuthorizeResponse::Dispatch { .. }, None) => true,
            (AuthorizeResponse::Deny(d), Some(c)) => d.code == c,
            _ => false,
        })
        .count()
}

/// `n` calls with distinct keys race for a tool capped at `cap`: exactly `cap` go through.
pub(super) async fn race_cap(h: &dyn Harness, cap: u64) {
    let s = h.store().await;
    let mut pol = policy();
    pol.rules.max_calls.insert("pay".into(), cap);
    let (p, tok) = make_permit(&*s, pol, T0 + HOUR).await;
    let n = 32;
    let reqs = (0..n).map(|i| nth_call(&tok, i)).collect();
    let rs = race(h, reqs).await;
    let cap = usize::try_from(cap).unwrap();
    assert_eq!(count(&rs, None), cap, "{rs:?}");
    assert_eq!(
        count(&rs, Some(DenialCode::PermitMaxCallsExceeded)),
        n - cap
    );
    assert_eq!(calls_made(&*s, &p.id, "pay").await, cap as u64);
}

pub(super) fn continued(mut r: AuthorizeRequest) -> AuthorizeRequest {
    r.continuation = true;
    r
}

pub(super) fn input_required(r: &str) -> Outcome {
    Outcome::InputRequired { receipt: r.into() }
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

/// How many times each two-sided race below runs, each time on fresh attempts.
pub(super) const RACE_ROUNDS: usize = 30;

/// Two handles on the same data; `sides(i)` gives them in turn one order and the other, so
/// each side of a race runs on either replica.
pub(super) struct Sides {
    pub(super) one: Arc<dyn Store>,
    pub(super) two: Arc<dyn Store>,
}

impl Sides {
    pub(super) async fn of(h: &dyn Harness) -> Sides {
        Sides {
            one: h.store().await,
            two: h.second_handle().await,
        }
    }

    pub(super) fn sides(&self, i: usize) -> (Arc<dyn Store>, Arc<dyn Store>) {
        if i.is_multiple_of(2) {
            (self.one.clone(), self.two.clone())
        } else {
            (self.two.clone(), self.one.clone())
        }
    }
}

/// Runs two operations at once: both wait on one barrier, then each goes its own way.
pub(super) async fn together<A, B>(
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
pub(super) async fn race_permit(store: &dyn Store) -> (Permit, String) {
    let mut pol = policy();
    pol.rules.max_calls.insert("pay".into(), 1000);
    pol.rules.budget = Some(1_000_000);
    pol.rules.cost.insert("pay".into(), CostRule::Fixed(7));
    make_permit(store, pol, T0 + 100 * HOUR).await
}

/// The figures of `r` as (calls left, budget left).
pub(super) fn figures(r: &AuthorizeResponse) -> (Option<u64>, Option<u64>) {
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

/// The request of a filter that forwards `forwarded` in the `Idempotency-Key` header.
pub(super) fn forwarding(mut r: AuthorizeRequest, forwarded: &str) -> AuthorizeRequest {
    r.forwarded_key = Some(forwarded.into());
    r.forwarded_key_carriers = KeyCarriers::NONE.with(KeyCarrier::Header);
    r
}

/// The same request with the forwarded key in `carriers` instead.
pub(super) fn carried_in(mut r: AuthorizeRequest, carriers: &[KeyCarrier]) -> AuthorizeRequest {
    r.forwarded_key_carriers = carriers.iter().copied().collect();
    r
}

pub(super) fn carriers_of(a: &crate::model::Attempt) -> Vec<KeyCarrier> {
    a.forwarded_key_carriers.iter().collect()
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

/// The kids a store publishes at `now`, newest first.
pub(super) async fn published_kids(store: &dyn Store, now: i64) -> Vec<String> {
    store
        .published_signing_keys(now)
        .await
        .unwrap()
        .into_iter()
        .map(|k| k.kid)
        .collect()
}

/// A resolution by a person, for the purge tests.
pub(super) fn resolved_by_person(executed: bool) -> ResolveInput {
    ResolveInput {
        executed,
        receipt: None,
        note: None,
        by: "t".into(),
        source: Default::default(),
    }
}

/// Attempts per state over the whole store, the states with none left out.
pub(super) async fn nonzero_counts(store: &dyn Store) -> BTreeMap<AttemptState, u64> {
    let mut counts = store.attempt_counts().await.unwrap();
    counts.retain(|_, n| *n > 0);
    counts
}

/// A credential as a store receives it: `sealed` stands for a sealed secret (the stores
/// keep it as text and never open it).
pub(super) fn credential(name: &str, header: &str, sealed: &str, at: i64) -> StoredCredential {
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
