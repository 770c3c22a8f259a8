//! HTTP tests of the server: authentication of both APIs, the admin JSON shapes, h2c.
//!
//! They serve the routes on the embedded store: built with the `sqlite` feature.

#![cfg(feature = "sqlite")]

use std::future::IntoFuture;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use crate::metrics::Metrics;
use crate::server;
use crate::state::{AppState, ServerConfig};
use crate::sweeper::sweep_once;
use atmost_ledger::clock::{Clock, ManualClock};
use atmost_ledger::store::sqlite::SqliteStore;

pub(crate) const SVC: &str = "service-secret";
pub(crate) const ADM: &str = "admin-secret";

pub(crate) struct TestServer {
    /// The API listener (`--listen`).
    pub base: String,
    /// The admin listener (`--admin-listen`): the admin API and the inbox.
    pub admin: String,
    pub http: reqwest::Client,
    pub state: Arc<AppState>,
    pub clock: Arc<ManualClock>,
    /// One value is one SIGTERM, as the ledger's signal handler forwards it (crate::drain).
    pub stop_signals: tokio::sync::mpsc::Sender<()>,
    /// The server task: it ends once the drain is over and in-flight requests are done.
    pub served: tokio::task::JoinHandle<std::io::Result<()>>,
    /// The admin listener's task, which stops with the same drain.
    pub admin_served: tokio::task::JoinHandle<std::io::Result<()>>,
    /// Where its SQLite file lives (shared with the servers started beside it).
    pub data_dir: std::path::PathBuf,
    _dir: Option<tempfile::TempDir>,
}

/// The drain delay of the test servers: longer than any test, so only a second signal ends it.
const TEST_DRAIN_DELAY: Duration = Duration::from_secs(3600);

async fn start() -> TestServer {
    start_with(|_| {}).await
}

/// A ledger on a loopback port with a manual clock and a fresh SQLite store; `configure`
/// may change its config first (the tokens are [`SVC`] and [`ADM`]).
pub(crate) async fn start_with(configure: impl FnOnce(&mut ServerConfig)) -> TestServer {
    let dir = tempfile::tempdir().unwrap();
    start_in(dir.path().to_path_buf(), Some(dir), configure).await
}

/// Another ledger on the same SQLite file as `first`, as a second replica (its own clock,
/// at the same time).
pub(crate) async fn start_beside(
    first: &TestServer,
    configure: impl FnOnce(&mut ServerConfig),
) -> TestServer {
    let s = start_in(first.data_dir.clone(), None, configure).await;
    s.clock.set(first.clock.now_ms());
    s
}

async fn start_in(
    data_dir: std::path::PathBuf,
    dir: Option<tempfile::TempDir>,
    configure: impl FnOnce(&mut ServerConfig),
) -> TestServer {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let clock = Arc::new(ManualClock::new(1_800_000_000_000));
    let mut config = ServerConfig {
        service_token: SVC.into(),
        admins: crate::admins::Admins::shared(ADM),
        lease: Duration::from_secs(60),
        callout_timeout: Duration::from_secs(30),
        redaction: Default::default(),
        inbox: Default::default(),
        key_refresh: Duration::from_secs(5),
        receipt_issuer: "atmost-test".into(),
        tool_refusal_keys: Default::default(),
        auth_limit: Default::default(),
        purge_ended_permits_after: None,
        credential_key: None,
        approvals: Default::default(),
    };
    configure(&mut config);
    let state = Arc::new(AppState::new(
        Arc::new(SqliteStore::open_dir(&data_dir).unwrap()),
        clock.clone(),
        config,
        Arc::new(Metrics::new().unwrap()),
    ));
    state.start_signing().await.unwrap();
    crate::readiness::check_once(&state.readiness, &*state.store, &state.metrics).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let admin_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin_addr = admin_listener.local_addr().unwrap();
    let app = server::api_router(state.clone())
        .into_make_service_with_connect_info::<std::net::SocketAddr>();
    let admin_app = server::admin_router(state.clone())
        .into_make_service_with_connect_info::<std::net::SocketAddr>();
    let (stop_signals, received) = tokio::sync::mpsc::channel(4);
    let shutdown = crate::drain::Shutdown::after(crate::drain::drain_then_stop(
        received,
        state.metrics.clone(),
        TEST_DRAIN_DELAY,
    ));
    let served = tokio::spawn(
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.signal())
            .into_future(),
    );
    let admin_served = tokio::spawn(
        axum::serve(admin_listener, admin_app)
            .with_graceful_shutdown(shutdown.signal())
            .into_future(),
    );
    TestServer {
        base: format!("http://{addr}"),
        admin: format!("http://{admin_addr}"),
        http: reqwest::Client::new(),
        state,
        clock,
        stop_signals,
        served,
        admin_served,
        data_dir,
        _dir: dir,
    }
}

impl TestServer {
    /// The listener that serves `path`: the admin one for `/admin…`, else the API one.
    pub fn url(&self, path: &str) -> String {
        let base = if path.starts_with("/admin") {
            &self.admin
        } else {
            &self.base
        };
        format!("{base}{path}")
    }

    pub async fn post(&self, path: &str, token: Option<&str>, body: Value) -> (u16, Value) {
        let mut rb = self.http.post(self.url(path)).json(&body);
        if let Some(t) = token {
            rb = rb.bearer_auth(t);
        }
        let resp = rb.send().await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    pub async fn get(&self, path: &str, token: Option<&str>) -> (u16, Value) {
        let mut rb = self.http.get(self.url(path));
        if let Some(t) = token {
            rb = rb.bearer_auth(t);
        }
        let resp = rb.send().await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    /// What a scrape of `/metrics` reads.
    pub async fn metrics(&self) -> String {
        let resp = self.http.get(self.url("/metrics")).send().await.unwrap();
        resp.text().await.unwrap()
    }

    /// Revokes the permit `id` (answered 200).
    pub async fn revoke(&self, id: &str) {
        let path = format!("/admin/v1/permits/{id}/revoke");
        let (st, v) = self.post(&path, Some(ADM), json!({})).await;
        assert_eq!(st, 200, "{v}");
    }

    pub async fn create_permit(&self, body: Value) -> (String, String) {
        let (st, v) = self.post("/admin/v1/permits", Some(ADM), body).await;
        assert_eq!(st, 201, "{v}");
        (
            v["id"].as_str().unwrap().into(),
            v["token"].as_str().unwrap().into(),
        )
    }
}

/// The receipt [`complete`] reports.
const SMALL_RECEIPT: &str = r#"{"jsonrpc":"2.0","id":1,"result":{}}"#;

/// Reports the round 1 of a Dispatch answer `d` completed, with [`SMALL_RECEIPT`].
async fn complete(s: &TestServer, d: &Value) {
    let (_, acks) = s
        .post(
            "/v1/outcomes",
            Some(SVC),
            json!({"reports": [{"attempt_id": d["attempt_id"], "round": 1,
                                "capability": d["capability"], "outcome": "completed",
                                "receipt": SMALL_RECEIPT}]}),
        )
        .await;
    assert_eq!(acks, json!({"acks": ["applied"]}));
}

fn authz(token: &str, key: &str, fp: &str) -> Value {
    json!({"permit_token": token, "tool": "pay", "idempotency_key": key, "fingerprint": fp, "arguments": {"amount": 3}})
}

#[tokio::test]
async fn service_api_needs_the_service_token() {
    let s = start().await;
    let body = json!({"permit_token": "x", "tool": "t", "fingerprint": "f"});
    for tok in [None, Some("wrong"), Some(ADM), Some("")] {
        let (st, v) = s.post("/v1/authorize", tok, body.clone()).await;
        assert_eq!(
            (st, v.clone()),
            (401, json!({"error": "unauthorized"})),
            "{tok:?}"
        );
        let (st, _) = s.post("/v1/outcomes", tok, json!({"reports": []})).await;
        assert_eq!(st, 401);
    }
    // Basic auth or a bare token is not a bearer token.
    let resp = s
        .http
        .post(format!("{}/v1/authorize", s.base))
        .header("authorization", SVC)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 401);
    let (st, v) = s.post("/v1/authorize", Some(SVC), body).await;
    assert_eq!(st, 200);
    assert_eq!(v["decision"], "deny");
    assert_eq!(v["code"], "permit_invalid");
    let (st, v) = s.post("/v1/authorize", Some(SVC), json!({"nope": 1})).await;
    assert_eq!(st, 400, "{v}");
}

#[tokio::test]
async fn admin_api_needs_the_admin_token() {
    // More wrong tokens than the per-source limit lets through with 401.
    let s = start_with(|c| c.auth_limit.max_failures = 1000).await;
    for tok in [None, Some("wrong"), Some(SVC)] {
        assert_eq!(s.get("/admin/v1/permits", tok).await.0, 401);
        assert_eq!(s.get("/admin/v1/attempts", tok).await.0, 401);
        let (st, v) = s
            .post(
                "/admin/v1/permits",
                tok,
                json!({"label": "x", "expires": "1h"}),
            )
            .await;
        assert_eq!((st, v), (401, json!({"error": "unauthorized"})));
        assert_eq!(
            s.post("/admin/v1/permits/pmt_x/revoke", tok, json!({}))
                .await
                .0,
            401
        );
        assert_eq!(
            s.post(
                "/admin/v1/attempts/att_x/resolve",
                tok,
                json!({"executed": true, "by": "x"})
            )
            .await
            .0,
            401
        );
    }
    assert_eq!(
        s.get("/admin/v1/permits", Some(ADM)).await,
        (200, json!({"permits": []}))
    );
    // Health, readiness and metrics need no token.
    assert_eq!(s.get("/healthz", None).await.0, 200);
    assert_eq!(s.get("/readyz", None).await.0, 200);
}

#[tokio::test]
async fn create_permit_validates_input() {
    let s = start().await;
    for body in [
        json!({"label": "", "expires": "1h"}),
        json!({"label": "x", "expires": "yesterday"}),
        json!({"label": "x", "expires": "2001-01-01T00:00:00Z"}),
        json!({"label": "x", "expires": "1h", "tools": []}),
        json!({"label": "x", "expires": "1h", "cost": {"pay": "amount"}}),
        json!({"label": "x", "expires": "1h", "duplicate_guard": "maybe"}),
        json!({"label": "x", "expires": "1h", "retention": "forever"}),
    ] {
        let (st, v) = s.post("/admin/v1/permits", Some(ADM), body.clone()).await;
        assert_eq!(st, 400, "{body} → {v}");
        assert_eq!(v["error"], "bad_request");
    }
}

#[tokio::test]
async fn full_flow_over_http() {
    let s = start().await;
    let (id, tok) = s
        .create_permit(json!({
            "label": "agent-7", "expires": "24h", "tools": ["pay", "search"],
            "max_calls": {"pay": 1}, "budget": 100, "cost": {"pay": "/amount"},
            "duplicate_guard": "enforce", "retention": "7d"
        }))
        .await;
    assert!(tok.starts_with(&format!("atmp_{id}_")));
    let (_, created) = s
        .post(
            "/admin/v1/permits",
            Some(ADM),
            json!({"label": "shape", "expires": "1h"}),
        )
        .await;
    for field in [
        "id",
        "token",
        "label",
        "status",
        "expires_at",
        "tools",
        "duplicate_guard",
    ] {
        assert!(created.get(field).is_some(), "{field} missing in {created}");
    }
    assert_eq!(created["tools"], json!(["*"]));
    assert_eq!(created["duplicate_guard"], "log");

    // The token is shown once: list and show never carry it.
    let (_, list) = s.get("/admin/v1/permits", Some(ADM)).await;
    assert_eq!(list["permits"].as_array().unwrap().len(), 2);
    assert!(!list.to_string().contains(&tok));
    let p = list["permits"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["id"] == json!(id))
        .unwrap();
    assert_eq!(p["status"], "active");
    assert_eq!(p["max_calls"], json!({"pay": 1}));
    assert_eq!(p["cost"], json!({"pay": "/amount"}));
    assert_eq!(p["retention_secs"], json!(7 * 24 * 3600));

    let (st, d) = s
        .post("/v1/authorize", Some(SVC), authz(&tok, "k1", "fp1"))
        .await;
    assert_eq!(st, 200);
    assert_eq!(d["decision"], "dispatch", "{d}");
    assert_eq!(d["lease_ms"], 60_000);
    let attempt = d["attempt_id"].as_str().unwrap().to_string();
    assert_eq!(d["round"], 1);
    let capability = d["capability"].as_str().unwrap().to_string();
    assert_eq!(capability.len(), 64, "256 bits, hex");

    // h2c prior knowledge, as Envoy speaks it.
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let resp = h2
        .post(format!("{}/v1/authorize", s.base))
        .bearer_auth(SVC)
        .json(&authz(&tok, "k2", "fp2"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.version(), reqwest::Version::HTTP_2);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["code"], "permit_max_calls_exceeded");
    assert_eq!(
        v["data"],
        json!({"tool": "pay", "limit": 1, "calls_made": 1})
    );

    let receipt = r#"{"jsonrpc":"2.0","id":7,"result":{"content":[]}}"#;
    let (st, v) = s
        .post(
            "/v1/outcomes",
            Some(SVC),
            json!({"reports": [
                // The service token alone: a forged release is refused before anything else.
                {"attempt_id": attempt, "round": 1, "capability": "0".repeat(64), "outcome": "released", "reason": "x"},
                {"attempt_id": attempt, "round": 1, "capability": capability, "outcome": "completed", "receipt": receipt},
                {"attempt_id": attempt, "round": 1, "capability": capability, "outcome": "completed", "receipt": receipt},
                {"attempt_id": attempt, "round": 1, "capability": capability, "outcome": "released", "reason": "x"},
                {"attempt_id": "att_unknown", "round": 1, "capability": capability, "outcome": "uncertain", "reason": "x"}
            ]}),
        )
        .await;
    assert_eq!(st, 200);
    assert_eq!(
        v,
        json!({"acks": ["refused", "applied", "already_recorded", "conflict", "unknown_attempt"]})
    );
    // A report without round and capability is not a report.
    let (st, _) = s
        .post(
            "/v1/outcomes",
            Some(SVC),
            json!({"reports": [{"attempt_id": attempt, "outcome": "released", "reason": "x"}]}),
        )
        .await;
    assert_eq!(st, 400);
    let (_, v) = s
        .post("/v1/authorize", Some(SVC), authz(&tok, "k1", "fp1"))
        .await;
    assert_eq!(
        v,
        json!({"decision": "replay", "attempt_id": attempt, "receipt": receipt,
               "limits": {"calls_left": 0, "budget_left": 97, "expires_at": v["limits"]["expires_at"]}})
    );

    // A search call that goes uncertain, then is resolved by a person.
    let (_, d) = s
        .post(
            "/v1/authorize",
            Some(SVC),
            json!({"permit_token": tok, "tool": "search", "idempotency_key": "s1", "fingerprint": "fs", "arguments": {}}),
        )
        .await;
    let unc = d["attempt_id"].as_str().unwrap().to_string();
    s.clock.advance_ms(61_000);
    sweep_once(&s.state).await;
    let (st, v) = s
        .get(
            &format!("/admin/v1/attempts?state=uncertain&permit={id}"),
            Some(ADM),
        )
        .await;
    assert_eq!(st, 200);
    assert_eq!(v["attempts"].as_array().unwrap().len(), 1);
    assert_eq!(v["attempts"][0]["id"], json!(unc));
    assert_eq!(v["attempts"][0]["reason"], "lease_expired");
    assert_eq!(
        s.get("/admin/v1/attempts?state=bogus", Some(ADM)).await.0,
        400
    );

    let (st, v) = s
        .post(
            &format!("/admin/v1/attempts/{unc}/resolve"),
            Some(ADM),
            json!({"executed": false, "note": "provider shows nothing", "by": "alice"}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["attempt"]["state"], "resolved_not_executed");
    assert_eq!(v["attempt"]["resolution"]["by"], "alice");
    assert_eq!(v["attempt"]["resolution"]["note"], "provider shows nothing");
    let (st, v) = s
        .post(
            &format!("/admin/v1/attempts/{unc}/resolve"),
            Some(ADM),
            json!({"executed": true, "by": "alice"}),
        )
        .await;
    assert_eq!((st, v["error"].clone()), (409, json!("not_uncertain")));
    assert_eq!(
        s.post(
            "/admin/v1/attempts/att_nope/resolve",
            Some(ADM),
            json!({"executed": true, "by": "a"})
        )
        .await
        .0,
        404
    );
    assert_eq!(
        s.post(
            &format!("/admin/v1/attempts/{unc}/resolve"),
            Some(ADM),
            json!({"executed": true, "by": ""})
        )
        .await
        .0,
        400
    );

    let (st, v) = s.get(&format!("/admin/v1/permits/{id}"), Some(ADM)).await;
    assert_eq!(st, 200);
    assert_eq!(v["usage"]["pay"], json!({"calls_made": 1, "limit": 1}));
    assert_eq!(
        v["usage"]["search"],
        json!({"calls_made": 0, "limit": null})
    );
    assert_eq!(
        v["budget"],
        json!({"budget": 100, "spent": 3, "reserved": 0, "left": 97})
    );
    assert_eq!(v["attempts"]["completed"], 1);
    assert_eq!(v["attempts"]["resolved_not_executed"], 1);
    assert_eq!(v["attempts"]["uncertain"], 0);
    assert_eq!(s.get("/admin/v1/permits/pmt_nope", Some(ADM)).await.0, 404);

    let (st, v) = s
        .post(
            &format!("/admin/v1/permits/{id}/revoke"),
            Some(ADM),
            json!({}),
        )
        .await;
    assert_eq!((st, v["permit"]["status"].clone()), (200, json!("revoked")));
    let (_, v) = s
        .post("/v1/authorize", Some(SVC), authz(&tok, "k1", "fp1"))
        .await;
    assert_eq!(v["code"], "permit_invalid");

    let text = s.metrics().await;
    assert!(
        text.contains(r#"atmost_authorize_total{code="none",decision="dispatch"} 2"#),
        "{text}"
    );
    assert!(text
        .contains(r#"atmost_authorize_total{code="permit_max_calls_exceeded",decision="deny"} 1"#));
    assert!(text.contains(r#"atmost_outcomes_total{ack="applied",kind="completed"} 1"#));
    assert!(
        text.contains(r#"atmost_outcome_reports_refused_total{kind="released"} 1"#),
        "{text}"
    );
    assert!(text.contains("atmost_leases_expired_total 1"));
    assert!(text.contains("atmost_sweeps_total 1"));
    let oversold = ["exactly", "once"].join(" ");
    assert!(!text.to_lowercase().contains(&oversold));
}

/// The store's gauges are read when `/metrics` is scraped (the sweep no longer reads them),
/// at most once a second.
#[tokio::test]
async fn a_scrape_reads_the_attempt_gauges_from_the_store() {
    let s = start().await;
    let (_, tok) = s
        .create_permit(json!({"label": "l", "expires": "1h", "tools": ["pay"]}))
        .await;
    // The gauges a scrape shows: in flight, uncertain, seconds uncertain the longest.
    let gauges = || async {
        let text = s.metrics().await;
        [
            r#"atmost_attempts{state="in_flight"} "#,
            r#"atmost_attempts{state="uncertain"} "#,
            "atmost_uncertain_oldest_seconds ",
        ]
        .map(|name| {
            text.lines()
                .find_map(|l| l.strip_prefix(name))
                .unwrap_or("missing")
                .to_string()
        })
    };
    let (_, v) = s
        .post("/v1/authorize", Some(SVC), authz(&tok, "k1", "fp1"))
        .await;
    assert_eq!(v["decision"], "dispatch");
    assert_eq!(gauges().await, ["1", "0", "0"]);

    // The lease runs out; 30 s later a scrape (a second after the last) reads the change.
    s.clock.advance_ms(61_000);
    sweep_once(&s.state).await;
    s.clock.advance_ms(30_000);
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert_eq!(gauges().await, ["0", "1", "30"]);
}

#[tokio::test]
async fn limits_name_each_tool_asked_about_under_the_service_token() {
    let s = start().await;
    let (id, tok) = s
        .create_permit(
            json!({"label": "l", "expires": "1h", "tools": ["pay", "echo"],
                              "max_calls": {"pay": 2}, "budget": 100, "cost": {"pay": "/amount"}}),
        )
        .await;
    let body = json!({"permit_token": tok, "tools": ["pay", "echo", "refund"]});
    for bad in [None, Some(ADM)] {
        assert_eq!(s.post("/v1/limits", bad, body.clone()).await.0, 401);
    }
    let (st, v) = s
        .post("/v1/authorize", Some(SVC), authz(&tok, "k1", "f1"))
        .await;
    assert_eq!((st, v["decision"].as_str()), (200, Some("dispatch")), "{v}");
    let expires = v["limits"]["expires_at"].clone();
    assert_eq!(
        v["limits"],
        json!({"calls_left": 1, "budget_left": 97, "expires_at": expires})
    );
    let (st, v) = s.post("/v1/limits", Some(SVC), body).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        v,
        json!({"tools": {
            "pay": {"calls_left": 1, "budget_left": 97, "expires_at": expires},
            "echo": {"calls_left": null, "budget_left": 97, "expires_at": expires},
            "refund": {"calls_left": 0, "budget_left": 97, "expires_at": expires}}})
    );
    // A token naming the permit with another secret, one naming no permit, and the right
    // token once the permit is revoked: no figures.
    let forged = format!("{}{}", &tok[..tok.len() - 4], "0000");
    let refused = |token: String| {
        let s = &s;
        async move {
            s.post(
                "/v1/limits",
                Some(SVC),
                json!({"permit_token": token, "tools": ["pay"]}),
            )
            .await
        }
    };
    assert_ne!(forged, tok);
    assert_eq!(
        refused(forged).await,
        (403, json!({"error": "permit_invalid"}))
    );
    assert_eq!(
        refused("atmp_nope".into()).await,
        (403, json!({"error": "permit_invalid"}))
    );
    s.revoke(&id).await;
    assert_eq!(
        refused(tok.clone()).await,
        (403, json!({"error": "permit_invalid"}))
    );
    let many: Vec<String> = (0..=atmost_protocol::MAX_LIMITS_TOOLS)
        .map(|i| format!("t{i}"))
        .collect();
    let (st, v) = s
        .post(
            "/v1/limits",
            Some(SVC),
            json!({"permit_token": tok, "tools": many}),
        )
        .await;
    assert_eq!(st, 400, "{v}");
    assert_eq!(
        s.post("/v1/limits", Some(SVC), json!({"tools": []}))
            .await
            .0,
        400
    );
}

/// The key the filter says it forwards is kept and shown by the admin API (with the
/// arguments, configured fields redacted); a value no upstream could have received is
/// refused, and nothing is reserved for it.
#[tokio::test]
async fn the_forwarded_key_is_kept_and_shown_and_a_bad_one_refused() {
    let s = start_with(|c| {
        c.redaction = crate::redact::Redaction::new(&["/card", "CVC"]).unwrap();
    })
    .await;
    let (pid, tok) = s
        .create_permit(json!({"label": "a", "expires": "1h", "max_calls": {"pay": 1}}))
        .await;
    let call = |forwarded: Value| {
        json!({"permit_token": tok, "tool": "pay", "idempotency_key": "k", "fingerprint": "fp",
               "forwarded_key": forwarded,
               "arguments": {"amount": 3, "card": {"number": "4242"}, "extra": {"cvc": "123"}}})
    };
    for bad in [
        json!(""),
        json!("a\u{1}b"),
        json!("x".repeat(256)),
        json!(7),
    ] {
        let (st, v) = s.post("/v1/authorize", Some(SVC), call(bad.clone())).await;
        assert_eq!(st, 400, "{bad} → {v}");
    }
    let (_, shown) = s.get(&format!("/admin/v1/permits/{pid}"), Some(ADM)).await;
    assert_eq!(shown["usage"]["pay"]["calls_made"], 0);
    let hmac = "408b0daca3160e8ff7fd072dcc9c1d11edad614663ea292eeebc3eaf3890a0c0";
    let (_, d) = s.post("/v1/authorize", Some(SVC), call(json!(hmac))).await;
    let id = d["attempt_id"].as_str().unwrap();
    let (st, a) = s.get(&format!("/admin/v1/attempts/{id}"), Some(ADM)).await;
    assert_eq!(st, 200);
    assert_eq!(a["attempt"]["forwarded_key"], hmac);
    assert_eq!(
        a["attempt"]["arguments"],
        json!({"amount": 3, "card": "[redacted]", "extra": {"cvc": "[redacted]"}})
    );
    let (_, list) = s.get("/admin/v1/attempts", Some(ADM)).await;
    assert_eq!(list["attempts"][0]["forwarded_key"], hmac);
    // A call without a key (or under `upstream_key.mode: off`) forwards none.
    let (_, d) = s
        .post(
            "/v1/authorize",
            Some(SVC),
            json!({"permit_token": tok, "tool": "other", "fingerprint": "f2"}),
        )
        .await;
    let id = d["attempt_id"].as_str().unwrap();
    let (_, a) = s.get(&format!("/admin/v1/attempts/{id}"), Some(ADM)).await;
    assert_eq!(a["attempt"]["forwarded_key"], Value::Null);
    assert_eq!(a["attempt"]["forwarded_key_carriers"], json!([]));
}

/// Where the upstream received the forwarded key is kept and shown with it; carriers without
/// a value, or a carrier the ledger does not know, are refused and nothing is reserved.
#[tokio::test]
async fn the_forwarded_keys_carriers_are_kept_and_shown_and_bad_ones_refused() {
    let s = start().await;
    let (pid, tok) = s
        .create_permit(json!({"label": "a", "expires": "1h", "max_calls": {"pay": 1}}))
        .await;
    let call = |forwarded: Value, carriers: Value| {
        json!({"permit_token": tok, "tool": "pay", "idempotency_key": "k", "fingerprint": "fp",
               "forwarded_key": forwarded, "forwarded_key_carriers": carriers})
    };
    for (forwarded, carriers) in [
        (Value::Null, json!(["header"])),
        (json!("fwd"), json!(["cookie"])),
        (json!("fwd"), json!("header")),
    ] {
        let (st, v) = s
            .post(
                "/v1/authorize",
                Some(SVC),
                call(forwarded, carriers.clone()),
            )
            .await;
        assert_eq!(st, 400, "{carriers} → {v}");
    }
    let (_, shown) = s.get(&format!("/admin/v1/permits/{pid}"), Some(ADM)).await;
    assert_eq!(shown["usage"]["pay"]["calls_made"], 0);
    let (st, d) = s
        .post(
            "/v1/authorize",
            Some(SVC),
            call(json!("fwd"), json!(["params.idempotencyKey", "header"])),
        )
        .await;
    assert_eq!((st, &d["decision"]), (200, &json!("dispatch")), "{d}");
    let id = d["attempt_id"].as_str().unwrap();
    let (_, a) = s.get(&format!("/admin/v1/attempts/{id}"), Some(ADM)).await;
    assert_eq!(
        a["attempt"]["forwarded_key_carriers"],
        json!(["header", "params.idempotencyKey"])
    );
}

#[tokio::test]
async fn a_stop_signal_turns_readiness_off_while_calls_are_still_served() {
    let s = start().await;
    let (_, tok) = s
        .create_permit(json!({"label": "drain", "expires": "1h"}))
        .await;
    assert_eq!(
        s.get("/readyz", None).await,
        (200, json!({"status": "ready"}))
    );
    s.stop_signals.send(()).await.unwrap();
    // The drain task takes the signal on its own; readiness turns off as soon as it has.
    let mut readiness = s.get("/readyz", None).await;
    for _ in 0..1000 {
        if readiness.0 != 200 {
            break;
        }
        tokio::task::yield_now().await;
        readiness = s.get("/readyz", None).await;
    }
    assert_eq!(readiness.0, 503, "{readiness:?}");
    assert_eq!(readiness.1["error"], "draining", "{readiness:?}");
    // Everything else is served as before the signal.
    let (st, v) = s
        .post(
            "/v1/authorize",
            Some(SVC),
            authz(&tok, "k-drain", "f-drain"),
        )
        .await;
    assert_eq!((st, v["decision"].as_str()), (200, Some("dispatch")), "{v}");
    assert_eq!(s.get("/healthz", None).await.0, 200);
    assert_eq!(s.get("/admin/v1/permits", Some(ADM)).await.0, 200);
    let metrics = s.state.metrics.render().unwrap();
    assert!(metrics.contains("\natmost_draining 1\n"), "{metrics}");
    // A second signal skips the hour-long delay: both listeners shut down and their tasks end.
    s.stop_signals.send(()).await.unwrap();
    tokio::time::timeout(Duration::from_secs(60), s.served)
        .await
        .expect("the server did not stop after the second signal")
        .unwrap()
        .unwrap();
    tokio::time::timeout(Duration::from_secs(60), s.admin_served)
        .await
        .expect("the admin listener did not stop after the second signal")
        .unwrap()
        .unwrap();
}

/// The body digest every signed call below names (SHA-256 of "test").
const BODY_SHA256: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

/// What the filter would send upstream for a call whose upstream receives `forwarded` as its
/// `Idempotency-Key` (none: no header).
fn dispatch_target(forwarded: Option<&str>) -> Value {
    let mut d = json!({"method": "POST", "authority": "tools.example:8443", "path": "/mcp",
                       "body_sha256": BODY_SHA256, "validity_s": 30});
    if let Some(k) = forwarded {
        d["idempotency_key"] = json!(k);
    }
    d
}

/// A call with a dispatch target: the upstream receives `forwarded-<key>`.
fn signed_call(token: &str, tool: &str, key: &str, fp: &str) -> Value {
    let forwarded = format!("forwarded-{key}");
    json!({"permit_token": token, "tool": tool, "idempotency_key": key, "fingerprint": fp,
           "arguments": {"amount": 3}, "forwarded_key": forwarded,
           "dispatch": dispatch_target(Some(&forwarded))})
}

/// `GET /v1/keys`: its JWK Set, after checking its content type and cache lifetime.
async fn jwks(s: &TestServer) -> atmost_protocol::signature::Jwks {
    let resp = s
        .http
        .get(format!(
            "{}{}",
            s.base,
            atmost_protocol::signature::KEYS_PATH
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_string())
    };
    assert_eq!(
        header("content-type").as_deref(),
        Some("application/jwk-set+json")
    );
    assert_eq!(header("cache-control").as_deref(), Some("max-age=60"));
    resp.json().await.unwrap()
}

fn kids(set: &atmost_protocol::signature::Jwks) -> Vec<String> {
    set.keys.iter().map(|k| k.kid.clone()).collect()
}

/// Checks a Dispatch answer's signature the way a verifier does: the base rebuilt by the
/// protocol module from the request the target describes, the key looked up by `keyid` in
/// the published set, ring's Ed25519. Answers the parsed input; a tampered digest must fail.
fn verify_answer(
    answer: &Value,
    target: &Value,
    set: &atmost_protocol::signature::Jwks,
) -> atmost_protocol::signature::SignatureInput {
    use atmost_protocol::signature::{
        content_digest_from_hex, parse_signature, SignatureInput, SignedRequest,
    };
    use ring::signature::{UnparsedPublicKey, ED25519};
    assert_eq!(answer["decision"], "dispatch", "{answer}");
    let input =
        SignatureInput::parse(answer["signature"]["signature_input"].as_str().unwrap()).unwrap();
    let signature = parse_signature(answer["signature"]["signature"].as_str().unwrap()).unwrap();
    let keyid = input.string("keyid").unwrap();
    let jwk = set
        .keys
        .iter()
        .find(|k| k.kid == keyid)
        .unwrap_or_else(|| panic!("keyid {keyid} is not published: {set:?}"));
    let public = jwk.ed25519_public_key().unwrap();
    let digest = content_digest_from_hex(target["body_sha256"].as_str().unwrap()).unwrap();
    let request = SignedRequest {
        method: target["method"].as_str().unwrap(),
        authority: target["authority"].as_str().unwrap(),
        path: target["path"].as_str().unwrap(),
        content_digest: &digest,
        idempotency_key: target["idempotency_key"].as_str(),
    };
    let base = request.signature_base(&input).unwrap();
    let verifier = UnparsedPublicKey::new(&ED25519, &public);
    assert!(
        verifier.verify(base.as_bytes(), &signature).is_ok(),
        "{base}"
    );
    let other = atmost_protocol::signature::content_digest_of(b"another body");
    let tampered = SignedRequest {
        content_digest: &other,
        ..request
    };
    let base = tampered.signature_base(&input).unwrap();
    assert!(verifier.verify(base.as_bytes(), &signature).is_err());
    input
}

fn keyid(input: &atmost_protocol::signature::SignatureInput) -> String {
    input.string("keyid").unwrap().to_string()
}

/// A call naming its dispatch target gets a signature over that request, by the key
/// `/v1/keys` publishes, created at the ledger's clock and naming the dispatch; so does
/// each continuation round. Replays, denials and calls without a target carry none.
#[tokio::test]
async fn a_dispatch_is_signed_by_the_published_key_and_verifies() {
    let s = start().await;
    let set = jwks(&s).await;
    assert_eq!(set.keys.len(), 1, "{set:?}");
    let (pid, tok) = s
        .create_permit(json!({"label": "sig", "expires": "1h", "max_calls": {"pay": 1}}))
        .await;
    let call = signed_call(&tok, "pay", "k1", "fp1");
    let (st, d) = s.post("/v1/authorize", Some(SVC), call.clone()).await;
    assert_eq!(st, 200);
    let input = verify_answer(&d, &call["dispatch"], &set);
    assert_eq!(keyid(&input), set.keys[0].kid);
    let created = u64::try_from(s.clock.now_ms() / 1000).unwrap();
    assert_eq!(input.integer("created"), Some(created));
    assert_eq!(input.integer("expires"), Some(created + 30));
    let nonce =
        atmost_protocol::signature::DispatchNonce::parse(input.string("nonce").unwrap()).unwrap();
    assert_eq!(nonce.attempt_id, d["attempt_id"].as_str().unwrap());
    assert_eq!(
        (nonce.round, nonce.permit_id.as_str(), nonce.tool.as_str()),
        (1, pid.as_str(), "pay")
    );
    assert!(input.components.iter().any(|c| c == "idempotency-key"));

    let attempt = d["attempt_id"].as_str().unwrap();
    let capability = d["capability"].as_str().unwrap();
    let (_, acks) = s
        .post(
            "/v1/outcomes",
            Some(SVC),
            json!({"reports": [{"attempt_id": attempt, "round": 1, "capability": capability,
                                "outcome": "completed", "receipt": "{}"}]}),
        )
        .await;
    assert_eq!(acks, json!({"acks": ["applied"]}));
    let (_, replay) = s.post("/v1/authorize", Some(SVC), call.clone()).await;
    assert_eq!(replay["decision"], "replay", "{replay}");
    assert!(replay.get("signature").is_none(), "{replay}");
    let (_, deny) = s
        .post(
            "/v1/authorize",
            Some(SVC),
            signed_call(&tok, "pay", "k2", "fp2"),
        )
        .await;
    assert_eq!(deny["code"], "permit_max_calls_exceeded", "{deny}");
    assert!(deny.get("signature").is_none(), "{deny}");
    // Without a target the call is answered as before signatures: dispatched, unsigned.
    let (_, plain) = s
        .post(
            "/v1/authorize",
            Some(SVC),
            json!({"permit_token": tok, "tool": "search", "fingerprint": "f3"}),
        )
        .await;
    assert_eq!(plain["decision"], "dispatch", "{plain}");
    assert!(plain.get("signature").is_none(), "{plain}");

    // A continuation is a new dispatch of the same attempt: signed again, naming round 2,
    // and a target without a forwarded key covers no idempotency-key.
    let first = json!({"permit_token": tok, "tool": "ask", "idempotency_key": "c1",
                       "fingerprint": "fc", "dispatch": dispatch_target(None)});
    let (_, d1) = s.post("/v1/authorize", Some(SVC), first.clone()).await;
    let input1 = verify_answer(&d1, &first["dispatch"], &set);
    assert!(!input1.components.iter().any(|c| c == "idempotency-key"));
    let (_, acks) = s
        .post(
            "/v1/outcomes",
            Some(SVC),
            json!({"reports": [{"attempt_id": d1["attempt_id"], "round": 1,
                                "capability": d1["capability"], "outcome": "input_required",
                                "receipt": "{}"}]}),
        )
        .await;
    assert_eq!(acks, json!({"acks": ["applied"]}));
    s.clock.advance_ms(2_000);
    let mut again = first.clone();
    again["continuation"] = json!(true);
    let (_, d2) = s.post("/v1/authorize", Some(SVC), again.clone()).await;
    assert_eq!(
        (d2["attempt_id"].clone(), d2["round"].clone()),
        (d1["attempt_id"].clone(), json!(2)),
        "{d2}"
    );
    let input2 = verify_answer(&d2, &again["dispatch"], &set);
    let nonce2 =
        atmost_protocol::signature::DispatchNonce::parse(input2.string("nonce").unwrap()).unwrap();
    assert_eq!(nonce2.round, 2);
    assert_eq!(input2.integer("created"), Some(created + 2));

    let metrics = s.state.metrics.render().unwrap();
    assert!(
        metrics.contains("\natmost_dispatches_signed_total 3\n"),
        "{metrics}"
    );
}

/// A target the ledger could not sign as the upstream will receive it is refused before
/// anything is decided: 400, naming what is wrong, and no slot taken.
#[tokio::test]
async fn a_bad_dispatch_target_is_refused_and_nothing_is_reserved() {
    let s = start().await;
    let (pid, tok) = s
        .create_permit(json!({"label": "bad", "expires": "1h", "max_calls": {"pay": 1}}))
        .await;
    let good = signed_call(&tok, "pay", "k1", "fp1");
    let with = |field: &str, value: Value| {
        let mut call = good.clone();
        call["dispatch"][field] = value;
        call
    };
    for (call, named) in [
        (with("method", json!("PO ST")), "dispatch.method"),
        (
            with("authority", json!("Tools.Example")),
            "dispatch.authority",
        ),
        (with("path", json!("/mcp?x=1")), "dispatch.path"),
        (with("body_sha256", json!("00")), "dispatch.body_sha256"),
        (with("validity_s", json!(301)), "dispatch.validity_s"),
        (with("validity_s", json!(0)), "dispatch.validity_s"),
        (with("idempotency_key", json!("another")), "forwarded_key"),
    ] {
        let (st, v) = s.post("/v1/authorize", Some(SVC), call.clone()).await;
        assert_eq!(
            (st, v["error"].as_str()),
            (400, Some("bad_request")),
            "{call} → {v}"
        );
        assert!(v["message"].as_str().unwrap().contains(named), "{v}");
    }
    let (_, shown) = s.get(&format!("/admin/v1/permits/{pid}"), Some(ADM)).await;
    assert_eq!(shown["usage"]["pay"]["calls_made"], 0);
    let (_, d) = s.post("/v1/authorize", Some(SVC), good).await;
    assert_eq!(d["decision"], "dispatch", "{d}");
}

/// A callout timeout the ledger cannot read is refused before anything is decided: the call
/// is denied, its slot untouched; a readable one (or none: `--callout-timeout`) is decided.
#[tokio::test]
async fn an_unreadable_callout_timeout_is_refused_and_nothing_is_reserved() {
    let s = start().await;
    let (pid, tok) = s
        .create_permit(json!({"label": "t", "expires": "1h", "max_calls": {"pay": 1}}))
        .await;
    let post = |timeout: &'static str| {
        s.http
            .post(s.url("/v1/authorize"))
            .bearer_auth(SVC)
            .header(atmost_protocol::CALLOUT_TIMEOUT_HEADER, timeout)
            .json(&authz(&tok, "k1", "fp1"))
            .send()
    };
    for bad in ["0", "-5", "1.5", "soon", ""] {
        let resp = post(bad).await.unwrap();
        let status = resp.status().as_u16();
        let v: Value = resp.json().await.unwrap_or(Value::Null);
        assert_eq!(
            (status, v["error"].as_str()),
            (400, Some("bad_request")),
            "{bad:?} → {v}"
        );
        assert!(
            v["message"]
                .as_str()
                .unwrap_or_default()
                .contains("atmost-callout-timeout-ms"),
            "{v}"
        );
    }
    let (_, shown) = s.get(&format!("/admin/v1/permits/{pid}"), Some(ADM)).await;
    assert_eq!(shown["usage"]["pay"]["calls_made"], 0);
    let resp = post(" 2500 ").await.unwrap();
    let d: Value = resp.json().await.unwrap_or(Value::Null);
    assert_eq!(d["decision"], "dispatch", "{d}");
}

/// Every stored private key, read from the database file itself.
fn stored_private_keys(s: &TestServer) -> Vec<String> {
    let db =
        rusqlite::Connection::open(s.data_dir.join(atmost_ledger::store::sqlite::DB_FILE)).unwrap();
    let mut st = db
        .prepare("SELECT private_pkcs8 FROM signing_keys")
        .unwrap();
    st.query_map([], |r| r.get::<_, String>(0))
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

/// Two ledgers on one store sign with one key. A rotation on one: its next signature names
/// the new key, the other picks it up on its next read of the key, `/v1/keys` lists both
/// until the old key's signatures have all expired, then only the new one. No answer, no
/// listing and no metric carries a private key.
#[tokio::test]
async fn replicas_sign_with_one_key_and_a_rotation_reaches_both() {
    let a = start().await;
    let b = start_beside(&a, |c| c.key_refresh = Duration::ZERO).await;
    let (_, tok) = a
        .create_permit(json!({"label": "two", "expires": "1h"}))
        .await;
    let set = jwks(&a).await;
    assert_eq!(kids(&set), kids(&jwks(&b).await));
    let old = set.keys[0].kid.clone();
    let mut n = 0;
    let mut sign_on = |s: &TestServer| {
        n += 1;
        let call = signed_call(&tok, "pay", &format!("k{n}"), &format!("f{n}"));
        let (base, http) = (s.base.clone(), s.http.clone());
        async move {
            let d: Value = http
                .post(format!("{base}/v1/authorize"))
                .bearer_auth(SVC)
                .json(&call)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            (d, call)
        }
    };
    for s in [&a, &b] {
        let (d, call) = sign_on(s).await;
        assert_eq!(keyid(&verify_answer(&d, &call["dispatch"], &set)), old);
    }

    let (st, rotated) = a.post("/admin/v1/keys/rotate", Some(ADM), json!({})).await;
    assert_eq!(st, 200, "{rotated}");
    let new = rotated["key"]["kid"].as_str().unwrap().to_string();
    assert_ne!(new, old);
    assert_eq!(rotated["key"]["status"], "active");
    assert_eq!(rotated["retired"]["kid"], json!(old));
    assert_eq!(rotated["retired"]["status"], "retired");
    let set = jwks(&a).await;
    assert_eq!(kids(&set), vec![new.clone(), old.clone()]);
    assert_eq!(kids(&jwks(&b).await), vec![new.clone(), old.clone()]);
    for s in [&a, &b] {
        let (d, call) = sign_on(s).await;
        assert_eq!(keyid(&verify_answer(&d, &call["dispatch"], &set)), new);
    }

    // The old key's last signature (300 s at most) has expired, and the margin has passed.
    for s in [&a, &b] {
        s.clock.advance_ms(360_000);
    }
    assert_eq!(kids(&jwks(&a).await), vec![new.clone(), old.clone()]);
    for s in [&a, &b] {
        s.clock.advance_ms(1);
    }
    assert_eq!(kids(&jwks(&a).await), vec![new.clone()]);
    let (st, listed) = a.get("/admin/v1/keys", Some(ADM)).await;
    assert_eq!(st, 200);
    let statuses: Vec<(String, String)> = listed["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| {
            (
                k["kid"].as_str().unwrap().into(),
                k["status"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(
        statuses,
        vec![
            (new.clone(), "active".into()),
            (old.clone(), "unpublished".into())
        ]
    );
    assert_eq!(listed["keys"][0]["published_until"], Value::Null);
    assert!(listed["keys"][1]["published_until"].is_string());
    for tok in [None, Some(SVC)] {
        assert_eq!(a.get("/admin/v1/keys", tok).await.0, 401);
        assert_eq!(a.post("/admin/v1/keys/rotate", tok, json!({})).await.0, 401);
    }

    let secrets = stored_private_keys(&a);
    assert_eq!(secrets.len(), 2);
    let shown = [
        serde_json::to_string(&jwks(&a).await).unwrap(),
        listed.to_string(),
        rotated.to_string(),
        a.state.metrics.render().unwrap(),
        format!("{:?} {:?}", a.state.signer, a.state.config),
    ];
    for secret in &secrets {
        for text in &shown {
            assert!(!text.contains(secret.as_str()), "{text}");
            // The 32-byte seed (bytes 16..48 of the document; its tail is the public key).
            assert!(!text.contains(&secret[24..60]), "{text}");
        }
    }
    let metrics = a.state.metrics.render().unwrap();
    assert!(
        metrics.contains("\natmost_signing_key_rotations_total 1\n"),
        "{metrics}"
    );
}

/// A key row that holds no usable key, or no active key at all: a call naming a dispatch
/// target is denied `gateway_unavailable` before anything is decided, and no attempt is
/// stored. A call without a target is not signed, so it is still answered.
#[tokio::test]
async fn without_a_readable_key_a_signed_call_is_denied_and_nothing_stored() {
    let s = start_with(|c| c.key_refresh = Duration::ZERO).await;
    let (pid, tok) = s
        .create_permit(json!({"label": "corrupt", "expires": "1h"}))
        .await;
    let db =
        rusqlite::Connection::open(s.data_dir.join(atmost_ledger::store::sqlite::DB_FILE)).unwrap();
    for damage in [
        "UPDATE signing_keys SET private_pkcs8 = 'AAAA'",
        "DELETE FROM signing_keys",
    ] {
        db.execute_batch(damage).unwrap();
        let (st, d) = s
            .post(
                "/v1/authorize",
                Some(SVC),
                signed_call(&tok, "pay", "k1", "fp1"),
            )
            .await;
        assert_eq!(st, 200);
        assert_eq!(
            (d["decision"].as_str(), d["code"].as_str()),
            (Some("deny"), Some("gateway_unavailable")),
            "{damage}: {d}"
        );
        let (_, listed) = s
            .get(&format!("/admin/v1/attempts?permit={pid}"), Some(ADM))
            .await;
        assert_eq!(listed, json!({"attempts": []}), "{damage}");
    }
    let metrics = s.state.metrics.render().unwrap();
    assert!(
        metrics.contains(r#"atmost_authorize_total{code="gateway_unavailable",decision="deny"} 2"#),
        "{metrics}"
    );
    let (_, plain) = s
        .post(
            "/v1/authorize",
            Some(SVC),
            json!({"permit_token": tok, "tool": "pay", "fingerprint": "f"}),
        )
        .await;
    assert_eq!(plain["decision"], "dispatch", "{plain}");
    // The ledger makes sure of a key again at its next start.
    s.state.start_signing().await.unwrap();
    let (_, d) = s
        .post(
            "/v1/authorize",
            Some(SVC),
            signed_call(&tok, "pay", "k1", "fp1"),
        )
        .await;
    verify_answer(
        &d,
        &signed_call(&tok, "pay", "k1", "fp1")["dispatch"],
        &jwks(&s).await,
    );
}

/// The header and claims of a compact JWS, after checking its EdDSA signature with the
/// published key its `kid` names.
fn verified_receipt(jws: &str, set: &atmost_protocol::signature::Jwks) -> (Value, Value) {
    use atmost_protocol::signature::b64url_decode;
    use ring::signature::{UnparsedPublicKey, ED25519};
    let parts: Vec<&str> = jws.split('.').collect();
    assert_eq!(parts.len(), 3, "{jws}");
    let header: Value = serde_json::from_slice(&b64url_decode(parts[0]).unwrap()).unwrap();
    let claims: Value = serde_json::from_slice(&b64url_decode(parts[1]).unwrap()).unwrap();
    let jwk = set
        .keys
        .iter()
        .find(|k| json!(k.kid) == header["kid"])
        .unwrap_or_else(|| panic!("{header} names no published key"));
    let verifier = UnparsedPublicKey::new(&ED25519, jwk.ed25519_public_key().unwrap());
    let signed = format!("{}.{}", parts[0], parts[1]);
    verifier
        .verify(signed.as_bytes(), &b64url_decode(parts[2]).unwrap())
        .unwrap();
    (header, claims)
}

/// The export signs one receipt per attempt the filters let through, with the active key:
/// each states what the ledger recorded, resolution included, and verifies with `/v1/keys`.
#[tokio::test]
async fn attempts_export_as_receipts_signed_by_the_active_key() {
    let s = start().await;
    let (pid, tok) = s
        .create_permit(json!({"label": "export", "expires": "1h"}))
        .await;
    let (_, other_tok) = s
        .create_permit(json!({"label": "other", "expires": "1h"}))
        .await;
    let (_, done) = s
        .post(
            "/v1/authorize",
            Some(SVC),
            signed_call(&tok, "pay", "k1", "fp1"),
        )
        .await;
    complete(&s, &done).await;
    s.clock.advance_ms(1_000);
    let (_, lost) = s
        .post("/v1/authorize", Some(SVC), authz(&tok, "k2", "fp2"))
        .await;
    s.clock.advance_ms(61_000);
    sweep_once(&s.state).await;
    let lost_id = lost["attempt_id"].as_str().unwrap();
    let (st, _) = s
        .post(
            &format!("/admin/v1/attempts/{lost_id}/resolve"),
            Some(ADM),
            json!({"executed": false, "by": "alice", "note": "not at the provider"}),
        )
        .await;
    assert_eq!(st, 200);
    s.post("/v1/authorize", Some(SVC), authz(&other_tok, "k3", "fp3"))
        .await;

    let set = jwks(&s).await;
    let (st, export) = s
        .get(
            &format!("/admin/v1/attempts/export?permit={pid}"),
            Some(ADM),
        )
        .await;
    assert_eq!(st, 200, "{export}");
    assert_eq!(export["kid"], json!(set.keys[0].kid));
    let receipts: Vec<(Value, Value)> = export["receipts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| verified_receipt(r.as_str().unwrap(), &set))
        .collect();
    assert_eq!(receipts.len(), 2, "{export}");
    let (header, resolved) = &receipts[0];
    assert_eq!(
        header,
        &json!({"alg": "EdDSA", "kid": set.keys[0].kid, "typ": "atmost-receipt+jwt"})
    );
    assert_eq!(resolved["attempt_id"], json!(lost_id));
    assert_eq!(resolved["state"], "resolved_not_executed");
    assert_eq!(resolved["reason"], "lease_expired");
    assert_eq!(resolved["iss"], "atmost-test");
    assert_eq!(resolved["iat"], json!(s.clock.now_ms() / 1000));
    assert_eq!(resolved["resolution"]["by"], "alice");
    assert_eq!(resolved["resolution"]["executed"], false);
    assert_eq!(resolved["resolution"]["source"], "person");
    assert_eq!(resolved["resolution"]["note"], "not at the provider");
    let (_, completed) = &receipts[1];
    assert_eq!(completed["attempt_id"], done["attempt_id"]);
    assert_eq!(
        (
            completed["permit_id"].as_str(),
            completed["tool"].as_str(),
            completed["fingerprint"].as_str()
        ),
        (Some(pid.as_str()), Some("pay"), Some("fp1"))
    );
    assert_eq!(completed["forwarded_key"], "forwarded-k1");
    assert_eq!(
        completed["key_sha256"],
        json!(atmost_ledger::token::sha256_hex("k1"))
    );
    assert_eq!(completed["rounds"], 1);
    assert_eq!(completed["state"], "completed");
    assert_eq!(
        completed["receipt_sha256"],
        json!(atmost_ledger::token::sha256_hex(SMALL_RECEIPT))
    );
    assert!(completed["finished_at"].is_string());
    assert_eq!(completed["resolution"], Value::Null);
    // The attempts list's filters apply.
    let (_, only) = s
        .get("/admin/v1/attempts/export?state=completed", Some(ADM))
        .await;
    assert_eq!(only["receipts"].as_array().unwrap().len(), 1, "{only}");
    let (_, all) = s.get("/admin/v1/attempts/export", Some(ADM)).await;
    assert_eq!(all["receipts"].as_array().unwrap().len(), 3, "{all}");
    assert_eq!(
        s.get("/admin/v1/attempts/export?state=bogus", Some(ADM))
            .await
            .0,
        400
    );
    for tok in [None, Some(SVC)] {
        assert_eq!(s.get("/admin/v1/attempts/export", tok).await.0, 401);
    }
    // After a rotation the export is signed by the new key.
    s.post("/admin/v1/keys/rotate", Some(ADM), json!({})).await;
    let set = jwks(&s).await;
    let (_, after) = s.get("/admin/v1/attempts/export", Some(ADM)).await;
    assert_eq!(after["kid"], json!(set.keys[0].kid));
    assert_ne!(after["kid"], export["kid"]);
    for r in after["receipts"].as_array().unwrap() {
        verified_receipt(r.as_str().unwrap(), &set);
    }
}

#[tokio::test]
async fn the_api_listener_has_no_admin_door_and_the_admin_listener_no_filter_api() {
    let s = start().await;
    for path in ["/admin", "/admin/", "/admin/sign-in", "/admin/v1/permits"] {
        let resp = s
            .http
            .get(format!("{}{path}", s.base))
            .bearer_auth(ADM)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 404, "{path}");
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["error"], "admin_elsewhere", "{path}");
    }
    for path in ["/v1/authorize", "/v1/outcomes", "/v1/limits"] {
        let resp = s
            .http
            .post(format!("{}{path}", s.admin))
            .bearer_auth(SVC)
            .json(&json!({}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 404, "{path}");
    }
    for path in ["/readyz", "/metrics"] {
        let status = s
            .http
            .get(format!("{}{path}", s.admin))
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(status.as_u16(), 404, "{path}");
    }
    assert_eq!(s.get("/admin/v1/permits", Some(ADM)).await.0, 200);
}

#[tokio::test]
async fn wrong_tokens_past_the_limit_get_429_and_the_right_one_always_passes() {
    let s = start_with(|c| c.auth_limit.max_failures = 3).await;
    let body = json!({"permit_token": "x", "tool": "t", "fingerprint": "f"});
    for _ in 0..3 {
        assert_eq!(
            s.post("/v1/authorize", Some("wrong"), body.clone()).await.0,
            401
        );
    }
    let resp = s
        .http
        .post(format!("{}/v1/authorize", s.base))
        .bearer_auth("wrong")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 429);
    let retry: u64 = resp.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"], "too_many_failures");
    // The right tokens, from the same source, are never limited.
    let (st, v) = s.post("/v1/authorize", Some(SVC), body.clone()).await;
    assert_eq!((st, v["code"].as_str()), (200, Some("permit_invalid")));
    // The admin API counts against the same source.
    assert_eq!(s.get("/admin/v1/permits", None).await.0, 429);
    assert_eq!(s.get("/admin/v1/permits", Some(ADM)).await.0, 200);
    let limited = |api: &str| s.state.metrics.auth_limited.with_label_values(&[api]).get();
    assert_eq!((limited("service"), limited("admin")), (1, 1));
}

#[tokio::test]
async fn readyz_answers_from_the_background_check_without_reading_the_store() {
    let s = start().await;
    let checks = || {
        s.state
            .metrics
            .readiness_checks
            .with_label_values(&["ok"])
            .get()
    };
    let before = checks();
    assert_eq!(before, 1, "one check before the listener answers");
    for _ in 0..500 {
        assert_eq!(s.get("/readyz", None).await.0, 200);
    }
    // No background task runs in the test server: every answer came from the one check.
    assert_eq!(checks(), before);
    crate::readiness::check_once(&s.state.readiness, &*s.state.store, &s.state.metrics).await;
    assert_eq!(checks(), before + 1);
}

#[tokio::test]
async fn each_new_reservation_is_counted_by_the_share_of_each_limit_it_left() {
    let s = start().await;
    let (_, tok) = s
        .create_permit(
            json!({"label": "l", "expires": "1h", "max_calls": {"pay": 2},
                              "budget": 10, "cost": {"pay": "/amount"}}),
        )
        .await;
    // 3 each: calls 1 of 2 and budget 7 of 10 left, then 0 of 2 and 4 of 10.
    for key in ["k1", "k2", "k1"] {
        let (st, v) = s
            .post("/v1/authorize", Some(SVC), authz(&tok, key, "f"))
            .await;
        assert_eq!(st, 200, "{v}");
    }
    // Denied past the cap: nothing reserved, nothing counted.
    let (_, v) = s
        .post("/v1/authorize", Some(SVC), authz(&tok, "k3", "f3"))
        .await;
    assert_eq!(v["code"], "permit_max_calls_exceeded", "{v}");
    let metrics = s.state.metrics.render().unwrap();
    for line in [
        r#"atmost_permit_left_ratio_bucket{limit="calls",le="0"} 1"#,
        r#"atmost_permit_left_ratio_bucket{limit="calls",le="0.25"} 1"#,
        r#"atmost_permit_left_ratio_bucket{limit="calls",le="0.5"} 2"#,
        r#"atmost_permit_left_ratio_count{limit="calls"} 2"#,
        r#"atmost_permit_left_ratio_bucket{limit="budget",le="0.25"} 0"#,
        r#"atmost_permit_left_ratio_bucket{limit="budget",le="0.5"} 1"#,
        r#"atmost_permit_left_ratio_bucket{limit="budget",le="1"} 2"#,
        r#"atmost_permit_left_ratio_count{limit="budget"} 2"#,
    ] {
        assert!(
            metrics.contains(&format!("\n{line}\n")),
            "{line}\n{metrics}"
        );
    }
}

/// The sweeper purges an ended permit's history once `purge_ended_permits_after` has passed
/// since it ended, never before, counts what it deleted, and the permit's token is denied
/// `permit_invalid` from then on.
#[tokio::test]
async fn the_sweeper_purges_ended_permits_after_the_delay() {
    let s = start_with(|c| c.purge_ended_permits_after = Some(Duration::from_secs(600))).await;
    let (_, tok) = s
        .create_permit(json!({"label": "task", "expires": "5m"}))
        .await;
    let (_, d) = s
        .post("/v1/authorize", Some(SVC), authz(&tok, "k1", "fp1"))
        .await;
    complete(&s, &d).await;
    let purged = |s: &TestServer| {
        let text = s.state.metrics.render().unwrap();
        [
            "atmost_attempts_purged_total 1",
            "atmost_permits_purged_total 1",
        ]
        .map(|line| text.lines().any(|l| l == line))
    };

    // Ended (5 min) but not for 10 min yet: kept, and the key still replays.
    s.clock.advance_ms(15 * 60_000 - 1);
    sweep_once(&s.state).await;
    assert_eq!(purged(&s), [false, false]);
    let (_, v) = s
        .post("/v1/authorize", Some(SVC), authz(&tok, "k1", "fp1"))
        .await;
    assert_eq!(v["decision"], "replay");

    s.clock.advance_ms(1);
    sweep_once(&s.state).await;
    assert_eq!(purged(&s), [true, true]);
    for key in ["k1", "k2"] {
        let (st, v) = s
            .post("/v1/authorize", Some(SVC), authz(&tok, key, "fp1"))
            .await;
        assert_eq!(
            (st, v["decision"].clone(), v["code"].clone()),
            (200, json!("deny"), json!("permit_invalid"))
        );
    }
    let (st, v) = s.get("/admin/v1/permits", Some(ADM)).await;
    assert_eq!(st, 200);
    assert_eq!(v["permits"], json!([]), "{v}");
}

#[tokio::test]
async fn reports_riding_on_an_authorize_are_applied_and_acked_whatever_its_decision() {
    let s = start().await;
    let (_, tok) = s
        .create_permit(
            json!({"label": "riders", "expires": "1h", "tools": ["pay"], "max_calls": {"pay": 3}}),
        )
        .await;
    let mut dispatched = Vec::new();
    for i in 1..=3 {
        let mut call = authz(&tok, &format!("k{i}"), &format!("fp{i}"));
        // Each call carries the report of the one before it, as a filter's next call does, and
        // before it the same report under a capability the holder of the service token could
        // make up: that one moves nothing, the true one beside it does. The first call's
        // rider names an attempt that does not exist.
        if let Some(before) = dispatched.last() {
            let before: &Value = before;
            let report = |capability: &Value| {
                json!({"attempt_id": before["attempt_id"], "round": 1, "capability": capability,
                       "outcome": "completed", "receipt": SMALL_RECEIPT})
            };
            call["reports"] = json!([
                report(&json!("0".repeat(64))),
                report(&before["capability"])
            ]);
        } else {
            call["reports"] = json!([{"attempt_id": "att_forged", "round": 1,
                "capability": "0".repeat(64), "outcome": "completed", "receipt": SMALL_RECEIPT}]);
        }
        let (st, d) = s.post("/v1/authorize", Some(SVC), call).await;
        assert_eq!((st, &d["decision"]), (200, &json!("dispatch")), "{d}");
        let expected = if i == 1 {
            json!(["unknown_attempt"])
        } else {
            json!(["refused", "applied"])
        };
        assert_eq!(d["report_acks"], expected, "{d}");
        dispatched.push(d);
    }
    // The first call's key replays the receipt that rode on the second: it was applied.
    let (_, replay) = s
        .post("/v1/authorize", Some(SVC), authz(&tok, "k1", "fp1"))
        .await;
    assert_eq!(replay["decision"], "replay", "{replay}");
    assert_eq!(replay["receipt"], SMALL_RECEIPT);
    assert!(replay.get("report_acks").is_none(), "{replay}");
    // A denied call takes its riders too, the same report twice acknowledged in order.
    let third = &dispatched[2];
    let rider = json!({"attempt_id": third["attempt_id"], "round": 1,
        "capability": third["capability"], "outcome": "completed", "receipt": SMALL_RECEIPT});
    let mut denied = authz(&tok, "k4", "fp4");
    denied["reports"] = json!([rider, rider]);
    let (st, d) = s.post("/v1/authorize", Some(SVC), denied).await;
    assert_eq!(st, 200);
    assert_eq!(d["code"], "permit_max_calls_exceeded", "{d}");
    assert_eq!(d["report_acks"], json!(["applied", "already_recorded"]));
    let scraped = s.metrics().await;
    assert!(
        scraped.contains(r#"atmost_outcome_reports_ridden_total{result="taken"} 7"#),
        "{scraped}"
    );
    // More riders than one authorize may carry: refused whole, nothing decided or applied.
    let mut crowded = authz(&tok, "k5", "fp5");
    crowded["reports"] = Value::Array(vec![rider; atmost_protocol::MAX_RIDING_REPORTS + 1]);
    let (st, v) = s.post("/v1/authorize", Some(SVC), crowded).await;
    assert_eq!(st, 400, "{v}");
    assert!(
        v["message"].as_str().unwrap_or("").contains("at most 16"),
        "{v}"
    );
    let (_, list) = s.get("/admin/v1/attempts", Some(ADM)).await;
    let states: Vec<&str> = list["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["state"].as_str().unwrap())
        .collect();
    assert_eq!(states, ["completed"; 3], "{list}");
}

/// The ledger's body limit, which the filter's batches of reports (4 MiB of receipts) and its
/// riders (1 MiB) keep well under: a body past it is refused whole, whatever it carries.
#[tokio::test]
async fn a_body_past_the_limit_is_refused_whole() {
    let s = start().await;
    let receipt = "x".repeat(server::MAX_BODY_BYTES / 8 + 1);
    let reports: Vec<Value> = (0..8)
        .map(|i| {
            json!({"attempt_id": format!("att_{i}"), "round": 1, "capability": "c",
                        "outcome": "completed", "receipt": receipt})
        })
        .collect();
    let (st, v) = s
        .post("/v1/outcomes", Some(SVC), json!({"reports": reports}))
        .await;
    assert_eq!((st, &v["error"]), (400, &json!("bad_request")), "{v}");
    assert!(
        v["message"].as_str().unwrap_or("").contains("length limit"),
        "{v}"
    );
    let (st, v) = s
        .post("/v1/outcomes", Some(SVC), json!({"reports": reports[..1]}))
        .await;
    assert_eq!((st, &v["acks"]), (200, &json!(["unknown_attempt"])), "{v}");
}
