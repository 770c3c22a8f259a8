//! The embedded store: one SQLite file in WAL mode with `synchronous=FULL`, so a committed
//! decision survives `kill -9` and power loss. Every decision runs in `BEGIN IMMEDIATE`,
//! which takes SQLite's write lock before the first read: check and reserve are atomic,
//! also across processes sharing the file.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use atmost_protocol::{AuthorizeRequest, OutcomeReport};
use rusqlite::config::DbConfig;
use rusqlite::{params, Connection, OptionalExtension, Row, TransactionBehavior};

use super::counters::CounterMoves;
use super::{AttemptFilter, OutcomeResult, PermitCounters, Store, SweepReport};
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

/// Version 2: O(1) counters kept in the same transaction as every write that moves a slot or
/// budget (see [`decide::counter_delta`]), backfilled from the attempts. The state lists are
/// the model's rules as they were when this migration was written (a migration never changes).
const MIGRATION_2: &str = r#"
CREATE TABLE IF NOT EXISTS permit_tool_usage (
    permit_id  TEXT NOT NULL,
    tool       TEXT NOT NULL,
    slots_held INTEGER NOT NULL,
    PRIMARY KEY (permit_id, tool)
) WITHOUT ROWID;
ALTER TABLE permits ADD COLUMN reserved INTEGER NOT NULL DEFAULT 0;
ALTER TABLE permits ADD COLUMN spent INTEGER NOT NULL DEFAULT 0;
INSERT INTO permit_tool_usage (permit_id, tool, slots_held)
    SELECT permit_id, tool, COUNT(*) FROM attempts
    WHERE state IN ('in_flight','completed','uncertain','resolved_executed','awaiting_input','accepted')
    GROUP BY permit_id, tool;
UPDATE permits SET
    reserved = COALESCE((SELECT SUM(cost) FROM attempts a WHERE a.permit_id = permits.id
                         AND a.state IN ('in_flight','awaiting_input')), 0),
    spent = COALESCE((SELECT SUM(cost) FROM attempts a WHERE a.permit_id = permits.id
                      AND a.state IN ('completed','uncertain','resolved_executed','accepted')), 0);
"#;

/// Version 3: what used to be read by scanning every attempt is kept or indexed for what it
/// is. Attempts per state are counted in a table kept in the writing transaction (the metrics
/// read it every sweep). The lease sweeper and the receipt pruner read partial indexes that
/// hold only their candidates, so their work follows the candidates, not the history. The
/// two indexes over every attempt's state (changed by every report) are gone. The state lists
/// are the model's `leased` and `replays` when this was written; the queries build the same
/// lists, and a test keeps them equal.
const MIGRATION_3: &str = r#"
CREATE TABLE IF NOT EXISTS attempt_state_counts (
    state TEXT PRIMARY KEY,
    n     INTEGER NOT NULL
) WITHOUT ROWID;
INSERT INTO attempt_state_counts (state, n) SELECT state, COUNT(*) FROM attempts GROUP BY state;
DROP INDEX IF EXISTS attempts_by_permit_tool_state;
DROP INDEX IF EXISTS attempts_by_state_lease;
CREATE INDEX IF NOT EXISTS attempts_leased ON attempts(lease_expires_at)
    WHERE state IN ('in_flight','awaiting_input');
CREATE INDEX IF NOT EXISTS attempts_prunable ON attempts(COALESCE(finished_at, updated_at))
    WHERE pruned_at IS NULL AND state IN ('completed','resolved_executed','accepted');
"#;

/// Version 4: dispatch rounds. Each attempt keeps its current round and the SHA-256 of that
/// round's capability; a report must name the round and carry the capability. Attempts
/// written before have round 1 and no capability, so no report moves them: their lease
/// turns them `uncertain` (fail closed), and an operator resolves them.
const MIGRATION_4: &str = r#"
ALTER TABLE attempts ADD COLUMN round INTEGER NOT NULL DEFAULT 1;
ALTER TABLE attempts ADD COLUMN capability_hash TEXT;
"#;

/// The schema version this ledger writes (`PRAGMA user_version`).
pub const SCHEMA_VERSION: i64 = 4;

/// Brings the file to [`SCHEMA_VERSION`] in one `BEGIN IMMEDIATE` transaction (so processes
/// opening the same file together migrate it once).
fn migrate(conn: &mut Connection) -> Result<(), LedgerError> {
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(sql_err)?;
    let version: i64 = tx.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    if version < 1 {
        // Version 1 predates the version number: its tables may already exist.
        tx.execute_batch(SCHEMA)?;
    }
    if version < 2 {
        tx.execute_batch(MIGRATION_2)?;
    }
    if version < 3 {
        tx.execute_batch(MIGRATION_3)?;
    }
    if version < 4 {
        tx.execute_batch(MIGRATION_4)?;
    }
    if version < SCHEMA_VERSION {
        tx.execute_batch(&format!("PRAGMA user_version = {SCHEMA_VERSION}"))?;
        tracing::info!(
            from = version,
            to = SCHEMA_VERSION,
            "sqlite schema migrated"
        );
    } else if version > SCHEMA_VERSION {
        tracing::warn!(
            database_version = version,
            known = SCHEMA_VERSION,
            "the database has a newer schema than this ledger knows"
        );
    }
    tx.commit()?;
    Ok(())
}

const ATTEMPT_COLS: &str = "a.id, a.permit_id, a.tool, a.key_hash, a.fingerprint, a.cost, a.state, a.created_at, \
     a.updated_at, a.lease_expires_at, a.finished_at, a.receipt, a.reason, a.replay_count, a.pruned_at, \
     a.resolved_executed, a.resolved_by, a.resolved_at, a.resolution_note, a.round, a.capability_hash";

const PERMIT_COLS: &str = "id, token_hash, label, created_at, expires_at, revoked_at, policy";

/// The state lists of the SQL below come from the model's rules (`holds_slot`,
/// `reserves_budget`, …), so a state added there is counted here without edits. States are
/// stored as text (`AttemptState::as_str`).
fn states(pred: fn(AttemptState) -> bool) -> String {
    AttemptState::sql_list(pred)
}

pub struct SqliteStore {
    /// Operations for the writer thread, which owns the only writing connection.
    jobs: std::sync::mpsc::Sender<Box<dyn Op>>,
    /// A second connection for the admin API's reads (WAL lets it read beside the writer).
    reader: Arc<Mutex<Connection>>,
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
            round: row.get(19)?,
            capability_hash: row.get(20)?,
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
    conn.prepare_cached(&sql)?
        .query_row(params![id], read_permit)
        .optional()?
        .map(finish_permit)
        .transpose()
}

fn load_attempt(conn: &Connection, id: &str) -> Result<Option<Attempt>, LedgerError> {
    let sql = format!("SELECT {ATTEMPT_COLS} FROM attempts a WHERE a.id = ?1");
    conn.prepare_cached(&sql)?
        .query_row(params![id], read_attempt)
        .optional()?
        .map(finish_attempt)
        .transpose()
}

fn query_attempts(
    conn: &Connection,
    sql: &str,
    args: &[&dyn rusqlite::ToSql],
) -> Result<Vec<Attempt>, LedgerError> {
    let mut stmt = conn.prepare_cached(sql)?;
    let rows = stmt.query_map(args, read_attempt)?;
    let mut out = Vec::new();
    for r in rows {
        out.push(finish_attempt(r?)?);
    }
    Ok(out)
}

fn insert_attempt(tx: &Connection, a: &Attempt) -> Result<(), LedgerError> {
    tx.prepare_cached(
        "INSERT INTO attempts (id, permit_id, tool, key_hash, fingerprint, cost, state, created_at, updated_at, \
         lease_expires_at, finished_at, receipt, reason, replay_count, pruned_at, round, capability_hash) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17)",
    )?
    .execute(params![
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
        a.round,
        a.capability_hash,
    ])?;
    if let Some(kh) = a.key_hash.as_ref() {
        tx.prepare_cached(
            "INSERT INTO idempotency_keys (permit_id, key_hash, attempt_id) VALUES (?1, ?2, ?3) \
             ON CONFLICT (permit_id, key_hash) DO UPDATE SET attempt_id = excluded.attempt_id",
        )?
        .execute(params![a.permit_id, kh, a.id])?;
    }
    Ok(())
}

fn update_attempt(tx: &Connection, a: &Attempt) -> Result<(), LedgerError> {
    let (rex, rby, rat, rnote) = match a.resolution.as_ref() {
        Some(r) => (
            Some(r.executed),
            Some(r.by.clone()),
            Some(r.at_ms),
            r.note.clone(),
        ),
        None => (None, None, None, None),
    };
    tx.prepare_cached(
        "UPDATE attempts SET state = ?2, updated_at = ?3, lease_expires_at = ?4, finished_at = ?5, receipt = ?6, \
         reason = ?7, replay_count = ?8, pruned_at = ?9, resolved_executed = ?10, resolved_by = ?11, \
         resolved_at = ?12, resolution_note = ?13, round = ?14, capability_hash = ?15 WHERE id = ?1",
    )?
    .execute(params![
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
        a.round,
        a.capability_hash,
    ])?;
    Ok(())
}

/// Writes a group's summed counter moves ([`CounterMoves`]) just before it commits: each
/// counter row once, however many attempts of the group moved it.
fn write_counters(conn: &Connection, moves: &CounterMoves) -> Result<(), LedgerError> {
    for (permit_id, tool, n) in moves.slot_rows() {
        conn.prepare_cached(
            "INSERT INTO permit_tool_usage (permit_id, tool, slots_held) VALUES (?1, ?2, ?3) \
             ON CONFLICT (permit_id, tool) DO UPDATE SET slots_held = slots_held + excluded.slots_held",
        )?
        .execute(params![permit_id, tool, n])?;
    }
    for (permit_id, reserved, spent) in moves.budget_rows() {
        conn.prepare_cached(
            "UPDATE permits SET reserved = reserved + ?2, spent = spent + ?3 WHERE id = ?1",
        )?
        .execute(params![permit_id, reserved, spent])?;
    }
    // This store counts attempts per state over all permits (one row per state).
    let mut per_state: BTreeMap<AttemptState, i64> = BTreeMap::new();
    for (_, state, n) in moves.state_rows() {
        *per_state.entry(state).or_default() += n;
    }
    for (state, n) in per_state.into_iter().filter(|(_, n)| *n != 0) {
        conn.prepare_cached(
            "INSERT INTO attempt_state_counts (state, n) VALUES (?1, ?2) \
             ON CONFLICT (state) DO UPDATE SET n = n + excluded.n",
        )?
        .execute(params![state.as_str(), n])?;
    }
    Ok(())
}

/// Writes an attempt (inserted when `old` is `None`) in the caller's group transaction and
/// adds what it moves to the operation's counter moves.
fn write_attempt(
    tx: &GroupTx<'_>,
    old: Option<&Attempt>,
    new: &Attempt,
) -> Result<(), LedgerError> {
    match old {
        None => insert_attempt(tx, new)?,
        Some(_) => update_attempt(tx, new)?,
    }
    tx.own.borrow_mut().record(old, new);
    Ok(())
}

/// Slots held for one tool, from the counter.
fn tool_usage(conn: &Connection, permit_id: &str, tool: &str) -> Result<ToolUsage, LedgerError> {
    let n: Option<i64> = conn
        .prepare_cached(
            "SELECT slots_held FROM permit_tool_usage WHERE permit_id = ?1 AND tool = ?2",
        )?
        .query_row(params![permit_id, tool], |r| r.get(0))
        .optional()?;
    Ok(ToolUsage {
        calls_made: to_u64(n.unwrap_or(0)),
    })
}

/// Reserved and spent budget, from the counters.
fn budget_counters(conn: &Connection, permit_id: &str) -> Result<BudgetTotals, LedgerError> {
    let (reserved, spent): (i64, i64) = conn
        .prepare_cached("SELECT reserved, spent FROM permits WHERE id = ?1")?
        .query_row(params![permit_id], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?
        .unwrap_or((0, 0));
    Ok(BudgetTotals {
        spent: to_u64(spent),
        reserved: to_u64(reserved),
    })
}

/// Reserved and spent budget recounted from the attempts (`permit show`).
fn budget_totals(conn: &Connection, permit_id: &str) -> Result<BudgetTotals, LedgerError> {
    let (reserved, spent): (i64, i64) = conn
        .prepare_cached(&format!(
            "SELECT COALESCE(SUM(CASE WHEN state IN {} THEN cost END), 0), \
                    COALESCE(SUM(CASE WHEN state IN {} THEN cost END), 0) \
             FROM attempts WHERE permit_id = ?1",
            states(AttemptState::reserves_budget),
            states(AttemptState::spends_budget)
        ))?
        .query_row(params![permit_id], |r| Ok((r.get(0)?, r.get(1)?)))?;
    Ok(BudgetTotals {
        spent: to_u64(spent),
        reserved: to_u64(reserved),
    })
}

fn load_snapshot(
    conn: &GroupTx<'_>,
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
    let reads = decide::reads_needed(req, &permit, snap.existing.as_ref());
    // What is stored plus what the group moved and has not written yet.
    let add = |n: u64, by: i64| to_u64(i64::try_from(n).unwrap_or(i64::MAX).saturating_add(by));
    if reads.usage {
        let stored = tool_usage(conn, &permit.id, &req.tool)?;
        snap.usage = ToolUsage {
            calls_made: add(stored.calls_made, conn.pending_slots(&permit.id, &req.tool)),
        };
    }
    if reads.budget {
        let stored = budget_counters(conn, &permit.id)?;
        let (reserved, spent) = conn.pending_budget(&permit.id);
        snap.budget = BudgetTotals {
            reserved: add(stored.reserved, reserved),
            spent: add(stored.spent, spent),
        };
    }
    if reads.duplicate {
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
    }
    snap.permit = Some(permit);
    Ok(snap)
}

/// Applies one outcome report in the caller's transaction.
fn apply_report(
    tx: &GroupTx<'_>,
    report: &OutcomeReport,
    now: Millis,
) -> Result<OutcomeResult, LedgerError> {
    let existing = load_attempt(tx, &report.attempt_id)?;
    let (ack, next) = decide::apply_outcome(existing.as_ref(), report, now);
    if let (Some(old), Some(a)) = (existing.as_ref(), next.as_ref()) {
        write_attempt(tx, Some(old), a)?;
    }
    Ok(OutcomeResult {
        ack,
        previous: existing.map(|a| a.state),
    })
}

/// The counters of one permit as stored (for the conformance suite's recount check).
fn read_counters(conn: &Connection, id: &str) -> Result<Option<PermitCounters>, LedgerError> {
    if load_permit(conn, id)?.is_none() {
        return Ok(None);
    }
    let mut usage = BTreeMap::new();
    let mut stmt =
        conn.prepare_cached("SELECT tool, slots_held FROM permit_tool_usage WHERE permit_id = ?1")?;
    let rows = stmt.query_map(params![id], |r| {
        Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?))
    })?;
    for r in rows {
        let (tool, n) = r?;
        usage.insert(tool, n);
    }
    let (reserved, spent): (i64, i64) = conn
        .prepare_cached("SELECT reserved, spent FROM permits WHERE id = ?1")?
        .query_row(params![id], |r| Ok((r.get(0)?, r.get(1)?)))?;
    Ok(Some(PermitCounters {
        slots_held: usage,
        reserved,
        spent,
    }))
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

    /// Opens (creating if needed) the database file at `path`: migrates it, starts the writer
    /// thread on one connection and opens a second one for the admin API's reads.
    pub fn open_file(path: &Path) -> Result<Self, LedgerError> {
        let mut conn = open_conn(path)?;
        migrate(&mut conn)?;
        let reader = open_conn(path)?;
        reader.execute_batch("PRAGMA query_only = ON;")?;
        let (jobs, queue) = std::sync::mpsc::channel::<Box<dyn Op>>();
        std::thread::Builder::new()
            .name("atmost-sqlite-writer".into())
            .spawn(move || writer(conn, queue))
            .map_err(|e| LedgerError::Store(format!("cannot start the sqlite writer: {e}")))?;
        Ok(SqliteStore {
            jobs,
            reader: Arc::new(Mutex::new(reader)),
            path: path.to_path_buf(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` in the writer, inside the next group transaction and its own savepoint, and
    /// answers only once that transaction committed (or failed).
    async fn write<R, E, F>(&self, f: F) -> Result<R, E>
    where
        R: Send + 'static,
        E: From<LedgerError> + Send + 'static,
        F: FnOnce(&GroupTx<'_>) -> Result<R, E> + Send + 'static,
    {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let op: Box<dyn Op> = Box::new(Pending {
            work: Some(f),
            result: None,
            reply,
        });
        if self.jobs.send(op).is_err() {
            return Err(E::from(LedgerError::Store(
                "the sqlite writer has stopped".into(),
            )));
        }
        match answer.await {
            Ok(r) => r,
            Err(_) => Err(E::from(LedgerError::Join(
                "the sqlite writer dropped an operation".into(),
            ))),
        }
    }

    /// Runs `f` on the read connection in the blocking pool.
    async fn read<R, F>(&self, f: F) -> Result<R, LedgerError>
    where
        R: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<R, LedgerError> + Send + 'static,
    {
        let conn = Arc::clone(&self.reader);
        match tokio::task::spawn_blocking(move || {
            let mut guard = conn.lock().unwrap_or_else(|p| p.into_inner());
            f(&mut guard)
        })
        .await
        {
            Ok(r) => r,
            Err(e) => Err(LedgerError::Join(e.to_string())),
        }
    }
}

/// One connection with the store's settings: WAL, `synchronous=FULL`, foreign keys.
fn open_conn(path: &Path) -> Result<Connection, LedgerError> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(10))?;
    let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(LedgerError::Store(format!(
            "journal_mode is {mode}, WAL required"
        )));
    }
    conn.execute_batch("PRAGMA synchronous = FULL; PRAGMA foreign_keys = ON;")?;
    // Without the query planner stability guarantee, a cached statement whose plan could
    // depend on a bound value (`?4 IS NULL`, the `created_at` range) is compiled again on
    // every step: that was a third of the ledger's CPU under load. Plans here never need it.
    conn.set_db_config(DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG, true)?;
    conn.set_prepared_statement_cache_capacity(64);
    Ok(conn)
}

/// The group transaction one queued operation runs in: the connection (it derefs to it), the
/// counter moves of the group's earlier operations (written once, before the commit) and its
/// own. Counter reads add both to what is stored.
struct GroupTx<'a> {
    conn: &'a Connection,
    earlier: &'a CounterMoves,
    own: RefCell<CounterMoves>,
}

impl std::ops::Deref for GroupTx<'_> {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        self.conn
    }
}

impl GroupTx<'_> {
    /// Slots of the permit's tool taken (or given back) in this group and not written yet.
    fn pending_slots(&self, permit_id: &str, tool: &str) -> i64 {
        self.earlier
            .slots(permit_id, tool)
            .saturating_add(self.own.borrow().slots(permit_id, tool))
    }

    /// (reserved, spent) of the permit moved in this group and not written yet.
    fn pending_budget(&self, permit_id: &str) -> (i64, i64) {
        let (a, b) = (
            self.earlier.budget(permit_id),
            self.own.borrow().budget(permit_id),
        );
        (a.0.saturating_add(b.0), a.1.saturating_add(b.1))
    }
}

/// Most operations one group transaction takes from the queue.
const MAX_GROUP: usize = 256;

/// One queued write: run inside the group transaction, then answered with the commit's result.
trait Op: Send {
    /// Runs the work; `true` if it succeeded (its savepoint is kept).
    fn run(&mut self, tx: &GroupTx<'_>) -> bool;
    /// Answers the caller once the group transaction is over.
    fn finish(self: Box<Self>, commit: Result<(), String>);
}

struct Pending<R, E, F> {
    work: Option<F>,
    result: Option<Result<R, E>>,
    reply: tokio::sync::oneshot::Sender<Result<R, E>>,
}

impl<R, E, F> Op for Pending<R, E, F>
where
    R: Send,
    E: From<LedgerError> + Send,
    F: FnOnce(&GroupTx<'_>) -> Result<R, E> + Send,
{
    fn run(&mut self, tx: &GroupTx<'_>) -> bool {
        let Some(work) = self.work.take() else {
            return false;
        };
        let r = work(tx);
        let ok = r.is_ok();
        self.result = Some(r);
        ok
    }

    fn finish(self: Box<Self>, commit: Result<(), String>) {
        let answer = match (self.result, commit) {
            // A failed operation was rolled back to its savepoint: its own error stands.
            (Some(Err(e)), _) => Err(e),
            (Some(Ok(r)), Ok(())) => Ok(r),
            (Some(Ok(_)), Err(e)) | (None, Err(e)) => Err(E::from(LedgerError::Store(e))),
            (None, Ok(())) => Err(E::from(LedgerError::Store(
                "the operation was not run".into(),
            ))),
        };
        // The caller may have gone away (request cancelled): nothing to answer then.
        let _ = self.reply.send(answer);
    }
}

/// The writer thread: owns the connection; each round takes up to [`MAX_GROUP`] queued
/// operations into one `BEGIN IMMEDIATE` transaction, one savepoint each, commits once
/// (`synchronous=FULL`: durable when COMMIT returns) and only then answers them all. Ops run
/// one after another, so check + reserve stays atomic; `BEGIN IMMEDIATE` keeps it so across
/// processes sharing the file.
fn writer(conn: Connection, queue: std::sync::mpsc::Receiver<Box<dyn Op>>) {
    while let Ok(first) = queue.recv() {
        let mut group = Vec::with_capacity(16);
        group.push(first);
        while group.len() < MAX_GROUP {
            match queue.try_recv() {
                Ok(op) => group.push(op),
                Err(_) => break,
            }
        }
        run_group(&conn, group);
    }
}

/// Runs one statement without parameters through the statement cache (these run per operation).
fn exec_cached(conn: &Connection, sql: &str) -> rusqlite::Result<usize> {
    conn.prepare_cached(sql)?.execute([])
}

fn fail_all(conn: &Connection, group: Vec<Box<dyn Op>>, error: String) {
    if !conn.is_autocommit() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    for op in group {
        op.finish(Err(error.clone()));
    }
}

fn run_group(conn: &Connection, mut group: Vec<Box<dyn Op>>) {
    if let Err(e) = exec_cached(conn, "BEGIN IMMEDIATE") {
        return fail_all(conn, group, e.to_string());
    }
    let mut moves = CounterMoves::default();
    for op in group.iter_mut() {
        if let Err(e) = exec_cached(conn, "SAVEPOINT op") {
            return fail_all(conn, group, e.to_string());
        }
        let tx = GroupTx {
            conn,
            earlier: &moves,
            own: RefCell::default(),
        };
        let ok = op.run(&tx);
        let own = tx.own.into_inner();
        if conn.is_autocommit() {
            // SQLite rolled the whole transaction back (disk full, I/O error): nothing of
            // this group is durable.
            return fail_all(
                conn,
                group,
                "the store rolled the transaction back".to_string(),
            );
        }
        let end = if ok {
            // A failed operation's moves were rolled back with its savepoint.
            moves.absorb(own);
            exec_cached(conn, "RELEASE op")
        } else {
            exec_cached(conn, "ROLLBACK TO op").and_then(|_| exec_cached(conn, "RELEASE op"))
        };
        if let Err(e) = end {
            return fail_all(conn, group, e.to_string());
        }
    }
    if let Err(e) = write_counters(conn, &moves) {
        return fail_all(conn, group, e.to_string());
    }
    match exec_cached(conn, "COMMIT") {
        Ok(_) => {
            for op in group {
                op.finish(Ok(()));
            }
        }
        Err(e) => fail_all(conn, group, e.to_string()),
    }
}

#[async_trait]
impl Store for SqliteStore {
    async fn ping(&self, _now: Millis) -> Result<(), LedgerError> {
        // Through the writer: ready means decisions can be made.
        self.write(|c: &GroupTx<'_>| {
            c.prepare_cached("SELECT COUNT(*) FROM permits")?
                .query_row([], |r| r.get::<_, i64>(0))?;
            Ok::<_, LedgerError>(())
        })
        .await
    }

    async fn create_permit(&self, permit: &Permit, _now: Millis) -> Result<(), LedgerError> {
        let p = permit.clone();
        let policy =
            serde_json::to_string(&p.policy).map_err(|e| LedgerError::Invalid(e.to_string()))?;
        self.write(move |tx: &GroupTx<'_>| {
            tx.prepare_cached(
                "INSERT INTO permits (id, token_hash, label, created_at, expires_at, revoked_at, retention_ms, policy) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
            )?
            .execute(params![
                    p.id,
                    p.token_hash,
                    p.label,
                    p.created_at_ms,
                    p.expires_at_ms,
                    p.revoked_at_ms,
                    p.policy.retention_ms,
                    policy
                ])?;
            Ok(())
        })
        .await
    }

    async fn list_permits(&self, _now: Millis) -> Result<Vec<Permit>, LedgerError> {
        self.read(|c| {
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
        self.read(move |c| {
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
        self.write(move |tx: &GroupTx<'_>| {
            tx.execute(
                "UPDATE permits SET revoked_at = ?2 WHERE id = ?1 AND revoked_at IS NULL",
                params![id, now],
            )?;
            let p = load_permit(tx, &id)?;
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
            new_capability: token::new_capability()?,
        };
        self.write(move |tx: &GroupTx<'_>| {
            let key_hash = decide::key_hash(&req);
            let snap = load_snapshot(tx, &req, key_hash.as_deref(), now)?;
            let decision = decide::decide(&req, &snap, &params);
            match &decision.mutation {
                Mutation::None => {}
                Mutation::Reserve(a) => write_attempt(tx, None, a)?,
                Mutation::Update(a) => {
                    let old = snap
                        .existing
                        .as_ref()
                        .filter(|e| e.id == a.id)
                        .ok_or_else(|| {
                            LedgerError::Store(
                                "an update names an attempt that was not read".into(),
                            )
                        })?;
                    write_attempt(tx, Some(old), a)?
                }
            }
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
        self.write(move |tx: &GroupTx<'_>| apply_report(tx, &report, now))
            .await
    }

    async fn record_outcomes(
        &self,
        reports: &[OutcomeReport],
        now: Millis,
    ) -> Result<Vec<OutcomeResult>, LedgerError> {
        let reports = reports.to_vec();
        self.write(move |tx: &GroupTx<'_>| {
            let mut out = Vec::with_capacity(reports.len());
            for report in &reports {
                out.push(apply_report(tx, report, now)?);
            }
            Ok(out)
        })
        .await
    }

    async fn permit_counters(&self, id: &str) -> Result<Option<PermitCounters>, LedgerError> {
        let id = id.to_string();
        self.read(move |c| read_counters(c, &id)).await
    }

    async fn get_attempt(&self, id: &str, _now: Millis) -> Result<Option<Attempt>, LedgerError> {
        let id = id.to_string();
        self.read(move |c| load_attempt(c, &id)).await
    }

    async fn list_attempts(
        &self,
        filter: &AttemptFilter,
        _now: Millis,
    ) -> Result<Vec<Attempt>, LedgerError> {
        let state = filter.state.map(|s| s.as_str().to_string());
        let permit = filter.permit_id.clone();
        let limit = i64::from(filter.limit.unwrap_or(1000));
        self.read(move |c| {
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
        self.write(move |tx: &GroupTx<'_>| {
            let Some(existing) = load_attempt(tx, &id)? else {
                return Err(ResolveError::UnknownAttempt);
            };
            let next = decide::resolve(&existing, &input, now)?;
            write_attempt(tx, Some(&existing), &next)?;
            Ok(next)
        })
        .await
    }

    async fn sweep(&self, now: Millis) -> Result<SweepReport, LedgerError> {
        self.write(move |tx: &GroupTx<'_>| {
            let mut report = SweepReport::default();
            let sql = format!(
                "SELECT {ATTEMPT_COLS} FROM attempts a WHERE a.state IN {} AND a.lease_expires_at <= ?1",
                states(AttemptState::leased)
            );
            for a in query_attempts(tx, &sql, &[&now])? {
                if let Some(next) = decide::expire_lease(&a, now) {
                    write_attempt(tx, Some(&a), &next)?;
                    report.leases_expired += 1;
                }
            }
            // Nothing finished after `now - shortest retention` can be due: the index range
            // stops there, so a sweep reads the receipts that are due (and those of permits
            // with longer retention finished in between), not every receipt kept.
            let shortest: Option<i64> = tx
                .prepare_cached("SELECT MIN(retention_ms) FROM permits")?
                .query_row([], |r| r.get(0))?;
            let Some(shortest) = shortest else {
                return Ok(report);
            };
            let sql = format!(
                "SELECT {ATTEMPT_COLS}, p.retention_ms FROM attempts a JOIN permits p ON p.id = a.permit_id \
                 WHERE a.pruned_at IS NULL AND a.state IN {} \
                 AND COALESCE(a.finished_at, a.updated_at) <= ?2 \
                 AND COALESCE(a.finished_at, a.updated_at) + p.retention_ms <= ?1",
                states(AttemptState::replays)
            );
            let candidates: Vec<(Attempt, i64)> = {
                let mut stmt = tx.prepare_cached(&sql)?;
                let before = now.saturating_sub(shortest.max(0));
                let rows = stmt.query_map(params![now, before], |r| Ok((read_attempt(r)?, r.get::<_, i64>(19)?)))?;
                let mut out = Vec::new();
                for r in rows {
                    let (a, retention) = r?;
                    out.push((finish_attempt(a)?, retention));
                }
                out
            };
            for (a, retention) in candidates {
                if let Some(next) = decide::prune(&a, retention, now) {
                    write_attempt(tx, Some(&a), &next)?;
                    report.receipts_pruned += 1;
                }
            }
            Ok(report)
        })
        .await
    }

    async fn attempt_counts(
        &self,
        _now: Millis,
    ) -> Result<BTreeMap<AttemptState, u64>, LedgerError> {
        self.read(|c| {
            let mut stmt = c.prepare_cached("SELECT state, n FROM attempt_state_counts")?;
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
    use crate::store::conformance::{self, Harness, T0};
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
                    let a = Attempt::example(
                        &format!("a{i}"),
                        &permit_id,
                        "t",
                        AttemptState::InFlight,
                        1,
                    );
                    super::write_attempt(tx, None, &a)?;
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
        let counts = s.attempt_counts(T0).await.unwrap();
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
    /// those indexes (so a sweep reads its candidates, not the whole history).
    #[tokio::test]
    async fn sweeper_queries_read_the_partial_indexes() {
        use crate::model::AttemptState;
        assert!(super::MIGRATION_3.contains(&format!(
            "WHERE state IN {};",
            super::states(AttemptState::leased)
        )));
        assert!(super::MIGRATION_3.contains(&format!(
            "WHERE pruned_at IS NULL AND state IN {};",
            super::states(AttemptState::replays)
        )));
        let dir = tempfile::tempdir().unwrap();
        let s = SqliteStore::open_dir(dir.path()).unwrap();
        let plans = s
            .write(|c: &super::GroupTx<'_>| {
                let lease = format!(
                    "EXPLAIN QUERY PLAN SELECT {} FROM attempts a WHERE a.state IN {} AND a.lease_expires_at <= ?1",
                    super::ATTEMPT_COLS,
                    super::states(AttemptState::leased)
                );
                let prune = format!(
                    "EXPLAIN QUERY PLAN SELECT {}, p.retention_ms FROM attempts a JOIN permits p ON p.id = a.permit_id \
                     WHERE a.pruned_at IS NULL AND a.state IN {} \
                     AND COALESCE(a.finished_at, a.updated_at) <= ?2 \
                     AND COALESCE(a.finished_at, a.updated_at) + p.retention_ms <= ?1",
                    super::ATTEMPT_COLS,
                    super::states(AttemptState::replays)
                );
                let mut out = Vec::new();
                for sql in [lease, prune] {
                    let mut st = c.prepare(&sql)?;
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
        assert!(plans[0].contains("attempts_leased"), "{}", plans[0]);
        assert!(plans[1].contains("attempts_prunable"), "{}", plans[1]);
    }

    /// An older file (tables without a schema version, attempts in every state) is migrated
    /// to the counters with the same numbers a recount gives.
    #[tokio::test]
    async fn migration_backfills_counters_from_existing_rows() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(super::DB_FILE);
        {
            let c = rusqlite::Connection::open(&path).unwrap();
            c.execute_batch(super::SCHEMA).unwrap();
            c.execute(
                "INSERT INTO permits (id, token_hash, label, created_at, expires_at, retention_ms, policy) \
                 VALUES ('p1', 'h', 'l', 0, 1, 0, '{\"tools\":[\"*\"],\"retention_ms\":0}')",
                [],
            )
            .unwrap();
            for (i, st) in crate::model::AttemptState::ALL.iter().enumerate() {
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
        let d = s.permit_detail("p1", 0).await.unwrap().unwrap();
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
        let counts = s.attempt_counts(0).await.unwrap();
        assert!(counts.values().all(|n| *n == 2), "{counts:?}");
        assert_eq!(counts.len(), crate::model::AttemptState::ALL.len());
        drop(s);
        // Opening again leaves a migrated file alone.
        let s = SqliteStore::open_file(&path).unwrap();
        assert_eq!(s.permit_counters("p1").await.unwrap().unwrap(), c);
    }
}
