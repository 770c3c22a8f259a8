//! HTTP tests of credential custody: registration and rotation on the admin API, what the
//! filter's API hands out (a Dispatch, `/v1/credential`) and what no answer ever shows.

#![cfg(feature = "sqlite")]

use std::sync::Arc;

use serde_json::{json, Value};

use crate::http_tests::{start_with, TestServer, ADM, SVC};
use atmost_ledger::credentials::CredentialKey;

const KEY: &str = "8f1c0d2e3b4a59687766554433221100ffeeddccbbaa99887766554433221100";
const SECRET_1: &str = "sk-live-first-0000111122223333";
const SECRET_2: &str = "sk-live-second-4444555566667777";

async fn with_key() -> TestServer {
    start_with(|c| c.credential_key = Some(Arc::new(CredentialKey::from_hex(KEY).unwrap()))).await
}

async fn put(s: &TestServer, name: &str, body: Value) -> (u16, String) {
    let resp = s
        .http
        .put(s.url(&format!("/admin/v1/credentials/{name}")))
        .bearer_auth(ADM)
        .json(&body)
        .send()
        .await
        .unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

fn spec(secret: &str) -> Value {
    json!({"header": "Authorization", "form": "bearer", "routes": ["pay_route"], "secret": secret})
}

fn authz(token: &str, key: &str) -> Value {
    json!({"permit_token": token, "tool": "pay", "idempotency_key": key, "fingerprint": key,
           "arguments": {}})
}

#[tokio::test]
async fn a_ledger_without_a_key_keeps_no_credentials() {
    let s = start_with(|_| {}).await;
    let (st, body) = put(&s, "pay", spec(SECRET_1)).await;
    assert_eq!(st, 409, "{body}");
    assert!(body.contains("credential_key_unset"), "{body}");
    assert!(!body.contains(SECRET_1));
    let (st, v) = s
        .post(
            "/admin/v1/permits",
            Some(ADM),
            json!({"label": "a", "expires": "1h", "credential": "pay"}),
        )
        .await;
    assert_eq!(st, 409, "{v}");
}

#[tokio::test]
async fn credentials_are_registered_rotated_and_listed_without_their_secret() {
    let s = with_key().await;
    // The admin token is needed.
    let resp = s
        .http
        .put(s.url("/admin/v1/credentials/pay"))
        .bearer_auth(SVC)
        .json(&spec(SECRET_1))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 401);
    let (st, body) = put(&s, "pay", spec(SECRET_1)).await;
    assert_eq!(st, 201, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["credential"],
        json!({"name": "pay", "version": 1, "header": "authorization", "form": "bearer",
               "routes": ["pay_route"], "created_at": v["credential"]["created_at"]})
    );
    let (st, body) = put(&s, "pay", spec(SECRET_2)).await;
    assert_eq!(st, 200, "{body}");
    assert!(body.contains("\"version\":2"), "{body}");
    let (st, list) = s.get("/admin/v1/credentials", Some(ADM)).await;
    assert_eq!(st, 200);
    assert_eq!(list["credentials"].as_array().unwrap().len(), 1);
    assert_eq!(list["credentials"][0]["version"], 2);
    for shown in [&body, &list.to_string()] {
        assert!(!shown.contains("sk-live"), "{shown}");
    }
    // Refusals name the field and never echo the secret.
    for (bad, field) in [
        (
            json!({"header": "atmost-permit", "form": "raw", "routes": ["r"], "secret": SECRET_1}),
            "header",
        ),
        (
            json!({"header": "x-api-key", "form": "basic", "routes": ["r"], "secret": SECRET_1}),
            "body",
        ),
        (
            json!({"header": "x-api-key", "form": "raw", "routes": [], "secret": SECRET_1}),
            "routes",
        ),
        (
            json!({"header": "x-api-key", "form": "raw", "routes": ["r"], "secret": "a\nb sk-live"}),
            "credential",
        ),
        (
            json!({"header": "x-api-key", "form": "raw", "routes": ["r"], "secret": SECRET_1, "extra": 1}),
            "body",
        ),
    ] {
        let (st, body) = put(&s, "pay", bad).await;
        assert_eq!(st, 400, "{body}");
        assert!(body.contains(field), "{field}: {body}");
        assert!(!body.contains("sk-live"), "{body}");
    }
    let (st, body) = put(&s, "Bad:Name", spec(SECRET_1)).await;
    assert_eq!(st, 400, "{body}");
    // The store holds the secret sealed: not one of its bytes in the clear in any of its
    // files, where the route it was registered with is (the control that the scan reads them).
    let mut bytes = Vec::new();
    for entry in std::fs::read_dir(&s.data_dir).unwrap() {
        bytes.extend(std::fs::read(entry.unwrap().path()).unwrap());
    }
    let holds = |needle: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
    assert!(holds(b"pay_route"));
    assert!(!holds(b"sk-live"));
}

#[tokio::test]
async fn a_dispatch_carries_the_permits_credential_and_nothing_else_does() {
    let s = with_key().await;
    assert_eq!(put(&s, "pay", spec(SECRET_1)).await.0, 201);
    let (st, v) = s
        .post(
            "/admin/v1/permits",
            Some(ADM),
            json!({"label": "a", "expires": "1h", "credential": "nope"}),
        )
        .await;
    assert_eq!(st, 400, "{v}");
    assert!(v["message"].as_str().unwrap().contains("nope"), "{v}");
    let (id, tok) = s
        .create_permit(json!({"label": "a", "expires": "1h", "credential": "pay",
                              "max_calls": {"pay": 2}}))
        .await;
    let (_, plain_tok) = s
        .create_permit(json!({"label": "b", "expires": "1h"}))
        .await;

    let (st, d) = s.post("/v1/authorize", Some(SVC), authz(&tok, "k1")).await;
    assert_eq!((st, d["decision"].as_str()), (200, Some("dispatch")), "{d}");
    assert_eq!(
        d["credential"],
        json!({"name": "pay", "version": 1, "header": "authorization",
               "value": format!("Bearer {SECRET_1}"), "routes": ["pay_route"]})
    );
    // Rotation: the next dispatch carries the new version.
    assert_eq!(put(&s, "pay", spec(SECRET_2)).await.0, 200);
    let (_, d2) = s.post("/v1/authorize", Some(SVC), authz(&tok, "k2")).await;
    assert_eq!(d2["credential"]["version"], 2, "{d2}");
    assert_eq!(d2["credential"]["value"], format!("Bearer {SECRET_2}"));
    // A denial carries nothing; nor does a dispatch under a permit that names none.
    let (_, denied) = s.post("/v1/authorize", Some(SVC), authz(&tok, "k3")).await;
    assert_eq!(denied["decision"], "deny", "{denied}");
    assert_eq!(denied.get("credential"), None);
    let (_, plain) = s
        .post("/v1/authorize", Some(SVC), authz(&plain_tok, "k1"))
        .await;
    assert_eq!(plain["decision"], "dispatch");
    assert_eq!(plain.get("credential"), None);

    // The attempts record which credential went with them, by name and version only.
    let (_, a1) = s
        .get(
            &format!("/admin/v1/attempts/{}", d["attempt_id"].as_str().unwrap()),
            Some(ADM),
        )
        .await;
    assert_eq!(
        a1["attempt"]["credential"],
        json!({"name": "pay", "version": 1})
    );
    let (_, a2) = s
        .get(
            &format!("/admin/v1/attempts/{}", d2["attempt_id"].as_str().unwrap()),
            Some(ADM),
        )
        .await;
    assert_eq!(
        a2["attempt"]["credential"],
        json!({"name": "pay", "version": 2})
    );
    let (_, listed) = s
        .get(&format!("/admin/v1/attempts?permit={id}"), Some(ADM))
        .await;
    let (_, permit) = s.get(&format!("/admin/v1/permits/{id}"), Some(ADM)).await;
    assert_eq!(permit["permit"]["credential"], "pay");
    for shown in [&a1, &a2, &listed, &permit] {
        assert!(!shown.to_string().contains("sk-live"), "{shown}");
    }
    assert!(!s.metrics().await.contains("sk-live"));
}

async fn fetch(s: &TestServer, token: &str) -> (u16, Value) {
    s.post("/v1/credential", Some(SVC), json!({"permit_token": token}))
        .await
}

#[tokio::test]
async fn the_credential_fetch_answers_a_live_permit_only() {
    let s = with_key().await;
    assert_eq!(put(&s, "pay", spec(SECRET_1)).await.0, 201);
    let (id, tok) = s
        .create_permit(json!({"label": "a", "expires": "1h", "credential": "pay"}))
        .await;
    let (_, plain_tok) = s
        .create_permit(json!({"label": "b", "expires": "1h"}))
        .await;
    let (st, v) = fetch(&s, &tok).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["credential"]["value"], format!("Bearer {SECRET_1}"));
    assert_eq!(fetch(&s, &plain_tok).await, (200, json!({})));
    let (st, v) = fetch(&s, &format!("{tok}x")).await;
    assert_eq!((st, v), (403, json!({"error": "permit_invalid"})));
    let (st, _) = s
        .post("/v1/credential", Some(ADM), json!({"permit_token": tok}))
        .await;
    assert_eq!(st, 401, "the service token is needed");
    s.revoke(&id).await;
    let (st, v) = fetch(&s, &tok).await;
    assert_eq!((st, v), (403, json!({"error": "permit_invalid"})));
    let (_, d) = s.post("/v1/authorize", Some(SVC), authz(&tok, "k9")).await;
    assert_eq!(d["code"], "permit_invalid");
    assert_eq!(d.get("credential"), None);
}

#[tokio::test]
async fn a_credential_that_does_not_open_fails_the_authorize_and_reserves_nothing() {
    let s = with_key().await;
    assert_eq!(put(&s, "pay", spec(SECRET_1)).await.0, 201);
    let (id, tok) = s
        .create_permit(json!({"label": "a", "expires": "1h", "credential": "pay"}))
        .await;
    // The same store under another key: what an operator who lost the key would run.
    let other = crate::http_tests::start_beside(&s, |c| {
        c.credential_key = Some(Arc::new(
            CredentialKey::from_hex(&KEY.replace("8", "9")).unwrap(),
        ))
    })
    .await;
    let (st, v) = other
        .post("/v1/authorize", Some(SVC), authz(&tok, "k1"))
        .await;
    assert_eq!(st, 500, "{v}");
    assert!(!v.to_string().contains("sk-live"));
    let (_, attempts) = other
        .get(&format!("/admin/v1/attempts?permit={id}"), Some(ADM))
        .await;
    assert_eq!(attempts["attempts"], json!([]), "{attempts}");
}
