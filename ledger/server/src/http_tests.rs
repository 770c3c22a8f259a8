//! HTTP tests of the server: authentication of both APIs, the admin JSON shapes, h2c.
//!
//! They serve the routes on the embedded store: built with the `sqlite` feature.

#![cfg(feature = "sqlite")]

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use crate::metrics::Metrics;
use crate::server::{self, AppState, ServerConfig};
use atmost_ledger::clock::ManualClock;
use atmost_ledger::store::sqlite::SqliteStore;

pub(crate) const SVC: &str = "service-secret";
pub(crate) const ADM: &str = "admin-secret";

pub(crate) struct TestServer {
    pub base: String,
    pub http: reqwest::Client,
    pub state: Arc<AppState>,
    pub clock: Arc<ManualClock>,
    /// One value is one SIGTERM, as the ledger's signal handler forwards it (crate::drain).
    pub stop_signals: tokio::sync::mpsc::Sender<()>,
    /// The server task: it ends once the drain is over and in-flight requests are done.
    pub served: tokio::task::JoinHandle<()>,
    _dir: tempfile::TempDir,
}

/// The drain delay of the test servers: longer than any test, so only a second signal ends it.
const TEST_DRAIN_DELAY: Duration = Duration::from_secs(3600);

async fn start() -> TestServer {
    start_with(|_| {}).await
}

/// A ledger on a loopback port with a manual clock and a fresh SQLite store; `configure`
/// may change its config first (the tokens are [`SVC`] and [`ADM`]).
pub(crate) async fn start_with(configure: impl FnOnce(&mut ServerConfig)) -> TestServer {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(1_800_000_000_000));
    let mut config = ServerConfig {
        service_token: SVC.into(),
        admin_token: ADM.into(),
        lease: Duration::from_secs(60),
        redaction: Default::default(),
        inbox: Default::default(),
    };
    configure(&mut config);
    let state = Arc::new(AppState {
        store: Arc::new(SqliteStore::open_dir(dir.path()).unwrap()),
        clock: clock.clone(),
        config,
        metrics: Arc::new(Metrics::new().unwrap()),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = server::router(state.clone());
    let (stop_signals, received) = tokio::sync::mpsc::channel(4);
    let stop = crate::drain::drain_then_stop(received, state.metrics.clone(), TEST_DRAIN_DELAY);
    let served = tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(stop)
            .await;
    });
    TestServer {
        base: format!("http://{addr}"),
        http: reqwest::Client::new(),
        state,
        clock,
        stop_signals,
        served,
        _dir: dir,
    }
}

impl TestServer {
    pub async fn post(&self, path: &str, token: Option<&str>, body: Value) -> (u16, Value) {
        let mut rb = self.http.post(format!("{}{path}", self.base)).json(&body);
        if let Some(t) = token {
            rb = rb.bearer_auth(t);
        }
        let resp = rb.send().await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    pub async fn get(&self, path: &str, token: Option<&str>) -> (u16, Value) {
        let mut rb = self.http.get(format!("{}{path}", self.base));
        if let Some(t) = token {
            rb = rb.bearer_auth(t);
        }
        let resp = rb.send().await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
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
    let s = start().await;
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
    server::sweep_once(&s.state).await;
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

    let text = s
        .http
        .get(format!("{}/metrics", s.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
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
    let (st, _) = s
        .post(
            &format!("/admin/v1/permits/{id}/revoke"),
            Some(ADM),
            json!({}),
        )
        .await;
    assert_eq!(st, 200);
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
    let metrics = s.state.metrics.render().unwrap();
    assert!(metrics.contains("\natmost_draining 1\n"), "{metrics}");
    // A second signal skips the hour-long delay: the server shuts down and its task ends.
    s.stop_signals.send(()).await.unwrap();
    tokio::time::timeout(Duration::from_secs(60), s.served)
        .await
        .expect("the server did not stop after the second signal")
        .unwrap();
}
