//! The inbox over HTTP, as a browser would use it (cookies kept, redirects not followed),
//! on a ledger with a manual clock: sign-in, sessions and their expiry, CSRF, the security
//! headers, and a resolution moving the permit's slot and budget.
//!
//! Served on the embedded store: built with the `sqlite` feature.

#![cfg(feature = "sqlite")]

use std::collections::BTreeMap;
use std::time::Duration;

use reqwest::header::{HeaderMap, LOCATION, SET_COOKIE};
use serde_json::{json, Value};

use super::CONTENT_SECURITY_POLICY;
use crate::http_tests::{start_with, TestServer, ADM, SVC};
use crate::redact::Redaction;
use atmost_ledger::model::AttemptState;

/// A browser's view of the inbox: the cookies it was given, sent back on every request.
struct Browser<'a> {
    s: &'a TestServer,
    http: reqwest::Client,
    cookies: BTreeMap<String, String>,
    /// Whether a TLS-terminating proxy stands in front (`X-Forwarded-Proto: https`).
    https: bool,
}

struct Page {
    status: u16,
    headers: HeaderMap,
    body: String,
}

impl Page {
    fn set_cookie(&self, name: &str) -> Option<String> {
        self.headers
            .get_all(SET_COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .find(|v| v.starts_with(&format!("{name}=")))
            .map(str::to_string)
    }

    /// The value of the hidden `csrf` field of the page's first form.
    fn csrf(&self) -> String {
        let at = self
            .body
            .find("name=\"csrf\" value=\"")
            .expect("a CSRF field")
            + 19;
        self.body[at..].split('"').next().unwrap().to_string()
    }
}

impl<'a> Browser<'a> {
    fn new(s: &'a TestServer) -> Self {
        Browser {
            s,
            http: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .unwrap(),
            cookies: BTreeMap::new(),
            https: false,
        }
    }

    fn request(&self, rb: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        let mut rb = rb;
        if !self.cookies.is_empty() {
            let header: Vec<String> = self
                .cookies
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            rb = rb.header("cookie", header.join("; "));
        }
        if self.https {
            rb = rb.header("x-forwarded-proto", "https");
        }
        rb
    }

    async fn finish(&mut self, rb: reqwest::RequestBuilder) -> Page {
        let resp = self.request(rb).send().await.unwrap();
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        for v in headers.get_all(SET_COOKIE).iter() {
            let v = v.to_str().unwrap();
            let (pair, attrs) = v.split_once(';').unwrap_or((v, ""));
            let (name, value) = pair.split_once('=').unwrap();
            if attrs.contains("Max-Age=0") {
                self.cookies.remove(name);
            } else {
                self.cookies.insert(name.into(), value.into());
            }
        }
        Page {
            status,
            headers,
            body: resp.text().await.unwrap(),
        }
    }

    async fn get(&mut self, path: &str) -> Page {
        let rb = self.http.get(format!("{}{path}", self.s.admin));
        self.finish(rb).await
    }

    async fn post(&mut self, path: &str, form: &[(&str, &str)]) -> Page {
        let rb = self.http.post(format!("{}{path}", self.s.admin)).form(form);
        self.finish(rb).await
    }

    /// Signs in as `name` through the form; returns the answer to the form.
    async fn sign_in(&mut self, name: &str, token: &str) -> Page {
        let form = self.get("/admin/sign-in").await;
        assert_eq!(form.status, 200);
        let csrf = form.csrf();
        self.post(
            "/admin/sign-in",
            &[("name", name), ("token", token), ("csrf", &csrf)],
        )
        .await
    }
}

/// A permit with a cap of 1 and a budget, and one call under it that was sent and whose
/// answer was lost (reported `uncertain` by its filter); returns (permit id, attempt id).
pub(crate) async fn lost_call(s: &TestServer) -> (String, String) {
    lost_call_carried(s, None).await
}

/// [`lost_call`] whose filter said where the upstream received the forwarded key
/// (`forwarded_key_carriers`), or said nothing (`None`, as an older filter).
async fn lost_call_carried(s: &TestServer, carriers: Option<Value>) -> (String, String) {
    let (pid, tok) = s
        .create_permit(json!({
            "label": "billing-agent", "expires": "24h", "max_calls": {"pay": 1},
            "budget": 1000, "cost": {"pay": "/amount"}
        }))
        .await;
    let mut asked = json!({"permit_token": tok, "tool": "pay", "idempotency_key": "task-1",
           "fingerprint": "fp", "forwarded_key": "f0rwarded",
           "arguments": {"invoice": "INV-9", "amount": 250, "card": {"number": "4242"}}});
    if let Some(c) = carriers {
        asked["forwarded_key_carriers"] = c;
    }
    let (_, d) = s.post("/v1/authorize", Some(SVC), asked).await;
    assert_eq!(d["decision"], "dispatch", "{d}");
    let id = d["attempt_id"].as_str().unwrap().to_string();
    let (st, acks) = s
        .post(
            "/v1/outcomes",
            Some(SVC),
            json!({"reports": [{"attempt_id": id, "round": d["round"], "capability": d["capability"],
                                "outcome": "uncertain", "reason": "upstream_reset"}]}),
        )
        .await;
    assert_eq!((st, &acks["acks"][0]), (200, &json!("applied")));
    (pid, id)
}

async fn usage(s: &TestServer, pid: &str) -> (Value, Value) {
    let (_, shown) = s.get(&format!("/admin/v1/permits/{pid}"), Some(ADM)).await;
    (shown["usage"]["pay"].clone(), shown["budget"].clone())
}

async fn redacting() -> TestServer {
    start_with(|c| c.redaction = Redaction::new(&["number"]).unwrap()).await
}

#[tokio::test]
async fn a_person_signs_in_sees_the_lost_call_and_resolves_it() {
    let s = redacting().await;
    let (pid, id) = lost_call(&s).await;
    assert_eq!(
        usage(&s, &pid).await,
        (
            json!({"calls_made": 1, "limit": 1}),
            json!({"budget": 1000, "spent": 250, "reserved": 0, "left": 750})
        )
    );
    let mut b = Browser::new(&s);

    let signed = b.sign_in("Ana", ADM).await;
    assert_eq!(signed.status, 303);
    assert_eq!(signed.headers[LOCATION], "/admin/");
    let cookie = signed
        .set_cookie("atmost_session")
        .expect("a session cookie");
    for attr in [
        "HttpOnly",
        "SameSite=Strict",
        "Path=/admin/",
        "Max-Age=3600",
    ] {
        assert!(cookie.contains(attr), "{attr} in {cookie}");
    }
    assert!(!cookie.contains("Secure"), "plain HTTP: {cookie}");
    // The admin token is in no cookie and no URL.
    assert!(!cookie.contains(ADM));

    let inbox = b.get("/admin/").await;
    assert_eq!(inbox.status, 200, "{}", inbox.body);
    assert_eq!(
        inbox.headers["content-security-policy"],
        CONTENT_SECURITY_POLICY
    );
    assert_eq!(inbox.headers["x-frame-options"], "DENY");
    assert!(!inbox.body.contains("<script"));
    for shown in [
        id.as_str(),
        "billing-agent",
        "f0rwarded",
        "INV-9",
        "upstream_reset",
        "uncertain for 0s",
    ] {
        assert!(inbox.body.contains(shown), "{shown} in the inbox");
    }
    assert!(inbox.body.contains("[redacted]") && !inbox.body.contains("4242"));

    let csrf = inbox.csrf();
    let done = b
        .post(
            &format!("/admin/attempts/{id}/resolve"),
            &[
                ("csrf", &csrf),
                ("result", "not_executed"),
                ("note", "no charge for INV-9 in the dashboard"),
            ],
        )
        .await;
    assert_eq!(done.status, 303, "{}", done.body);
    // The slot and the budget come back, as with `atmost attempts resolve --not-executed`.
    assert_eq!(
        usage(&s, &pid).await,
        (
            json!({"calls_made": 0, "limit": 1}),
            json!({"budget": 1000, "spent": 0, "reserved": 0, "left": 1000})
        )
    );
    let (_, a) = s.get(&format!("/admin/v1/attempts/{id}"), Some(ADM)).await;
    assert_eq!(a["attempt"]["state"], "resolved_not_executed");
    assert_eq!(a["attempt"]["resolution"]["by"], "Ana");
    assert_eq!(a["attempt"]["resolution"]["source"], "person");
    assert_eq!(
        a["attempt"]["resolution"]["note"],
        "no charge for INV-9 in the dashboard"
    );

    let inbox = b.get(&format!("/admin/?resolved={id}")).await;
    assert!(!inbox.body.contains("data-state=\"uncertain\""));
    let history = b.get("/admin/history").await;
    for shown in [
        id.as_str(),
        "not executed",
        "Ana",
        "no charge for INV-9 in the dashboard",
    ] {
        assert!(history.body.contains(shown), "{shown} in the history");
    }
    let permits = b.get("/admin/permits").await;
    assert!(permits.body.contains(
        r#"<span class="tool">pay</span> <span><span class="used">0</span> of <span class="limit">1</span></span>"#
    ));
    assert!(permits
        .body
        .contains(r#"<span class="left">1000</span> left"#));

    // Signing out ends the session in this browser.
    let csrf = b.get("/admin/").await.csrf();
    assert_eq!(
        b.post("/admin/sign-out", &[("csrf", &csrf)]).await.status,
        303
    );
    assert_eq!(b.get("/admin/").await.status, 401);
}

#[tokio::test]
async fn a_wrong_token_a_missing_csrf_token_and_an_expired_session_are_refused() {
    let s = start_with(|c| c.inbox.session_ttl = Duration::from_secs(600)).await;
    let (pid, id) = lost_call(&s).await;
    let unchanged = || async { usage(&s, &pid).await.0["calls_made"].clone() };
    let mut b = Browser::new(&s);

    // A wrong token: no session, the form again.
    let wrong = b.sign_in("Mallory", "not-the-admin-token").await;
    assert_eq!(wrong.status, 401);
    assert!(wrong.set_cookie("atmost_session").is_none());
    assert!(wrong.body.contains("That is not the admin token"));
    assert!(s
        .state
        .metrics
        .render()
        .unwrap()
        .contains(r#"atmost_unauthorized_requests_total{api="inbox"} 1"#));
    assert_eq!(b.get("/admin/").await.status, 401);
    // The service token is not the admin token either.
    assert_eq!(b.sign_in("svc", SVC).await.status, 401);
    // A sign-in form not shown by this ledger (no CSRF cookie, or a made-up token).
    let mut stranger = Browser::new(&s);
    let forged = stranger
        .post(
            "/admin/sign-in",
            &[("name", "x"), ("token", ADM), ("csrf", "00")],
        )
        .await;
    assert_eq!(forged.status, 403);
    assert!(forged.set_cookie("atmost_session").is_none());

    assert_eq!(b.sign_in("Ana", ADM).await.status, 303);
    let csrf = b.get("/admin/").await.csrf();
    let path = format!("/admin/attempts/{id}/resolve");
    // A POST without the CSRF token, or with another one, changes nothing.
    for form in [
        vec![("result", "executed"), ("note", "n")],
        vec![("csrf", ""), ("result", "executed"), ("note", "n")],
        vec![("csrf", "deadbeef"), ("result", "executed"), ("note", "n")],
    ] {
        let refused = b.post(&path, &form).await;
        assert_eq!(refused.status, 403, "{form:?}");
        assert!(refused.body.contains("nothing was changed"));
    }
    assert_eq!(unchanged().await, 1);
    let still = s.state.store.get_attempt(&id).await.unwrap().unwrap();
    assert_eq!(still.state, AttemptState::Uncertain);
    // Without a note, or with a result that is neither, nothing happens either.
    for form in [
        [
            ("csrf", csrf.as_str()),
            ("result", "executed"),
            ("note", " "),
        ],
        [("csrf", csrf.as_str()), ("result", "maybe"), ("note", "n")],
    ] {
        assert_eq!(b.post(&path, &form).await.status, 400);
    }

    // Ten minutes later the session has expired: pages and forms are refused.
    s.clock.advance_ms(600_000);
    let expired = b.get("/admin/").await;
    assert_eq!(expired.status, 401);
    assert!(expired.body.contains("Your session has expired"));
    let late = b
        .post(
            &path,
            &[("csrf", &csrf), ("result", "executed"), ("note", "n")],
        )
        .await;
    assert_eq!(late.status, 401);
    assert_eq!(unchanged().await, 1);
    let still = s.state.store.get_attempt(&id).await.unwrap().unwrap();
    assert_eq!(still.state, AttemptState::Uncertain);
    // Signing in again works, and the old CSRF token belongs to the old session.
    assert_eq!(b.sign_in("Ana", ADM).await.status, 303);
    assert_eq!(
        b.post(
            &path,
            &[("csrf", &csrf), ("result", "executed"), ("note", "n")]
        )
        .await
        .status,
        403
    );
}

#[tokio::test]
async fn cookies_are_secure_behind_a_tls_proxy_and_sessions_end_with_the_admin_token() {
    let s = start_with(|c| c.inbox.stuck_after = Duration::from_secs(30)).await;
    let mut b = Browser::new(&s);
    b.https = true;
    let signed = b.sign_in("Ana", ADM).await;
    assert!(signed
        .set_cookie("atmost_session")
        .unwrap()
        .contains("Secure"));
    assert_eq!(b.get("/admin/").await.status, 200);
    // Another ledger with another admin token does not take this session.
    let other =
        start_with(|c| c.admins = crate::admins::Admins::shared("another-admin-token")).await;
    let mut elsewhere = Browser::new(&other);
    elsewhere.cookies = b.cookies.clone();
    assert_eq!(elsewhere.get("/admin/").await.status, 401);
    // Pages are not served under the bearer-token API's paths, nor it under theirs.
    assert_eq!(s.get("/admin/v1/permits", None).await.0, 401);
    let css = b.get("/admin/inbox.css").await;
    assert_eq!(css.status, 200);
    assert!(css.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/css"));
}

#[tokio::test]
async fn a_call_waiting_for_input_is_listed_once_stuck_and_cannot_be_resolved() {
    let s = start_with(|c| c.inbox.stuck_after = Duration::from_secs(30)).await;
    let (_, tok) = s
        .create_permit(json!({"label": "approver", "expires": "24h"}))
        .await;
    let (_, d) = s
        .post(
            "/v1/authorize",
            Some(SVC),
            json!({"permit_token": tok, "tool": "approve", "idempotency_key": "k",
                   "fingerprint": "fp", "arguments": {}}),
        )
        .await;
    let id = d["attempt_id"].as_str().unwrap().to_string();
    s.post(
        "/v1/outcomes",
        Some(SVC),
        json!({"reports": [{"attempt_id": id, "round": 1, "capability": d["capability"],
                            "outcome": "input_required", "receipt": "{}"}]}),
    )
    .await;
    let mut b = Browser::new(&s);
    b.sign_in("Ana", ADM).await;
    assert!(!b.get("/admin/").await.body.contains(&id));
    s.clock.advance_ms(30_000);
    let inbox = b.get("/admin/").await;
    assert!(inbox.body.contains(&id) && inbox.body.contains("waiting for input for 30s"));
    assert!(!inbox
        .body
        .contains(&format!("/admin/attempts/{id}/resolve")));
    let csrf = inbox.csrf();
    let refused = b
        .post(
            &format!("/admin/attempts/{id}/resolve"),
            &[("csrf", &csrf), ("result", "executed"), ("note", "n")],
        )
        .await;
    assert_eq!(refused.status, 409);
}

#[tokio::test]
async fn the_oldest_uncertain_call_is_a_metric() {
    let s = start_with(|_| {}).await;
    let gauge = |s: &TestServer| {
        let text = s.state.metrics.render().unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix("atmost_uncertain_oldest_seconds "))
            .map(str::to_string)
    };
    crate::sweeper::sweep_once(&s.state).await;
    crate::sweeper::read_store_gauges(&s.state).await;
    assert_eq!(gauge(&s).as_deref(), Some("0"));
    let (_, id) = lost_call(&s).await;
    s.clock.advance_ms(90_500);
    crate::sweeper::sweep_once(&s.state).await;
    crate::sweeper::read_store_gauges(&s.state).await;
    assert_eq!(gauge(&s).as_deref(), Some("90.5"));
    let input = atmost_ledger::decide::ResolveInput {
        executed: true,
        receipt: None,
        note: None,
        by: "ops".into(),
        source: Default::default(),
    };
    s.state.store.resolve_attempt(&id, &input, 0).await.unwrap();
    crate::sweeper::sweep_once(&s.state).await;
    crate::sweeper::read_store_gauges(&s.state).await;
    assert_eq!(gauge(&s).as_deref(), Some("0"));
}

/// The card of one attempt on the inbox page.
fn card<'a>(page: &'a Page, id: &str) -> &'a str {
    let start = page
        .body
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("no card for {id}"));
    let end = page.body[start..]
        .find("</article>")
        .map_or(page.body.len(), |e| start + e);
    &page.body[start..end]
}

/// Before choosing "not executed" a person sees where the key went, and a warning when the
/// provider's lookup form (the tool's reconcile rule's, else the header) could not have seen
/// the call under it; the admin API shows the same carriers.
#[tokio::test]
async fn the_attempt_shows_where_its_key_went_and_warns_when_the_lookup_form_could_not_see_it() {
    let s = start_with(|_| {}).await;
    let (_, in_header) = lost_call_carried(&s, Some(json!(["header", "params._meta"]))).await;
    let (_, in_meta) = lost_call_carried(&s, Some(json!(["params._meta"]))).await;
    let (_, unrecorded) = lost_call_carried(&s, None).await;
    let (_, shown) = s
        .get(&format!("/admin/v1/attempts/{in_meta}"), Some(ADM))
        .await;
    assert_eq!(
        shown["attempt"]["forwarded_key_carriers"],
        json!(["params._meta"])
    );
    let (_, shown) = s
        .get(&format!("/admin/v1/attempts/{unrecorded}"), Some(ADM))
        .await;
    assert_eq!(shown["attempt"]["forwarded_key_carriers"], json!([]));

    let mut b = Browser::new(&s);
    b.sign_in("Ana", ADM).await;
    let inbox = b.get("/admin/").await;
    let header_card = card(&inbox, &in_header);
    assert!(header_card.contains(r#"<dd class="key-went">header, params._meta</dd>"#));
    assert!(!header_card.contains("key-warning"), "{header_card}");
    let meta_card = card(&inbox, &in_meta);
    assert!(meta_card.contains(r#"<dd class="key-went">params._meta</dd>"#));
    assert!(
        meta_card.contains("received this key only in params._meta[&#34;dev.atmost/idempotency-key&#34;], not in the Idempotency-Key header: a search there by this value cannot find the call"),
        "{meta_card}"
    );
    // The warning comes before the choice.
    let warned = meta_card.find("key-warning").unwrap();
    assert!(warned < meta_card.find("value=\"not_executed\"").unwrap());
    let unrecorded_card = card(&inbox, &unrecorded);
    assert!(unrecorded_card
        .contains(r#"<dd class="key-went">none recorded (taken as reaching no carrier)</dd>"#));
    assert!(unrecorded_card.contains(
        "did not record where this key went, so it may not have reached the provider in the Idempotency-Key header"
    ));

    // A tool whose reconcile rule looks calls up by `params._meta`: the other way round.
    let s = start_with(|c| {
        c.inbox
            .lookup_forms
            .insert("pay".into(), atmost_ledger::model::KeyCarrier::Meta);
    })
    .await;
    let (_, header_only) = lost_call_carried(&s, Some(json!(["header"]))).await;
    let (_, in_meta) = lost_call_carried(&s, Some(json!(["params._meta"]))).await;
    let mut b = Browser::new(&s);
    b.sign_in("Ana", ADM).await;
    let inbox = b.get("/admin/").await;
    assert!(!card(&inbox, &in_meta).contains("key-warning"));
    let header_card = card(&inbox, &header_only);
    assert!(
        header_card.contains("only in the Idempotency-Key header, not in params._meta[&#34;dev.atmost/idempotency-key&#34;] (where this tool&#39;s reconcile rule looks it up)"),
        "{header_card}"
    );
}

#[tokio::test]
async fn signing_out_ends_the_session_even_for_a_copied_cookie() {
    let s = start_with(|_| {}).await;
    let mut b = Browser::new(&s);
    assert_eq!(b.sign_in("Ana Ops", ADM).await.status, 303);
    // Someone copies the session cookie.
    let mut copy = Browser::new(&s);
    copy.cookies = b.cookies.clone();
    assert_eq!(copy.get("/admin/").await.status, 200);
    let csrf = b.get("/admin/").await.csrf();
    assert_eq!(
        b.post("/admin/sign-out", &[("csrf", &csrf)]).await.status,
        303
    );
    // The copy is as signed out as the browser that signed out.
    let refused = copy.get("/admin/").await;
    assert_eq!(refused.status, 401);
    assert!(
        refused.body.contains("Your session has ended"),
        "{}",
        refused.body
    );
    assert_eq!(copy.get("/admin/history").await.status, 401);
    // And it cannot resolve anything either.
    assert_eq!(
        copy.post(
            "/admin/attempts/att_x/resolve",
            &[("csrf", &csrf), ("executed", "true")]
        )
        .await
        .status,
        401
    );
}

#[tokio::test]
async fn revoking_every_session_ends_them_on_every_replica() {
    let a = start_with(|_| {}).await;
    let b = crate::http_tests::start_beside(&a, |_| {}).await;
    let mut on_a = Browser::new(&a);
    let mut on_b = Browser::new(&b);
    assert_eq!(on_a.sign_in("Ana Ops", ADM).await.status, 303);
    assert_eq!(on_b.sign_in("Bo Ops", ADM).await.status, 303);
    // A session signed in on one replica is good on the other (one store).
    let mut crossed = Browser::new(&b);
    crossed.cookies = on_a.cookies.clone();
    assert_eq!(crossed.get("/admin/").await.status, 200);

    // The admin API needs the admin token.
    let (st, _) = a
        .post("/admin/v1/inbox/sessions/revoke", Some(SVC), json!({}))
        .await;
    assert_eq!(st, 401);
    let (st, v) = a
        .post("/admin/v1/inbox/sessions/revoke", Some(ADM), json!({}))
        .await;
    assert_eq!((st, v), (200, json!({"revoked": 2})));
    for browser in [&mut on_a, &mut on_b, &mut crossed] {
        assert_eq!(browser.get("/admin/").await.status, 401);
    }
    // Signing in again works; nothing was left to revoke but the new session.
    assert_eq!(on_b.sign_in("Bo Ops", ADM).await.status, 303);
    assert_eq!(on_b.get("/admin/").await.status, 200);
    let (_, v) = b
        .post("/admin/v1/inbox/sessions/revoke", Some(ADM), json!({}))
        .await;
    assert_eq!(v, json!({"revoked": 1}));
}

#[tokio::test]
async fn wrong_sign_ins_past_the_limit_get_429_and_the_right_token_still_signs_in() {
    let s = start_with(|c| c.auth_limit.max_failures = 2).await;
    let mut b = Browser::new(&s);
    assert_eq!(b.sign_in("M", "wrong").await.status, 401);
    assert_eq!(b.sign_in("M", "wrong").await.status, 401);
    let limited = b.sign_in("M", "wrong").await;
    assert_eq!(limited.status, 429);
    assert!(limited.body.contains("Too many failed sign-ins"));
    let retry: u64 = limited.headers["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    assert_eq!(b.sign_in("Ana Ops", ADM).await.status, 303);
    assert_eq!(b.get("/admin/").await.status, 200);
}

/// Asks for a call under `token` as a filter would; returns the dispatch (attempt id, round,
/// capability).
async fn dispatch(s: &TestServer, token: &str, tool: &str, key: &str, amount: u64) -> Value {
    let (_, d) = s
        .post(
            "/v1/authorize",
            Some(SVC),
            json!({"permit_token": token, "tool": tool, "idempotency_key": key,
                   "fingerprint": format!("fp-{key}"), "arguments": {"amount": amount}}),
        )
        .await;
    assert_eq!(d["decision"], "dispatch", "{d}");
    d
}

async fn report(s: &TestServer, d: &Value, outcome: Value) {
    let mut r =
        json!({"attempt_id": d["attempt_id"], "round": d["round"], "capability": d["capability"]});
    for (k, v) in outcome.as_object().unwrap() {
        r[k] = v.clone();
    }
    let (st, acks) = s
        .post("/v1/outcomes", Some(SVC), json!({"reports": [r]}))
        .await;
    assert_eq!((st, &acks["acks"][0]), (200, &json!("applied")), "{acks}");
}

/// The part of the page from `from` to the end of its element `until`.
fn part<'a>(body: &'a str, from: &str, until: &str) -> &'a str {
    let start = body.find(from).unwrap_or_else(|| panic!("no {from}"));
    let end = body[start..]
        .find(until)
        .map_or(body.len(), |e| start + e + until.len());
    &body[start..end]
}

#[tokio::test]
async fn the_permits_page_draws_each_cap_and_the_budget_as_bars() {
    let s = start_with(|_| {}).await;
    let (capped, tok) = s
        .create_permit(json!({
            "label": "<script>alert('x')</script> & co", "expires": "24h",
            "max_calls": {"pay": 3, "refund": 0}, "budget": 1000, "cost": {"pay": "/amount"}
        }))
        .await;
    let done = dispatch(&s, &tok, "pay", "k1", 100).await;
    report(&s, &done, json!({"outcome": "completed", "receipt": "{}"})).await;
    // In flight: its slot is held and its cost reserved.
    dispatch(&s, &tok, "pay", "k2", 200).await;
    let (open, tok) = s
        .create_permit(json!({"label": "free", "expires": "24h"}))
        .await;
    let d = dispatch(&s, &tok, "search", "k3", 0).await;
    report(&s, &d, json!({"outcome": "completed", "receipt": "{}"})).await;
    let (full, tok) = s
        .create_permit(
            json!({"label": "spent", "expires": "24h", "max_calls": {"pay": 1},
                              "budget": 50, "cost": {"pay": "/amount"}}),
        )
        .await;
    let d = dispatch(&s, &tok, "pay", "k4", 50).await;
    report(&s, &d, json!({"outcome": "completed", "receipt": "{}"})).await;

    let mut b = Browser::new(&s);
    b.sign_in("Ana", ADM).await;
    let page = b.get("/admin/permits").await;
    assert_eq!(page.status, 200);
    assert_eq!(
        page.headers["content-security-policy"],
        CONTENT_SECURITY_POLICY
    );
    assert!(!page.body.contains("<script") && !page.body.contains("style="));
    assert!(page
        .body
        .contains("&#60;script&#62;alert(&#39;x&#39;)&#60;/script&#62; &#38; co"));

    // pay: 2 of 3, two thirds filled; refund: capped at 0, nothing used, drawn empty.
    let card = part(&page.body, &format!("id=\"{capped}\""), "</article>");
    let pay = part(card, "data-tool=\"pay\"", "</div>");
    assert!(pay.contains(r#"<span class="used">2</span> of <span class="limit">3</span>"#));
    assert!(
        pay.contains(r#"aria-label="pay: 2 of 3 calls used""#),
        "{pay}"
    );
    assert!(
        pay.contains(r#"<rect class="part part-used" x="0" y="0" width="66.66%""#),
        "{pay}"
    );
    assert!(pay.contains(r#"<svg class="bar" "#));
    let refund = part(card, "data-tool=\"refund\"", "</div>");
    assert!(refund.contains(r#"<svg class="bar full" "#), "{refund}");
    assert!(refund.contains(r#"width="0.00%""#));
    // Budget 1000: 100 spent, 200 reserved after it, 700 left.
    let budget = part(card, "class=\"figure budget\"", "</section>");
    for shown in [
        r#"<span class="total">1000</span>"#,
        r#"<span class="spent">100</span> spent"#,
        r#"<span class="reserved">200</span> reserved"#,
        r#"<span class="left">700</span> left"#,
        r#"aria-label="Budget 1000: 100 spent, 200 reserved, 700 left""#,
        r#"<rect class="part part-spent" x="0" y="0" width="10.00%""#,
        r#"<rect class="part part-reserved" x="10.00%" y="0" width="20.00%""#,
    ] {
        assert!(budget.contains(shown), "{shown} in {budget}");
    }

    // No cap and no budget: the figures, no bar.
    let card = part(&page.body, &format!("id=\"{open}\""), "</article>");
    let search = part(card, "data-tool=\"search\"", "</div>");
    assert!(search.contains(r#"<span class="used">1</span> of <span class="limit">no cap</span>"#));
    assert!(!card.contains("<svg"), "{card}");
    assert!(card.contains(r#"Budget: <span class="total">no limit</span>; <span class="spent">0</span> spent, <span class="reserved">0</span> reserved"#), "{card}");
    assert!(!card.contains("class=\"left\""));

    // Everything used: full bars.
    let card = part(&page.body, &format!("id=\"{full}\""), "</article>");
    assert!(card.contains(r#"<svg class="bar full" "#));
    assert!(card.contains(r#"<rect class="part part-used" x="0" y="0" width="100.00%""#));
    assert!(card.contains(r#"<rect class="part part-spent" x="0" y="0" width="100.00%""#));
    assert!(card.contains(r#"<rect class="part part-reserved" x="100.00%" y="0" width="0.00%""#));
    assert!(card.contains(r#"<span class="left">0</span> left"#));
}

#[tokio::test]
async fn an_attempts_page_draws_its_life_on_a_time_scale() {
    let s = start_with(|_| {}).await;
    let (pid, tok) = s
        .create_permit(json!({"label": "approver", "expires": "24h"}))
        .await;
    let first = dispatch(&s, &tok, "approve", "k", 5).await;
    let id = first["attempt_id"].as_str().unwrap().to_string();
    s.clock.advance_ms(20_000);
    report(
        &s,
        &first,
        json!({"outcome": "input_required", "receipt": "{}"}),
    )
    .await;
    s.clock.advance_ms(20_000);
    let (_, second) = s
        .post(
            "/v1/authorize",
            Some(SVC),
            json!({"permit_token": tok, "tool": "approve", "idempotency_key": "k",
                   "fingerprint": "fp-k", "arguments": {"amount": 5}, "continuation": true}),
        )
        .await;
    assert_eq!(
        (second["decision"].as_str(), second["round"].as_u64()),
        (Some("dispatch"), Some(2)),
        "{second}"
    );
    s.clock.advance_ms(40_000);
    report(
        &s,
        &second,
        json!({"outcome": "uncertain", "reason": "<b>reset</b>"}),
    )
    .await;
    s.clock.advance_ms(80_000);

    let mut b = Browser::new(&s);
    b.sign_in("Ana", ADM).await;
    // The inbox's card links to the attempt's page.
    assert!(b
        .get("/admin/")
        .await
        .body
        .contains(&format!("href=\"/admin/attempts/{id}\"")));
    let page = b.get(&format!("/admin/attempts/{id}")).await;
    assert_eq!(page.status, 200, "{}", page.body);
    assert_eq!(
        page.headers["content-security-policy"],
        CONTENT_SECURITY_POLICY
    );
    assert!(!page.body.contains("<script") && !page.body.contains("style="));
    // Sent at 0 s, uncertain at 80 s (the continuation's dispatch at 40 s is not kept once
    // it has an outcome), drawn at 160 s: 2%, 2% + 96% × 80/160, 98%.
    for (kind, x) in [("sent", "2.00%"), ("outcome", "50.00%"), ("now", "98.00%")] {
        let mark = part(&page.body, &format!("<g class=\"mark {kind}\""), "</g>");
        assert!(
            mark.contains(&format!("<circle cx=\"{x}\"")),
            "{kind} at {x}: {mark}"
        );
    }
    let (_, shown) = s.get(&format!("/admin/v1/attempts/{id}"), Some(ADM)).await;
    let created = shown["attempt"]["created_at"].as_str().unwrap();
    let updated = shown["attempt"]["updated_at"].as_str().unwrap();
    assert!(page.body.contains(&format!(
        r#"<time class="scale-start" datetime="{created}">"#
    )));
    let outcome = part(&page.body, "<li class=\"event outcome\"", "</li>");
    assert!(
        outcome.contains(&format!("<time datetime=\"{updated}\">")),
        "{outcome}"
    );
    assert!(outcome.contains("+1m 20s"));
    // What the filter said is escaped.
    assert!(
        outcome.contains("Uncertain: sent, its answer lost (&#60;b&#62;reset&#60;/b&#62;)"),
        "{outcome}"
    );
    assert!(!page.body.contains("<b>reset"));
    assert!(page.body.contains("over 2m 40s, 2 round(s)"));
    assert!(page.body.contains(
        "<p class=\"hint untimed\">Round 2 was dispatched between the first dispatch and the latest change;"
    ));
    assert!(page.body.contains(&format!("/admin/permits#{pid}")));

    // Resolved: the scale ends at the resolution, no now line.
    let csrf = page.csrf();
    assert_eq!(
        b.post(
            &format!("/admin/attempts/{id}/resolve"),
            &[
                ("csrf", &csrf),
                ("result", "executed"),
                ("note", "charged once")
            ],
        )
        .await
        .status,
        303
    );
    s.clock.advance_ms(1_000_000);
    let page = b.get(&format!("/admin/attempts/{id}")).await;
    let resolved = part(&page.body, "<g class=\"mark resolved\"", "</g>");
    assert!(resolved.contains("<circle cx=\"98.00%\""), "{resolved}");
    assert!(!page.body.contains("now-line"));
    assert!(page.body.contains("Resolved by Ana: executed"));
    assert!(page.body.contains("charged once"));

    // Unknown ids, and no session.
    assert_eq!(b.get("/admin/attempts/att_nope").await.status, 404);
    assert_eq!(
        Browser::new(&s)
            .get(&format!("/admin/attempts/{id}"))
            .await
            .status,
        401
    );
}

#[tokio::test]
async fn a_named_admin_signs_in_under_its_name_and_resolves_as_it() {
    use crate::admins::http_tests::{ana_and_bob, ANA, BOB};
    let s = start_with(|c| c.admins = ana_and_bob()).await;
    let (_, id) = lost_call(&s).await;
    let mut b = Browser::new(&s);
    // The token says who signs in: a name typed beside it is not taken.
    let signed = b.sign_in("Mallory", ANA).await;
    assert_eq!(signed.status, 303, "{}", signed.body);
    let inbox = b.get("/admin/").await;
    assert_eq!(inbox.status, 200);
    let csrf = inbox.csrf();
    let done = b
        .post(
            &format!("/admin/attempts/{id}/resolve"),
            &[("csrf", &csrf), ("result", "executed"), ("note", "charged")],
        )
        .await;
    assert_eq!(done.status, 303, "{}", done.body);
    let (_, a) = s.get(&format!("/admin/v1/attempts/{id}"), Some(BOB)).await;
    assert_eq!(a["attempt"]["resolution"]["by"], "ana");

    // The shared token says nobody's name: its holder gives one, as before.
    let mut shared = Browser::new(&s);
    assert_eq!(shared.sign_in("", ADM).await.status, 400);
    assert_eq!(shared.sign_in("Carol", ADM).await.status, 303);
    assert_eq!(shared.get("/admin/").await.status, 200);
}

#[tokio::test]
async fn a_session_ends_when_its_admin_is_removed_or_holds_another_token() {
    use crate::admins::http_tests::{ANA, BOB};
    use crate::admins::tests::replace_file;
    use crate::admins::{tokens_file_line, FixedTokens, ReloadCheck, TokensFile};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("admins");
    let line = |name, token| format!("{}\n", tokens_file_line(name, token));
    std::fs::write(&path, line("ana", ANA) + &line("bob", BOB)).unwrap();
    let fixed = FixedTokens {
        admin_token: Some(ADM.into()),
        service_token: SVC.into(),
    };
    let mut file = TokensFile::load(path.clone(), fixed).unwrap();
    let admins = file.admins();
    let s = start_with(|c| c.admins = admins).await;
    let mut ana = Browser::new(&s);
    let mut bob = Browser::new(&s);
    let mut carol = Browser::new(&s);
    assert_eq!(ana.sign_in("", ANA).await.status, 303);
    assert_eq!(bob.sign_in("", BOB).await.status, 303);
    assert_eq!(carol.sign_in("Carol", ADM).await.status, 303);
    for b in [&mut ana, &mut bob, &mut carol] {
        assert_eq!(b.get("/admin/").await.status, 200);
    }

    // Bob removed: his session ends, and his token signs in no more.
    replace_file(&path, &line("ana", ANA));
    assert!(matches!(file.check(), ReloadCheck::Reloaded));
    let ended = bob.get("/admin/").await;
    assert_eq!(ended.status, 401);
    assert!(ended.body.contains("no longer in force"), "{}", ended.body);
    assert_eq!(bob.sign_in("", BOB).await.status, 401);
    assert_eq!(ana.get("/admin/").await.status, 200);
    assert_eq!(carol.get("/admin/").await.status, 200);

    // Ana given another token: the session signed in with the old one ends.
    let renewed = "ana-renewed-admin-token-of-32-bytes-or-more";
    replace_file(&path, &line("ana", renewed));
    assert!(matches!(file.check(), ReloadCheck::Reloaded));
    assert_eq!(ana.get("/admin/").await.status, 401);
    assert_eq!(ana.sign_in("", renewed).await.status, 303);
    assert_eq!(ana.get("/admin/").await.status, 200);
    assert_eq!(carol.get("/admin/").await.status, 200);
}

/// A permit whose `pay` calls wait for a person's approval, one earlier call of another tool
/// under it, and one `pay` call now waiting; returns (permit id, waiting attempt id, earlier
/// attempt id).
async fn waiting_call(s: &TestServer) -> (String, String, String) {
    let (pid, tok) = s
        .create_permit(json!({
            "label": "billing-agent", "expires": "24h", "max_calls": {"pay": 3},
            "budget": 1000, "cost": {"pay": "/amount"}, "approval": {"pay": "always"}
        }))
        .await;
    let earlier = dispatch(s, &tok, "lookup", "look-1", 0).await;
    report(
        s,
        &earlier,
        json!({"outcome": "completed", "receipt": "{}"}),
    )
    .await;
    let (_, d) = s
        .post(
            "/v1/authorize",
            Some(SVC),
            json!({"permit_token": tok, "tool": "pay", "idempotency_key": "pay-1",
                   "fingerprint": "fp-pay-1",
                   "arguments": {"invoice": "INV-7", "amount": 250, "card": {"number": "4242"}}}),
        )
        .await;
    assert_eq!(d["decision"], "deny", "{d}");
    let (_, listed) = s.get("/admin/v1/approvals", Some(ADM)).await;
    let id = listed["approvals"][0]["id"].as_str().unwrap().to_string();
    let earlier_id = earlier["attempt_id"].as_str().unwrap().to_string();
    (pid, id, earlier_id)
}

async fn attempt_state(s: &TestServer, id: &str) -> Value {
    let (_, a) = s.get(&format!("/admin/v1/attempts/{id}"), Some(ADM)).await;
    a["attempt"].clone()
}

#[tokio::test]
async fn the_approvals_page_lists_a_waiting_call_with_what_a_person_judges_it_by() {
    let s = redacting().await;
    let (pid, id, earlier) = waiting_call(&s).await;
    let mut b = Browser::new(&s);
    assert_eq!(b.sign_in("Ana", ADM).await.status, 303);

    // Every page's navigation links to the page with the number waiting.
    let inbox = b.get("/admin/").await;
    assert!(
        inbox.body.contains(
            r#"<a href="/admin/approvals">Approvals <span class="nav-count">1</span></a>"#
        ),
        "{}",
        inbox.body
    );

    let page = b.get("/admin/approvals").await;
    assert_eq!(page.status, 200, "{}", page.body);
    assert_eq!(
        page.headers["content-security-policy"],
        CONTENT_SECURITY_POLICY
    );
    let c = card(&page, &id);
    for shown in [
        "pay",
        "billing-agent",
        pid.as_str(),
        "INV-7",
        r#"<dd class="cost">250</dd>"#,
        // The cap of 3 with this call's slot held; 1000 less this call's 250 reserved.
        r#"<dd class="calls-left">2 for pay"#,
        r#"<dd class="budget-left">750"#,
        // The request lapses after the default wait for a decision (15 min).
        "2027-01-15T08:15:00",
        "(in 15m)",
        earlier.as_str(),
        "lookup",
        &format!("/admin/approvals/{id}/approve"),
        &format!("/admin/approvals/{id}/reject"),
        r#"name="note""#,
    ] {
        assert!(c.contains(shown), "{shown} in {c}");
    }
    assert!(c.contains("[redacted]") && !page.body.contains("4242"));
    // The waiting call is not among its own earlier calls.
    let earlier_list = part(c, "<ol class=\"earlier\">", "</ol>");
    assert!(!earlier_list.contains(&id), "{earlier_list}");
}

#[tokio::test]
async fn approving_through_the_page_records_the_signed_in_name_and_a_second_decision_is_refused() {
    let s = start_with(|_| {}).await;
    let (_, id, _) = waiting_call(&s).await;
    let mut b = Browser::new(&s);
    assert_eq!(b.sign_in("Ana", ADM).await.status, 303);
    let csrf = b.get("/admin/approvals").await.csrf();

    let done = b
        .post(
            &format!("/admin/approvals/{id}/approve"),
            &[("csrf", &csrf), ("note", "  invoice checked  ")],
        )
        .await;
    assert_eq!(done.status, 303, "{}", done.body);
    assert_eq!(
        done.headers[LOCATION],
        format!("/admin/approvals?approved={id}")
    );
    let a = attempt_state(&s, &id).await;
    assert_eq!(a["state"], "approved", "{a}");
    assert_eq!(a["approval"]["decision"], "approved", "{a}");
    assert_eq!(a["approval"]["decided_by"], "Ana", "{a}");
    assert_eq!(a["approval"]["note"], "invoice checked", "{a}");
    assert!(s
        .state
        .metrics
        .render()
        .unwrap()
        .contains(r#"atmost_approval_decisions_total{decision="approved"} 1"#));

    let after = b.get(&format!("/admin/approvals?approved={id}")).await;
    assert!(after.body.contains(&format!("Approved {id}")));
    assert!(!after.body.contains(&format!("id=\"{id}\"")));
    assert!(after.body.contains("Nothing waits for approval."));

    // Deciding again is refused as the admin API refuses it, and changes nothing.
    let again = b
        .post(&format!("/admin/approvals/{id}/reject"), &[("csrf", &csrf)])
        .await;
    assert_eq!(again.status, 409, "{}", again.body);
    assert!(
        again.body.contains("not_awaiting_approval"),
        "{}",
        again.body
    );
    assert_eq!(attempt_state(&s, &id).await["state"], "approved");
}

#[tokio::test]
async fn a_decision_without_the_sessions_csrf_token_is_refused_and_decides_nothing() {
    let s = start_with(|_| {}).await;
    let (pid, id, _) = waiting_call(&s).await;
    let mut b = Browser::new(&s);
    assert_eq!(b.sign_in("Ana", ADM).await.status, 303);
    for form in [vec![], vec![("csrf", "not-the-token")]] {
        for verb in ["approve", "reject"] {
            let refused = b
                .post(&format!("/admin/approvals/{id}/{verb}"), &form)
                .await;
            assert_eq!(refused.status, 403, "{}", refused.body);
            assert!(refused.body.contains("nothing was changed"));
        }
    }
    let a = attempt_state(&s, &id).await;
    assert_eq!(a["state"], "awaiting_approval", "{a}");
    assert!(a["approval"]["decided_by"].is_null(), "{a}");
    // The slot is still held for the call.
    assert_eq!(usage(&s, &pid).await.0["calls_made"], 1);

    // Signed out, a form is the sign-in page and decides nothing either.
    let mut stranger = Browser::new(&s);
    let page = stranger
        .post(&format!("/admin/approvals/{id}/approve"), &[("csrf", "x")])
        .await;
    assert_eq!(page.status, 401);
    assert_eq!(attempt_state(&s, &id).await["state"], "awaiting_approval");
}
