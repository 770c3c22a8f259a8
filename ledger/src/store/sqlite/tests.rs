use std::sync::Arc;

use async_trait::async_trait;

use super::SqliteStore;
use crate::store::conformance::{self, Harness, T0};
use crate::store::{Decisions, Reads, Store};

struct SqliteHarness {
    dir: tempfile::TempDir,
    first: Arc<dyn Store>,
}

impl SqliteHarness {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let first: Arc<dyn Store> = Arc::new(SqliteStore::open_dir(dir.path()).unwrap());
        SqliteHarness { dir, first }
    }
}

#[async_trait]
impl Harness for SqliteHarness {
    async fn store(&self) -> Arc<dyn Store> {
        self.first.clone()
    }
    async fn second_handle(&self) -> Arc<dyn Store> {
        // A second connection on the same file, like a second process.
        Arc::new(SqliteStore::open_dir(self.dir.path()).unwrap())
    }
    async fn reopen(&self) -> Arc<dyn Store> {
        Arc::new(SqliteStore::open_dir(self.dir.path()).unwrap())
    }
}

crate::conformance_suite!(SqliteHarness::new());

#[tokio::test]
async fn opens_in_wal_with_full_sync_and_stable_plans() {
    let dir = tempfile::tempdir().unwrap();
    let s = SqliteStore::open_dir(dir.path()).unwrap();
    // The writer's own connection is the one that must be FULL.
    let (mode, sync, qpsg) = s
        .write(|c: &super::GroupTx<'_>| {
            let mode: String = c.query_row("PRAGMA journal_mode", [], |r| r.get(0))?;
            let sync: i64 = c.query_row("PRAGMA synchronous", [], |r| r.get(0))?;
            let qpsg = c.db_config(rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG)?;
            Ok::<_, crate::error::LedgerError>((mode, sync, qpsg))
        })
        .await
        .unwrap();
    assert_eq!(mode, "wal");
    assert_eq!(sync, 2, "synchronous=FULL");
    assert!(
        qpsg,
        "cached statements must not be recompiled for each bound value"
    );
    assert!(dir.path().join(super::DB_FILE).exists());
}

/// A failing operation inside a group transaction rolls back only its own savepoint: the
/// operations around it commit and are answered, its write is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_ops_counter_moves_go_with_its_savepoint() {
    use crate::error::LedgerError;
    use crate::model::{Attempt, AttemptState};
    let dir = tempfile::tempdir().unwrap();
    let s = Arc::new(SqliteStore::open_dir(dir.path()).unwrap());
    let (p, _) = conformance::make_permit(&*s, conformance::policy(), T0 + 1).await;
    let mut tasks = Vec::new();
    for i in 0..100 {
        let (s, permit_id) = (s.clone(), p.id.clone());
        tasks.push(tokio::spawn(async move {
            s.write(move |tx: &super::GroupTx<'_>| {
                let a =
                    Attempt::example(&format!("a{i}"), &permit_id, "t", AttemptState::InFlight, 1);
                super::writes::write_attempt(tx, None, &a)?;
                if i % 5 == 0 {
                    return Err(LedgerError::Invalid(format!("op {i} fails")));
                }
                Ok(())
            })
            .await
        }));
    }
    let mut kept = 0;
    for t in tasks {
        if t.await.unwrap().is_ok() {
            kept += 1;
        }
    }
    assert_eq!(kept, 80);
    let c = s.permit_counters(&p.id).await.unwrap().unwrap();
    assert_eq!(c.slots_held.get("t"), Some(&80));
    let counts = s.attempt_counts().await.unwrap();
    assert_eq!(counts.get(&AttemptState::InFlight), Some(&80));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_op_rolls_back_only_its_savepoint() {
    use crate::error::LedgerError;
    let dir = tempfile::tempdir().unwrap();
    let s = Arc::new(SqliteStore::open_dir(dir.path()).unwrap());
    let mut tasks = Vec::new();
    for i in 0..200 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            s.write(move |c: &super::GroupTx<'_>| {
                c.execute(
                    "INSERT INTO permits (id, token_hash, label, created_at, expires_at, retention_ms, policy) \
                     VALUES (?1, 'h', 'l', 0, 1, 0, '{}')",
                    rusqlite::params![format!("p{i}")],
                )?;
                if i % 7 == 0 {
                    return Err(LedgerError::Invalid(format!("op {i} fails")));
                }
                Ok(i)
            })
            .await
        }));
    }
    for (i, t) in tasks.into_iter().enumerate() {
        let r = t.await.unwrap();
        if i % 7 == 0 {
            assert!(matches!(r, Err(LedgerError::Invalid(_))), "{i}: {r:?}");
        } else {
            assert_eq!(r.unwrap(), i);
        }
    }
    let n: i64 = s
        .read(|c| Ok(c.query_row("SELECT COUNT(*) FROM permits", [], |r| r.get(0))?))
        .await
        .unwrap();
    assert_eq!(n, 200 - (0..200).filter(|i| i % 7 == 0).count() as i64);
}

/// The partial indexes' state lists are the model's, and the sweeper's two queries read
/// those indexes (so a sweep reads its candidates, not the whole history), also under the
/// planner statistics of a store of ten million attempts over a hundred thousand permits
/// (what `ANALYZE` wrote for `make bench-scale`'s fill): with those, the receipts' query
/// left to the planner scanned every permit and read all of its attempts.
#[tokio::test]
async fn sweeper_queries_read_the_partial_indexes() {
    use crate::model::AttemptState;
    // Version 12 built the leased index anew when the approval states joined the list.
    assert!(super::migrations::MIGRATION_12.contains(&format!(
        "WHERE state IN {};",
        super::states(AttemptState::leased)
    )));
    assert!(super::migrations::MIGRATION_3.contains(&format!(
        "WHERE pruned_at IS NULL AND state IN {};",
        super::states(AttemptState::replays)
    )));
    let dir = tempfile::tempdir().unwrap();
    let s = SqliteStore::open_dir(dir.path()).unwrap();
    for large in [false, true] {
        let plans = s
            .write(move |c: &super::GroupTx<'_>| {
                if large {
                    c.execute_batch(
                        "ANALYZE; DELETE FROM sqlite_stat1; INSERT INTO sqlite_stat1 (tbl, idx, stat) VALUES \
                         ('attempts', 'sqlite_autoindex_attempts_1', '10013517 1'), \
                         ('attempts', 'attempts_by_permit_fingerprint', '10013517 101 1 1'), \
                         ('attempts', 'attempts_prunable', '9613517 1'), \
                         ('attempts', 'attempts_resolved', '100000 1'), \
                         ('idempotency_keys', 'sqlite_autoindex_idempotency_keys_1', '10013517 101 1'), \
                         ('idempotency_keys', 'idempotency_keys_by_attempt', '10013517 1'), \
                         ('permits', 'sqlite_autoindex_permits_1', '100001 1'), \
                         ('permits', 'permits_by_retention', '100001 100001'), \
                         ('permits', 'permits_by_expiry', '100001 100001'); \
                         ANALYZE sqlite_schema;",
                    )?;
                }
                let mut out = Vec::new();
                for sql in [super::expired_leases_sql(), super::prunable_receipts_sql()] {
                    let mut st = c.prepare(&format!("EXPLAIN QUERY PLAN {sql}"))?;
                    let zeros = vec![0i64; st.parameter_count()];
                    let rows = st.query_map(rusqlite::params_from_iter(zeros), |r| {
                        r.get::<_, String>(3)
                    })?;
                    out.push(rows.collect::<Result<Vec<_>, _>>()?.join("; "));
                }
                Ok::<_, crate::error::LedgerError>(out)
            })
            .await
            .unwrap();
        assert!(
            plans[0].contains("attempts_leased"),
            "{large}: {}",
            plans[0]
        );
        assert!(
            plans[1].contains("attempts_prunable"),
            "{large}: {}",
            plans[1]
        );
        assert!(!plans[1].contains("SCAN"), "{large}: {}", plans[1]);
    }
}

/// An older file (tables without a schema version, attempts in every state) is migrated
/// to the counters with the same numbers a recount gives.
#[tokio::test]
async fn migration_backfills_counters_from_existing_rows() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(super::DB_FILE);
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch(super::migrations::SCHEMA).unwrap();
        c.execute(
            "INSERT INTO permits (id, token_hash, label, created_at, expires_at, retention_ms, policy) \
             VALUES ('p1', 'h', 'l', 0, 1, 0, '{\"tools\":[\"*\"],\"retention_ms\":0}')",
            [],
        )
        .unwrap();
        // Every state a file of that age can hold: the approval states came with version 12.
        let old_states = crate::model::AttemptState::ALL.into_iter().filter(|s| {
            !matches!(
                s,
                crate::model::AttemptState::AwaitingApproval
                    | crate::model::AttemptState::Approved
                    | crate::model::AttemptState::ApprovalRejected
                    | crate::model::AttemptState::ApprovalExpired
            )
        });
        for (i, st) in old_states.enumerate() {
            for tool in ["a", "b"] {
                c.execute(
                    "INSERT INTO attempts (id, permit_id, tool, fingerprint, cost, state, created_at, updated_at, lease_expires_at) \
                     VALUES (?1, 'p1', ?2, 'f', ?3, ?4, 0, 0, 0)",
                    rusqlite::params![format!("a{i}{tool}"), tool, 10 + i as i64, st.as_str()],
                )
                .unwrap();
            }
        }
    }
    let s = SqliteStore::open_file(&path).unwrap();
    let d = s.permit_detail("p1").await.unwrap().unwrap();
    let c = s.permit_counters("p1").await.unwrap().unwrap();
    assert_eq!(
        c.slots_held.get("a").copied(),
        Some(d.usage["a"].calls_made as i64)
    );
    assert_eq!(
        c.slots_held.get("b").copied(),
        Some(d.usage["b"].calls_made as i64)
    );
    assert_eq!(c.reserved, d.budget.reserved as i64);
    assert_eq!(c.spent, d.budget.spent as i64);
    assert!(c.reserved > 0 && c.spent > 0);
    // Version 3 counted the attempts per state from the rows.
    let counts = s.attempt_counts().await.unwrap();
    let approval_states = 4;
    assert_eq!(
        counts.values().filter(|n| **n == 2).count(),
        crate::model::AttemptState::ALL.len() - approval_states,
        "{counts:?}"
    );
    drop(s);
    // Opening again leaves a migrated file alone.
    let s = SqliteStore::open_file(&path).unwrap();
    assert_eq!(s.permit_counters("p1").await.unwrap().unwrap(), c);
}

#[test]
fn an_outage_is_transient_and_a_broken_constraint_is_not() {
    let failure = |code| {
        crate::error::LedgerError::from(rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(code),
            None,
        ))
    };
    for outage in [
        rusqlite::ffi::SQLITE_FULL,
        rusqlite::ffi::SQLITE_READONLY,
        rusqlite::ffi::SQLITE_BUSY,
        rusqlite::ffi::SQLITE_IOERR,
        rusqlite::ffi::SQLITE_CANTOPEN,
    ] {
        assert!(failure(outage).is_transient(), "{}", failure(outage));
    }
    for bug in [
        rusqlite::ffi::SQLITE_CONSTRAINT,
        rusqlite::ffi::SQLITE_CORRUPT,
    ] {
        assert!(!failure(bug).is_transient(), "{}", failure(bug));
    }
    assert!(
        !crate::error::LedgerError::from(rusqlite::Error::InvalidColumnIndex(99)).is_transient()
    );
}

/// The inbox's reads follow their partial indexes (a page reads what it lists, not the
/// history), and the metrics' read the uncertain one and the leased one (calls waiting for
/// approval).
#[tokio::test]
async fn inbox_queries_read_their_partial_indexes() {
    let dir = tempfile::tempdir().unwrap();
    let s = SqliteStore::open_dir(dir.path()).unwrap();
    let sql = crate::store::reads::ReadSql::new(super::DIALECT);
    let queries = [
        ("attempts_uncertain", sql.uncertain(0).sql),
        ("attempts_leased", sql.stuck(0, 0).sql),
        ("attempts_resolved", sql.resolved(0).sql),
        ("attempts_uncertain", sql.oldest_uncertain().sql),
        ("attempts_leased", sql.awaiting_approval().sql),
    ];
    let plans = s
        .read(move |c| {
            let mut out = Vec::new();
            for (index, sql) in &queries {
                let mut st = c.prepare(&format!("EXPLAIN QUERY PLAN {sql}"))?;
                let zeros = vec![0i64; st.parameter_count()];
                let rows =
                    st.query_map(rusqlite::params_from_iter(zeros), |r| r.get::<_, String>(3))?;
                out.push((*index, rows.collect::<Result<Vec<_>, _>>()?.join("; ")));
            }
            Ok(out)
        })
        .await
        .unwrap();
    for (index, plan) in plans {
        assert!(plan.contains(index), "{index}: {plan}");
    }
}

/// A version 4 file (attempts and a resolution written before the inbox) opens as version 5
/// and reads back as the conformance suite expects.
#[tokio::test]
async fn migration_from_version_4_keeps_attempts_and_resolutions() {
    use super::migrations::{MIGRATION_2, MIGRATION_3, MIGRATION_4, SCHEMA};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(super::DB_FILE);
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        for sql in [
            SCHEMA,
            MIGRATION_2,
            MIGRATION_3,
            MIGRATION_4,
            "PRAGMA user_version = 4",
        ] {
            c.execute_batch(sql).unwrap();
        }
        c.execute_batch(&conformance::VERSION_4_ROWS.replace("TRUE", "1"))
            .unwrap();
    }
    let s = SqliteStore::open_file(&path).unwrap();
    let version: i64 = s
        .read(|c| Ok(c.query_row("PRAGMA user_version", [], |r| r.get(0))?))
        .await
        .unwrap();
    assert_eq!(version, super::SCHEMA_VERSION);
    conformance::reads_version_4_rows(&s).await;
}

/// Sets the file's schema version and records what a newer release's migration requires, as
/// that release would have (nothing else of it is needed: the ledger decides from these).
fn record_newer_schema(path: &std::path::Path, version: i64, compatible_from: i64) {
    let c = rusqlite::Connection::open(path).unwrap();
    c.execute(
        "INSERT INTO atmost_schema_compat (version, compatible_from) VALUES (?1, ?2)",
        [version, compatible_from],
    )
    .unwrap();
    c.execute_batch(&format!("PRAGMA user_version = {version}"))
        .unwrap();
}

/// A file migrated additively by a newer ledger is served; one whose schema needs a newer
/// ledger is refused at open, naming the versions, and left as it was.
#[tokio::test]
async fn a_newer_schema_is_served_when_additive_and_refused_otherwise() {
    use crate::store::schema::{two_versions_ahead_refusal, SCHEMA_VERSION};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(super::DB_FILE);
    drop(SqliteStore::open_file(&path).unwrap());
    record_newer_schema(&path, SCHEMA_VERSION + 1, SCHEMA_VERSION);
    let s = SqliteStore::open_file(&path).unwrap();
    let (_p, tok) = conformance::make_permit(&s, conformance::policy(), T0 + 3_600_000).await;
    let r = conformance::req(&tok, "pay", Some("k-newer"), "f", serde_json::json!({}));
    assert!(matches!(
        s.authorize(&r, conformance::LEASE_MS, T0, conformance::patient())
            .await
            .unwrap()
            .response,
        atmost_protocol::AuthorizeResponse::Dispatch { .. }
    ));
    drop(s);
    record_newer_schema(&path, SCHEMA_VERSION + 2, SCHEMA_VERSION + 1);
    let refused = SqliteStore::open_file(&path).map(|_| ()).unwrap_err();
    assert_eq!(refused, two_versions_ahead_refusal());
    let c = rusqlite::Connection::open(&path).unwrap();
    let version: i64 = c
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, SCHEMA_VERSION + 2);
}

#[test]
fn a_new_file_records_what_each_version_requires() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(super::DB_FILE);
    drop(SqliteStore::open_file(&path).unwrap());
    let c = rusqlite::Connection::open(&path).unwrap();
    let mut q = c
        .prepare("SELECT version, compatible_from FROM atmost_schema_compat ORDER BY version")
        .unwrap();
    let rows: Vec<(i64, i64)> = q
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(&rows[..6], [(1, 1), (2, 2), (3, 3), (4, 4), (5, 4), (6, 4)]);
    assert_eq!(
        rows.last().map(|r| r.0),
        Some(crate::store::schema::SCHEMA_VERSION)
    );
}

/// A decision's group commits durably before it is answered; a group of outcome reports only
/// commits without its sync, which the writer makes itself soon after when no durable commit
/// came to cover it (docs/design.md#the-ledgers-hot-path).
#[tokio::test]
async fn decisions_commit_durably_and_reports_are_synced_soon_after() {
    use atmost_protocol::Outcome;
    use std::time::Duration;
    let dir = tempfile::tempdir().unwrap();
    let s = SqliteStore::open_dir(dir.path()).unwrap();
    let (_, tok) = conformance::make_permit(&s, conformance::policy(), T0 + 1_000_000).await;
    let before = s.commit_counts();
    let r = conformance::req(&tok, "pay", Some("k-durable"), "fp", serde_json::json!({}));
    let id = conformance::dispatched(&conformance::auth(&s, &r, T0 + 1).await);
    let decided = s.commit_counts();
    assert_eq!(decided.durable, before.durable + 1, "{decided:?}");
    assert_eq!(decided.lazy, before.lazy);
    // Nothing is left to sync after a durable commit.
    tokio::time::sleep(super::writer::LAZY_SYNC_WITHIN * 3).await;
    assert_eq!(s.commit_counts().wal_syncs, decided.wal_syncs);

    let report = conformance::report_of(
        &id,
        Outcome::Completed {
            receipt: "{}".into(),
        },
    );
    s.record_outcome(&report, T0 + 2).await.unwrap();
    let reported = s.commit_counts();
    assert_eq!(reported.lazy, decided.lazy + 1, "{reported:?}");
    assert_eq!(reported.durable, decided.durable);
    // No decision came after it: the writer syncs the WAL itself, within its bound.
    let waited = std::time::Instant::now();
    while s.commit_counts().wal_syncs == reported.wal_syncs {
        assert!(
            waited.elapsed() < Duration::from_secs(10),
            "the WAL was never synced"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        waited.elapsed() >= super::writer::LAZY_SYNC_WITHIN / 2,
        "synced at once, not soon after"
    );
    // And the report is there, as any commit's.
    let attempt = s.get_attempt(&id).await.unwrap().unwrap();
    assert_eq!(attempt.state, crate::model::AttemptState::Completed);
}

/// The group of reports and the decision's set the connection's `synchronous` as they need.
#[tokio::test]
async fn a_group_of_reports_commits_with_normal_sync_and_a_decision_with_full() {
    let dir = tempfile::tempdir().unwrap();
    let conn = super::open_conn(&dir.path().join("x.sqlite3")).unwrap();
    let sync = |conn: &rusqlite::Connection| -> i64 {
        conn.query_row("PRAGMA synchronous", [], |r| r.get(0))
            .unwrap()
    };
    conn.execute_batch("CREATE TABLE t (x INTEGER)").unwrap();
    let counts = super::writer::CommitCounters::default();
    let op = |durability: super::writer::Durability| -> Box<dyn super::Op> {
        let (reply, _answer) =
            tokio::sync::oneshot::channel::<Result<(), crate::error::LedgerError>>();
        Box::new(super::Pending {
            work: Some(|tx: &super::GroupTx<'_>| {
                tx.execute("INSERT INTO t VALUES (1)", [])?;
                Ok::<_, crate::error::LedgerError>(())
            }),
            durability,
            deadline: None,
            result: None,
            reply,
        })
    };
    assert!(matches!(
        super::writer::run_group(
            &conn,
            vec![op(super::writer::Durability::Soon)],
            false,
            &counts
        ),
        super::writer::Committed::Lazily
    ));
    assert_eq!(sync(&conn), 1, "synchronous=NORMAL");
    assert!(matches!(
        super::writer::run_group(
            &conn,
            vec![op(super::writer::Durability::BeforeAnswer)],
            true,
            &counts
        ),
        super::writer::Committed::Durably
    ));
    assert_eq!(sync(&conn), 2, "synchronous=FULL");
    // A group that wrote nothing (the readiness check's read) synced nothing, so it does not
    // stand for the sync a lazy commit before it waits for.
    let (reply, _answer) = tokio::sync::oneshot::channel::<Result<(), crate::error::LedgerError>>();
    let read: Box<dyn super::Op> = Box::new(super::Pending {
        work: Some(|tx: &super::GroupTx<'_>| {
            tx.query_row("PRAGMA user_version", [], |r| r.get::<_, i64>(0))?;
            Ok::<_, crate::error::LedgerError>(())
        }),
        durability: super::writer::Durability::BeforeAnswer,
        deadline: None,
        result: None,
        reply,
    });
    assert!(matches!(
        super::writer::run_group(&conn, vec![read], true, &counts),
        super::writer::Committed::Unwritten
    ));
}
