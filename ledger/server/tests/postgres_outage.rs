//! A hung PostgreSQL, seen through the server: the store's deadline ends every operation, the
//! service API answers 503 (the filter's `gateway_unavailable`), readiness follows the
//! database, and both recover with it. Needs a server (`DATABASE_URL`): built with the
//! `postgres-tests` feature, which `make test-unit` turns on; without a server it fails.

#![cfg(feature = "postgres-tests")]

#[cfg(test)]
mod postgres_outage {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use atmost_ledger::clock::Deadline;
    use atmost_ledger::model::{Permit, Policy};
    use atmost_ledger::store::postgres::testing::{self, Cleanup};
    use atmost_ledger::store::postgres::PgStore;
    use atmost_ledger::store::{Decisions, Reads, Store};
    use atmost_ledger::token;
    use atmost_protocol::AuthorizeRequest;
    use serde_json::json;

    const T0: i64 = 1_800_000_000_000;
    const LEASE_MS: u64 = 60_000;

    /// How long a test waits for an answer that must come: far past every deadline under test, so
    /// reaching it means a hang, not a slow machine.
    const HANG_GUARD: Duration = Duration::from_secs(60);

    /// A permit for every tool, at most one call of `pay`, for an hour from `T0`.
    async fn permit_with_a_cap_of_one(store: &dyn Store) -> (Permit, String) {
        let id = token::new_permit_id().unwrap();
        let tok = token::new_token(&id).unwrap();
        let p = Permit {
            token_hash: token::sha256_hex(&tok),
            id,
            label: "outage".into(),
            created_at_ms: T0,
            expires_at_ms: T0 + 3_600_000,
            revoked_at_ms: None,
            policy: Policy::builder()
                .max_calls("pay", 1)
                .retention_ms(24 * 3_600_000)
                .build(),
        };
        store.create_permit(&p).await.unwrap();
        (p, tok)
    }

    fn call(tok: &str) -> AuthorizeRequest {
        AuthorizeRequest {
            reports: Vec::new(),
            permit_token: tok.into(),
            tool: "pay".into(),
            idempotency_key: Some("k1".into()),
            fingerprint: "A".into(),
            arguments: json!({}),
            key_required: false,
            continuation: false,
            forwarded_key: None,
            forwarded_key_carriers: Default::default(),
            dispatch: None,
        }
    }

    /// Serves the ledger's routes on `store`; returns the base URL.
    async fn serve(store: Arc<PgStore>) -> String {
        let state = Arc::new(atmost_ledger_server::state::AppState::new(
            store,
            Arc::new(atmost_ledger::clock::SystemClock),
            atmost_ledger_server::state::ServerConfig {
                service_token: "svc".into(),
                admins: atmost_ledger_server::admins::Admins::shared("adm"),
                auth_limit: Default::default(),
                purge_ended_permits_after: None,
                credential_key: None,
                approvals: Default::default(),
                lease: Duration::from_secs(60),
                callout_timeout: Duration::from_secs(30),
                redaction: Default::default(),
                inbox: Default::default(),
                key_refresh: Duration::from_secs(5),
                receipt_issuer: "atmost-test".into(),
                tool_refusal_keys: Default::default(),
            },
            Arc::new(atmost_ledger_server::metrics::Metrics::new().unwrap()),
        ));
        state.start_signing().await.unwrap();
        // /readyz answers from the background check, as the ledger runs it.
        atmost_ledger_server::readiness::check_once(
            &state.readiness,
            &*state.store,
            &state.metrics,
        )
        .await;
        atmost_ledger_server::readiness::spawn_checks(
            state.readiness.clone(),
            state.store.clone(),
            state.metrics.clone(),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = atmost_ledger_server::server::api_router(state);
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        format!("http://{addr}")
    }

    /// A TCP relay to the database that can stall every byte, like a database that hangs or a
    /// network partition during a failover.
    struct Relay {
        port: u16,
        stalled: Arc<AtomicBool>,
    }

    impl Relay {
        async fn start(target: (String, u16)) -> Relay {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = listener.local_addr().unwrap().port();
            let stalled = Arc::new(AtomicBool::new(false));
            let st = stalled.clone();
            tokio::spawn(async move {
                while let Ok((down, _)) = listener.accept().await {
                    let Ok(up) =
                        tokio::net::TcpStream::connect((target.0.as_str(), target.1)).await
                    else {
                        continue;
                    };
                    let (dr, dw) = down.into_split();
                    let (ur, uw) = up.into_split();
                    tokio::spawn(pump(dr, uw, st.clone()));
                    tokio::spawn(pump(ur, dw, st.clone()));
                }
            });
            Relay { port, stalled }
        }
    }

    async fn pump(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        stalled: Arc<AtomicBool>,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            while stalled.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if to.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    }

    /// Transient database failures fail closed: an error within the deadline (the server
    /// answers 503 → `gateway_unavailable`), never a hang and never a dispatch; readiness
    /// (`ping`) follows the database; the store recovers when the database does.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn hung_database_fails_closed_within_the_deadline_and_recovers() {
        let url = testing::database_url().unwrap_or_else(|m| panic!("{m}"));
        let (host, port) = testing::server_address(&url).unwrap();
        let relay = Relay::start((host.clone(), port)).await;
        let schema = testing::new_schema().unwrap();
        let _cleanup = Cleanup(url.clone(), schema.clone());
        // The same URL with the relay's address.
        let relayed = url.replacen(
            &format!("{host}:{port}"),
            &format!("127.0.0.1:{}", relay.port),
            1,
        );
        assert_ne!(
            relayed, url,
            "DATABASE_URL must name host:port for this test"
        );
        let mut o = testing::options(&relayed, &schema);
        o.pool_size = 2;
        o.connect_timeout = Duration::from_millis(700);
        o.statement_timeout = Duration::from_millis(700);
        let s = Arc::new(PgStore::connect(&o).await.unwrap());
        let (p, tok) = permit_with_a_cap_of_one(&*s).await;
        s.ping().await.unwrap();
        let base = serve(s.clone()).await;
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::new();
        assert_eq!(
            http.get(format!("{base}/readyz"))
                .send()
                .await
                .unwrap()
                .status(),
            200
        );

        // Decisions draw from connections of their own (docs/design.md#the-ledgers-hot-path):
        // one decision, under a permit nobody holds, opens theirs, so that the hang below meets
        // an open connection mid-operation, as the ping's and the permit's did.
        let stranger = token::new_token(&token::new_permit_id().unwrap()).unwrap();
        let warm = s
            .authorize(
                &call(&stranger),
                LEASE_MS,
                T0,
                Deadline::after(Duration::from_secs(5)),
            )
            .await
            .unwrap();
        assert!(
            matches!(&warm.response, atmost_protocol::AuthorizeResponse::Deny(d) if d.code == atmost_protocol::DenialCode::PermitInvalid),
            "{:?}",
            warm.response
        );

        relay.stalled.store(true, Ordering::SeqCst);
        let r = call(&tok);
        let err = tokio::time::timeout(
            HANG_GUARD,
            s.authorize(&r, LEASE_MS, T0, Deadline::after(Duration::from_secs(60))),
        )
        .await
        .expect("a hung database never hangs the authorize")
        .unwrap_err();
        // Ended by the store's own deadline (connect + two statements), not by anything else.
        let deadline = format!(
            "postgres did not answer within {} ms",
            (o.connect_timeout + o.statement_timeout * 2).as_millis()
        );
        assert!(
            matches!(&err, atmost_ledger::error::LedgerError::Unavailable(m) if *m == deadline),
            "{err}"
        );
        let ping = tokio::time::timeout(HANG_GUARD, s.ping())
            .await
            .expect("readiness never hangs");
        // The authorize's connection was closed when its deadline cut it off (statements may
        // still be pending on it): the ping waits for a new one, which cannot connect.
        assert!(
            matches!(
                &ping,
                Err(atmost_ledger::error::LedgerError::Unavailable(_))
            ),
            "readiness follows the database: {ping:?}"
        );
        // Through the server: 503, which the filter turns into gateway_unavailable.
        let resp = http
            .post(format!("{base}{}", atmost_protocol::AUTHORIZE_PATH))
            .bearer_auth("svc")
            .json(&r)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 503);
        let body: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(body["error"], "store_unavailable");
        // The background check sees the hang within its deadline (or the last good check
        // grows too old), and /readyz follows.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let status = http
                .get(format!("{base}/readyz"))
                .send()
                .await
                .unwrap()
                .status();
            if status == 503 {
                break;
            }
            assert!(Instant::now() < deadline, "/readyz still answers {status}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }

        relay.stalled.store(false, Ordering::SeqCst);
        let deadline = Instant::now() + Duration::from_secs(20);
        let decision = loop {
            match s
                .authorize(&r, LEASE_MS, T0, Deadline::after(Duration::from_secs(60)))
                .await
            {
                Ok(d) => break d,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("the store did not recover: {e}"),
            }
        };
        s.ping().await.unwrap();
        // Whatever the stalled attempt left, the cap of one holds: one slot at most.
        let d = s.permit_detail(&p.id).await.unwrap().unwrap();
        assert_eq!(d.usage["pay"].calls_made, 1, "{:?}", decision.response);
    }
}
