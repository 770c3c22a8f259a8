//! The embedded store: one SQLite file in WAL mode with `synchronous=FULL`, so a committed
//! decision survives `kill -9` and power loss. Every decision runs in `BEGIN IMMEDIATE`,
//! which takes SQLite's write lock before the first read: check and reserve are atomic,
//! also across processes sharing the file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use atmost_protocol::{AuthorizeRequest, OutcomeReport};
use rusqlite::{params, Connection, OptionalExtension, Row, Transaction, TransactionBehavior};

use super::{AttemptFilter, OutcomeResult, Store, SweepReport};
use crate::clock::Millis;
use crate::decide::{self, DecideParams, Decision, Mutation, ResolveInput, Snapshot};
use crate::error::{LedgerError, ResolveError};
use crate::model::{
    Attempt, AttemptState, BudgetTotals, Permit, PermitDetail, Policy, Resolution, ToolUsage,
};
use crate::token;

/// File name of the database inside the data directory.
pub const DB_FILE: &str = "atmost.sqlite3";

const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS permits (
    id           TEXT PRIMARY KEY,
    token_hash   TEXT NOT NULL,
    label        TEXT NOT NULL,
    created_at   INTEGER NOT NULL,
    expires_at   INTEGER NOT NULL,
    revoked_at   INTEGER,
    retention_ms INTEGER NOT NULL,
    policy       TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS attempts (
    id                TEXT PRIMARY KEY,
    permit_id         TEXT NOT NULL REFERENCES permits(id),
    tool              TEXT NOT NULL,
    key_hash          TEXT,
    fingerprint       TEXT NOT NULL,
    cost              INTEGER NOT NULL,
    state             TEXT NOT NULL,
    created_at        INTEGER NOT NULL,
    updated_at        INTEGER NOT NULL,
    lease_expires_at  INTEGER NOT NULL,
    finished_at       INTEGER,
    receipt           TEXT,
    reason            TEXT,
    replay_count      INTEGER NOT NULL DEFAULT 0,
    pruned_at         INTEGER,
    resolved_executed INTEGER,
    resolved_by       TEXT,
    resolved_at       INTEGER,
    resolution_note   TEXT
);
CREATE INDEX IF NOT EXISTS attempts_by_permit_tool_state ON attempts(permit_id, tool, state);
CREATE INDEX IF NOT EXISTS attempts_by_permit_fingerprint ON attempts(permit_id, fingerprint, created_at);
CREATE INDEX IF NOT EXISTS attempts_by_state_lease ON attempts(state, lease_expires_at);
CREATE TABLE IF NOT EXISTS idempotency_keys (
    permit_id  TEXT NOT NULL,
    key_hash   TEXT NOT NULL,
    attempt_id TEXT NOT NULL REFERENCES attempts(id),
    PRIMARY KEY (permit_id, key_hash)
);
"#;

const ATTEMPT_COLS: &str = "a.id, a.permit_id, a.tool, a.key_hash, a.fingerprint, a.cost, a.state, a.created_at, \
     a.updated_at, a.lease_expires_at, a.finished_at, a.receipt, a.reason, a.replay_count, a.pruned_at, \
     a.resolved_executed, a.resolved_by, a.resolved_at, a.resolution_note";

const PERMIT_COLS: &str = "id, token_hash, label, created_at, expires_at, revoked_at, policy";

/// The state lists of the SQL below come from the model's rules (`holds_slot`,
/// `reserves_budget`, …), so a state added there is counted here without edits. States are
/// stored as text (`AttemptState::as_str`).
fn states(pred: fn(AttemptState) -> bool) -> String {
    AttemptState::sql_list(pred)
}

pub struct SqliteStore {
    conn: Arc<Mutex<Connection>>,
    path: PathBuf,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.path)
            .finish()
    }
}

fn to_i64(n: u64) -> Result<i64, LedgerError> {
    i64::try_from(n).map_err(|_| LedgerError::Invalid(format!("{n} is too large to store")))
}

fn to_u64(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

fn sql_err(e: rusqlite::Error) -> LedgerError {
    LedgerError::Store(e.to_string())
}

fn read_permit(row: &Row<'_>) -> rusqlite::Result<(Permit, String)> {
    let policy_json: String = row.get(6)?;
    Ok((
        Permit {
            id: row.get(0)?,
            token_hash: row.get(1)?,
            label: row.get(2)?,
            created_at_ms: row.get(3)?,
            expires_at_ms: row.get(4)?,
            revoked_at_ms: row.get(5)?,
            policy: Policy {
                tools: Vec::new(),
                max_calls: BTreeMap::new(),
                max_calls_default: None,
                budget: None,
                cost: BTreeMap::new(),
                cost_default: 0,
                duplicate_guard: Default::default(),
                retention_ms: 0,
            },
        },
        policy_json,
    ))
}

fn finish_permit((mut p, policy_json): (Permit, String)) -> Result<Permit, LedgerError> {
    p.policy = serde_json::from_str(&policy_json)?;
    Ok(p)
}

fn read_attempt(row: &Row<'_>) -> rusqlite::Result<(Attempt, String)> {
    let state: String = row.get(6)?;
    let resolved_executed: Option<bool> = row.get(15)?;
    let resolved_by: Option<String> = row.get(16)?;
    let resolved_at: Option<i64> = row.get(17)?;
    let note: Option<String> = row.get(18)?;
    let resolution = match (resolved_executed, resolved_by, resolved_at) {
        (Some(executed), Some(by), Some(at_ms)) => Some(Resolution {
            executed,
            by,
            at_ms,
            note,
        }),
        _ => None,
    };
    Ok((
        Attempt {
            id: row.get(0)?,
            permit_id: row.get(1)?,
            tool: row.get(2)?,
            key_hash: row.get(3)?,
            fingerprint: row.get(4)?,
            cost: to_u64(row.get(5)?),
            state: AttemptState::InFlight,
            created_at_ms: row.get(7)?,
            updated_at_ms: row.get(8)?,
            lease_expires_at_ms: row.get(9)?,
            finished_at_ms: row.get(10)?,
            receipt: row.get(11)?,
            reason: row.get(12)?,
            replay_count: to_u64(row.get(13)?),
            pruned_at_ms: row.get(14)?,
            resolution,
        },
        state,
    ))
}

fn finish_attempt((mut a, state): (Attempt, String)) -> Result<Attempt, LedgerError> {
    a.state = state.parse().map_err(LedgerError::Corrupt)?;
    Ok(a)
}

fn load_permit(conn: &Connection, id: &str) -> Result<Option<Permit>, LedgerError> {
    let sql = format!("SELECT {PERMIT_COLS} FROM permits WHERE id = ?1");
    conn.query_row(&sql, params![id], read_permit)
        .optional()?
        .map(finish_permit)
        .transpose()
}

fn load_attempt(conn: &Connection, id: &str) -> Result<Option<Attempt>, LedgerError> {
    let sql = format!("SELECT {ATTEMPT_COLS} FROM attempts a WHERE a.id = ?1");
    conn.query_row(&sql, params![id], read_attempt)
        .optional()?
        .map(finish_attempt)
        .transpose()
}

fn query_attempts(
    conn: &Connection,
    sql: &str,
    args: &[&dyn rusqlite::ToSql],
) -> Result<Vec<Attempt>, LedgerError> {
    let mut stmt = conn.prepare(sql)?;
    let rows = stmt.query_map(args, read_attempt)?;
    let mut out = Vec::new();
    for r in rows {
        out.push(finish_attempt(r?)?);
    }
    Ok(out)
}

fn insert_attempt(tx: &Transaction<'_>, a: &Attempt) -> Result<(), LedgerError> {
    tx.execute(
        "INSERT INTO attempts (id, permit_id, tool, key_hash, fingerprint, cost, state, created_at, updated_at, \
         lease_expires_at, finished_at, receipt, reason, replay_count, pruned_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)",
        params![
            a.id,
            a.permit_id,
            a.tool,
            a.key_hash,
            a.fingerprint,
            to_i64(a.cost)?,
            a.state.as_str(),
            a.created_at_ms,
            a.updated_at_ms,
            a.lease_expires_at_ms,
            a.finished_at_ms,
            a.receipt,
            a.reason,
            to_i64(a.replay_count)?,
            a.pruned_at_ms,
        ],
    )?;
    if let Some(kh) = a.key_hash.as_ref() {
        tx.execute(
            "INSERT INTO idempotency_keys (permit_id, key_hash, attempt_id) VALUES (?1, ?2, ?3) \
             ON CONFLICT (permit_id, key_hash) DO UPDATE SET attempt_id = excluded.attempt_id",
            params![a.permit_id, kh, a.id],
        )?;
    }
    Ok(())
}

fn update_attempt(tx: &Transaction<'_>, a: &Attempt) -> Result<(), LedgerError> {
    let (rex, rby, rat, rnote) = match a.resolution.as_ref() {
        Some(r) => (
            Some(r.executed),
            Some(r.by.clone()),
            Some(r.at_ms),
            r.note.clone(),
        ),
        None => (None, None, None, None),
    };
    tx.execute(
        "UPDATE attempts SET state = ?2, updated_at = ?3, lease_expires_at = ?4, finished_at = ?5, receipt = ?6, \
         reason = ?7, replay_count = ?8, pruned_at = ?9, resolved_executed = ?10, resolved_by = ?11, \
         resolved_at = ?12, resolution_note = ?13 WHERE id = ?1",
        params![
            a.id,
            a.state.as_str(),
            a.updated_at_ms,
            a.lease_expires_at_ms,
            a.finished_at_ms,
            a.receipt,
            a.reason,
            to_i64(a.replay_count)?,
            a.pruned_at_ms,
            rex,
            rby,
            rat,
            rnote,
        ],
    )?;
    Ok(())
}

fn tool_usage(conn: &Connection, permit_id: &str, tool: &str) -> Result<ToolUsage, LedgerError> {
    let n: i64 = conn.query_row(
        &format!(
            "SELECT COUNT(*) FROM attempts WHERE permit_id = ?1 AND tool = ?2 AND state IN {}",
            states(AttemptState::holds_slot)
        ),
        params![permit_id, tool],
        |r| r.get(0),
    )?;
    Ok(ToolUsage {
        calls_made: to_u64(n),
    })
}

fn budget_totals(conn: &Connection, permit_id: &str) -> Result<BudgetTotals, LedgerError> {
    let (reserved, spent): (i64, i64) = conn.query_row(
        &format!(
            "SELECT COALESCE(SUM(CASE WHEN state IN {} THEN cost END), 0), \
                    COALESCE(SUM(CASE WHEN state IN {} THEN cost END), 0) \
             FROM attempts WHERE permit_id = ?1",
            states(AttemptState::reserves_budget),
            states(AttemptState::spends_budget)
        ),
        params![permit_id],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )?;
    Ok(BudgetTotals {
        spent: to_u64(spent),
        reserved: to_u64(reserved),
    })
}

fn load_snapshot(
    conn: &Connection,
    req: &AuthorizeRequest,
    key_hash: Option<&str>,
    now: Millis,
) -> Result<Snapshot, LedgerError> {
    let mut snap = Snapshot {
        now_ms: now,
        ..Snapshot::default()
    };
    let Some(permit_id) = token::permit_id_of(&req.permit_token) else {
        return Ok(snap);
    };
    let Some(permit) = load_permit(conn, permit_id)? else {
        return Ok(snap);
    };
    // Nothing else is read for a token that does not authenticate.
    if decide::authenticate(&req.permit_token, Some(&permit)).is_none() {
        snap.permit = Some(permit);
        return Ok(snap);
    }
    if let Some(kh) = key_hash {
        let sql = format!(
            "SELECT {ATTEMPT_COLS} FROM idempotency_keys k JOIN attempts a ON a.id = k.attempt_id \
             WHERE k.permit_id = ?1 AND k.key_hash = ?2"
        );
        snap.existing = query_attempts(conn, &sql, &[&permit.id, &kh])?
            .into_iter()
            .next();
    }
    snap.usage = tool_usage(conn, &permit.id, &req.tool)?;
    snap.budget = budget_totals(conn, &permit.id)?;
    let since = now.saturating_sub(permit.policy.retention_ms);
    let sql = format!(
        "SELECT {ATTEMPT_COLS} FROM attempts a WHERE a.permit_id = ?1 AND a.fingerprint = ?2 \
         AND a.state NOT IN {} AND a.created_at >= ?3 \
         AND (?4 IS NULL OR a.key_hash IS NULL OR a.key_hash <> ?4) \
         ORDER BY a.created_at DESC LIMIT 1",
        states(AttemptState::gave_back)
    );
    snap.recent_duplicate = query_attempts(
        conn,
        &sql,
        &[&permit.id, &req.fingerprint, &since, &key_hash],
    )?
    .into_iter()
    .next();
    snap.permit = Some(permit);
    Ok(snap)
}

impl SqliteStore {
    /// Opens (creating if needed) the store under `data_dir`.
    pub fn open_dir(data_dir: &Path) -> Result<Self, LedgerError> {
        std::fs::create_dir_all(data_dir).map_err(|e| {
            LedgerError::Store(format!(
                "cannot create data dir {}: {e}",
                data_dir.display()
            ))
        })?;
        Self::open_file(&data_dir.join(DB_FILE))
    }

    /// Opens (creating if needed) the database file at `path`.
    pub fn open_file(path: &Path) -> Result<Self, LedgerError> {
        let conn = Connection::open(path)?;
        conn.busy_timeout(Duration::from_secs(10))?;
        let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(LedgerError::Store(format!(
                "journal_mode is {mode}, WAL required"
            )));
        }
        conn.execute_batch("PRAGMA synchronous = FULL; PRAGMA foreign_keys = ON;")?;
        conn.execute_batch(SCHEMA)?;
        Ok(SqliteStore {
            conn: Arc::new(Mutex::new(conn)),
            path: path.to_path_buf(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` on the connection in the blocking pool.
    async fn run<R, E, F>(&self, f: F) -> Result<R, E>
    where
        R: Send + 'static,
        E: From<LedgerError> + Send + 'static,
        F: FnOnce(&mut Connection) -> Result<R, E> + Send + 'static,
    {
        let conn = Arc::clone(&self.conn);
        match tokio::task::spawn_blocking(move || {
            let mut guard = conn.lock().unwrap_or_else(|p| p.into_inner());
            f(&mut guard)
        })
        .await
        {
            Ok(r) => r,
            Err(e) => Err(E::from(LedgerError::Join(e.to_string()))),
        }
    }
}

fn immediate(conn: &mut Connection) -> Result<Transaction<'_>, LedgerError> {
    conn.transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(sql_err)
}

#[async_trait]
impl Store for SqliteStore {
    async fn ping(&self, _now: Millis) -> Result<(), LedgerError> {
        self.run(|c| {
            c.query_row("SELECT COUNT(*) FROM permits", [], |r| r.get::<_, i64>(0))?;
            Ok::<_, LedgerError>(())
        })
        .await
    }

    async fn create_permit(&self, permit: &Permit, _now: Millis) -> Result<(), LedgerError> {
        let p = permit.clone();
        let policy =
            serde_json::to_string(&p.policy).map_err(|e| LedgerError::Invalid(e.to_string()))?;
        self.run(move |c| {
            let tx = immediate(c)?;
            tx.execute(
                "INSERT INTO permits (id, token_hash, label, created_at, expires_at, revoked_at, retention_ms, policy) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
                params![
                    p.id,
                    p.token_hash,
                    p.label,
                    p.created_at_ms,
                    p.expires_at_ms,
                    p.revoked_at_ms,
                    p.policy.retention_ms,
                    policy
                ],
            )?;
            tx.commit()?;
            Ok(())
        })
        .await
    }

    async fn list_permits(&self, _now: Millis) -> Result<Vec<Permit>, LedgerError> {
        self.run(|c| {
            let mut stmt = c.prepare(&format!(
                "SELECT {PERMIT_COLS} FROM permits ORDER BY created_at, id"
            ))?;
            let rows = stmt.query_map([], read_permit)?;
            let mut out = Vec::new();
            for r in rows {
                out.push(finish_permit(r?)?);
            }
            Ok(out)
        })
        .await
    }

    async fn permit_detail(
        &self,
        id: &str,
        _now: Millis,
    ) -> Result<Option<PermitDetail>, LedgerError> {
        let id = id.to_string();
        self.run(move |c| {
            let tx = c.transaction().map_err(sql_err)?;
            let Some(permit) = load_permit(&tx, &id)? else {
                return Ok(None);
            };
            let mut usage: BTreeMap<String, ToolUsage> = permit
                .policy
                .max_calls
                .keys()
                .map(|t| (t.clone(), ToolUsage::default()))
                .collect();
            let mut attempts_by_state = BTreeMap::new();
            {
                let mut stmt =
                    tx.prepare("SELECT tool, state, COUNT(*) FROM attempts WHERE permit_id = ?1 GROUP BY tool, state")?;
                let rows = stmt.query_map(params![id], |r| {
                    Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?, r.get::<_, i64>(2)?))
                })?;
                for r in rows {
                    let (tool, state, n) = r?;
                    let state: AttemptState = state.parse().map_err(LedgerError::Corrupt)?;
                    let n = to_u64(n);
                    *attempts_by_state.entry(state).or_insert(0) += n;
                    let u = usage.entry(tool).or_default();
                    if state.holds_slot() {
                        u.calls_made += n;
                    }
                }
            }
            let budget = budget_totals(&tx, &id)?;
            Ok(Some(PermitDetail {
                permit,
                usage,
                budget,
                attempts_by_state,
            }))
        })
        .await
    }

    async fn revoke_permit(&self, id: &str, now: Millis) -> Result<Option<Permit>, LedgerError> {
        let id = id.to_string();
        self.run(move |c| {
            let tx = immediate(c)?;
            tx.execute(
                "UPDATE permits SET revoked_at = ?2 WHERE id = ?1 AND revoked_at IS NULL",
                params![id, now],
            )?;
            let p = load_permit(&tx, &id)?;
            tx.commit()?;
            Ok(p)
        })
        .await
    }

    async fn authorize(
        &self,
        req: &AuthorizeRequest,
        lease_ms: u64,
        now: Millis,
    ) -> Result<Decision, LedgerError> {
        let req = req.clone();
        let params = DecideParams {
            lease_ms,
            new_attempt_id: token::new_attempt_id()?,
        };
        self.run(move |c| {
            let tx = immediate(c)?;
            let key_hash = decide::key_hash(&req);
            let snap = load_snapshot(&tx, &req, key_hash.as_deref(), now)?;
            let decision = decide::decide(&req, &snap, &params);
            match &decision.mutation {
                Mutation::None => {}
                Mutation::Reserve(a) => insert_attempt(&tx, a)?,
                Mutation::Update(a) => update_attempt(&tx, a)?,
            }
            tx.commit()?;
            Ok(decision)
        })
        .await
    }

    async fn record_outcome(
        &self,
        report: &OutcomeReport,
        now: Millis,
    ) -> Result<OutcomeResult, LedgerError> {
        let report = report.clone();
        self.run(move |c| {
            let tx = immediate(c)?;
            let existing = load_attempt(&tx, &report.attempt_id)?;
            let (ack, next) = decide::apply_outcome(existing.as_ref(), &report.outcome, now);
            if let Some(a) = next.as_ref() {
                update_attempt(&tx, a)?;
            }
            tx.commit()?;
            Ok(OutcomeResult {
                ack,
                previous: existing.map(|a| a.state),
            })
        })
        .await
    }

    async fn get_attempt(&self, id: &str, _now: Millis) -> Result<Option<Attempt>, LedgerError> {
        let id = id.to_string();
        self.run(move |c| load_attempt(c, &id)).await
    }

    async fn list_attempts(
        &self,
        filter: &AttemptFilter,
        _now: Millis,
    ) -> Result<Vec<Attempt>, LedgerError> {
        let state = filter.state.map(|s| s.as_str().to_string());
        let permit = filter.permit_id.clone();
        let limit = i64::from(filter.limit.unwrap_or(1000));
        self.run(move |c| {
            let sql = format!(
                "SELECT {ATTEMPT_COLS} FROM attempts a WHERE (?1 IS NULL OR a.state = ?1) \
                 AND (?2 IS NULL OR a.permit_id = ?2) ORDER BY a.created_at DESC, a.id LIMIT ?3"
            );
            query_attempts(c, &sql, &[&state, &permit, &limit])
        })
        .await
    }

    async fn resolve_attempt(
        &self,
        id: &str,
        input: &ResolveInput,
        now: Millis,
    ) -> Result<Attempt, ResolveError> {
        let id = id.to_string();
        let input = input.clone();
        self.run(move |c| {
            let tx = immediate(c)?;
            let Some(existing) = load_attempt(&tx, &id)? else {
                return Err(ResolveError::UnknownAttempt);
            };
            let next = decide::resolve(&existing, &input, now)?;
            update_attempt(&tx, &next)?;
            tx.commit().map_err(LedgerError::from)?;
            Ok(next)
        })
        .await
    }

    async fn sweep(&self, now: Millis) -> Result<SweepReport, LedgerError> {
        self.run(move |c| {
            let tx = immediate(c)?;
            let mut report = SweepReport::default();
            let sql = format!(
                "SELECT {ATTEMPT_COLS} FROM attempts a WHERE a.state IN {} AND a.lease_expires_at <= ?1",
                states(AttemptState::leased)
            );
            for a in query_attempts(&tx, &sql, &[&now])? {
                if let Some(next) = decide::expire_lease(&a, now) {
                    update_attempt(&tx, &next)?;
                    report.leases_expired += 1;
                }
            }
            let sql = format!(
                "SELECT {ATTEMPT_COLS}, p.retention_ms FROM attempts a JOIN permits p ON p.id = a.permit_id \
                 WHERE a.state IN {} AND a.pruned_at IS NULL \
                 AND COALESCE(a.finished_at, a.updated_at) + p.retention_ms <= ?1",
                states(AttemptState::replays)
            );
            let candidates: Vec<(Attempt, i64)> = {
                let mut stmt = tx.prepare(&sql)?;
                let rows = stmt.query_map(params![now], |r| Ok((read_attempt(r)?, r.get::<_, i64>(19)?)))?;
                let mut out = Vec::new();
                for r in rows {
                    let (a, retention) = r?;
                    out.push((finish_attempt(a)?, retention));
                }
                out
            };
            for (a, retention) in candidates {
                if let Some(next) = decide::prune(&a, retention, now) {
                    update_attempt(&tx, &next)?;
                    report.receipts_pruned += 1;
                }
            }
            tx.commit()?;
            Ok(report)
        })
        .await
    }

    async fn attempt_counts(
        &self,
        _now: Millis,
    ) -> Result<BTreeMap<AttemptState, u64>, LedgerError> {
        self.run(|c| {
            let mut stmt = c.prepare("SELECT state, COUNT(*) FROM attempts GROUP BY state")?;
            let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))?;
            let mut out: BTreeMap<AttemptState, u64> =
                AttemptState::ALL.iter().map(|s| (*s, 0)).collect();
            for r in rows {
                let (s, n) = r?;
                let s: AttemptState = s.parse().map_err(LedgerError::Corrupt)?;
                out.insert(s, to_u64(n));
            }
            Ok(out)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use async_trait::async_trait;

    use super::SqliteStore;
    use crate::store::conformance::Harness;
    use crate::store::Store;

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

    #[test]
    fn opens_in_wal_with_full_sync() {
        let dir = tempfile::tempdir().unwrap();
        let s = SqliteStore::open_dir(dir.path()).unwrap();
        let c = s.conn.lock().unwrap();
        let mode: String = c
            .query_row("PRAGMA journal_mode", [], |r| r.get(0))
            .unwrap();
        let sync: i64 = c.query_row("PRAGMA synchronous", [], |r| r.get(0)).unwrap();
        assert_eq!(mode, "wal");
        assert_eq!(sync, 2, "synchronous=FULL");
        assert!(dir.path().join(super::DB_FILE).exists());
    }
}
