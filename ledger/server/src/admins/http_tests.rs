//! Named admins over the admin API: each admin's token is accepted under its name, beside the
//! shared `--admin-token` as `admin`; a wrong one is refused and limited; an admin removed
//! from the file is refused from the next check on. (What the log says of each admin is
//! checked against the real binary, tests/e2e/test_named_admins.py: a log captured here
//! would be shared with the tests running beside it.)
//!
//! Served on the embedded store: built with the `sqlite` feature.

#![cfg(feature = "sqlite")]

use std::sync::Arc;

use serde_json::json;

use super::tests::replace_file;
use super::*;
use crate::http_tests::{start_with, TestServer, ADM, SVC};
use crate::inbox::tests::lost_call;

pub(crate) const ANA: &str = "ana-admin-token-of-32-bytes-or-more";
pub(crate) const BOB: &str = "bob-admin-token-of-32-bytes-or-more";

fn fixed() -> FixedTokens {
    FixedTokens {
        admin_token: Some(ADM.into()),
        service_token: SVC.into(),
    }
}

/// Ana and Bob from a tokens file, beside the test server's shared token.
pub(crate) fn ana_and_bob() -> Arc<Admins> {
    let text = format!(
        "{}\n{}\n",
        tokens_file_line("ana", ANA),
        tokens_file_line("bob", BOB)
    );
    Arc::new(Admins::new(AdminSet::parse(&text, &fixed()).unwrap()))
}

#[tokio::test]
async fn two_named_admins_and_the_shared_token_are_accepted_and_a_wrong_token_refused() {
    let s = start_with(|c| c.admins = ana_and_bob()).await;
    for token in [ANA, BOB, ADM] {
        assert_eq!(
            s.get("/admin/v1/permits", Some(token)).await,
            (200, json!({"permits": []})),
            "{token}"
        );
    }
    for token in [None, Some("wrong"), Some(SVC), Some(&token_sha256(ANA)[..])] {
        assert_eq!(
            s.get("/admin/v1/permits", token).await,
            (401, json!({"error": "unauthorized"})),
            "{token:?}"
        );
    }
    assert!(s
        .metrics()
        .await
        .contains(r#"atmost_unauthorized_requests_total{api="admin"} 4"#));
}

#[tokio::test]
async fn wrong_tokens_past_the_limit_get_429_and_an_admins_token_still_passes() {
    let s = start_with(|c| {
        c.admins = ana_and_bob();
        c.auth_limit.max_failures = 2;
    })
    .await;
    let statuses: Vec<u16> = wrong_token_statuses(&s, 4).await;
    assert_eq!(statuses, [401, 401, 429, 429]);
    assert_eq!(s.get("/admin/v1/permits", Some(BOB)).await.0, 200);
}

/// The statuses of `n` requests with a wrong token, one after the other.
async fn wrong_token_statuses(s: &TestServer, n: usize) -> Vec<u16> {
    let mut statuses = Vec::with_capacity(n);
    for _ in 0..n {
        statuses.push(s.get("/admin/v1/permits", Some("wrong")).await.0);
    }
    statuses
}

#[tokio::test]
async fn an_admin_removed_from_the_file_is_refused_from_the_next_check_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("admins");
    let line = |name, token| format!("{}\n", tokens_file_line(name, token));
    std::fs::write(&path, line("ana", ANA) + &line("bob", BOB)).unwrap();
    let mut file = TokensFile::load(path.clone(), fixed()).unwrap();
    let admins = file.admins();
    let s = start_with(|c| c.admins = admins).await;
    // The control: Bob is accepted before he is removed.
    assert_eq!(s.get("/admin/v1/permits", Some(BOB)).await.0, 200);
    replace_file(&path, &line("ana", ANA));
    assert!(matches!(file.check(), ReloadCheck::Reloaded));
    assert_eq!(s.get("/admin/v1/permits", Some(BOB)).await.0, 401);
    assert_eq!(s.get("/admin/v1/permits", Some(ANA)).await.0, 200);
    assert_eq!(s.get("/admin/v1/permits", Some(ADM)).await.0, 200);
}

#[tokio::test]
async fn a_named_admin_resolves_through_the_api_with_the_by_it_writes() {
    let s = start_with(|c| c.admins = ana_and_bob()).await;
    let (_, id) = lost_call(&s).await;
    let path = format!("/admin/v1/attempts/{id}/resolve");
    // `by` stays required: the body is the API's, whoever calls it.
    let (st, _) = s.post(&path, Some(ANA), json!({"executed": false})).await;
    assert_eq!(st, 400);
    // The body's `by` is the caller's word, kept as it is (the log adds who called).
    let (st, v) = s
        .post(
            &path,
            Some(ANA),
            json!({"executed": false, "by": "ticket-42"}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["attempt"]["resolution"]["by"], "ticket-42");
}
