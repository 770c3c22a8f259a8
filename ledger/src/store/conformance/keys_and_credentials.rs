//! Signing keys and credentials: versions, rotation, publication and their races.

use atmost_protocol::{AuthorizeResponse, Outcome};
use serde_json::json;

use crate::credentials::CredentialUse;
use crate::decide::Leases;
use crate::keys::PUBLISHED_AFTER_RETIREMENT_MS;
use crate::store::AttemptFilter;

use super::support::*;

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
        .authorize_with(
            &r,
            Some(carried.clone()),
            Leases::call(LEASE_MS),
            T0,
            patient(),
        )
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
        s.authorize_with(&r, None, Leases::call(LEASE_MS), T0 + 2, patient())
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
