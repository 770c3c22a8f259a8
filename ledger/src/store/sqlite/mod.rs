//! The embedded store: one SQLite file in WAL mode with `synchronous=FULL`, so a committed
//! decision survives `kill -9` and power loss. Every decision runs in `BEGIN IMMEDIATE`,
//! which takes SQLite's write lock before the first read: check and reserve are atomic,
//! also across processes sharing the file.

mod credentials;
mod group_tx;
mod keys;
mod migrations;
mod operations;
mod purge;
mod rows;
mod writer;
mod writes;

pub use migrations::SCHEMA_VERSION;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use atmost_protocol::{AuthorizeRequest, OutcomeReport};
use rusqlite::config::DbConfig;
use rusqlite::{params, Connection};

use super::purge::{next_batch, PurgeReport};
use super::reads::{Dialect, ReadQueries, Rows, Statement};
use super::{Decisions, OutcomeResult, SweepReport};
use crate::clock::{Deadline, Millis};
use crate::credentials::{CredentialUse, StoredCredential};
use crate::decide::{self, ApprovalInput, DecideParams, Decision, Leases, Mutation, ResolveInput};
use crate::error::{ApprovalError, AttemptMoveError, LedgerError, ResolveError};
use crate::keys::{Rotation, SigningKey};
use crate::model::{Attempt, AttemptState, Permit};
use crate::store::rows::{AttemptRow, ATTEMPT_COLS};
use crate::token;
use group_tx::GroupTx;
use migrations::migrate;
use operations::{apply_report, load_snapshot};
use rows::{load_attempt, load_permit, query_attempts, run_statement};
pub use writer::CommitCounts;
use writer::{writer, CommitCounters, Durability, Op, Pending};
use writes::write_attempt;

/// File name of the database inside the data directory.
pub const DB_FILE: &str = "atmost.sqlite3";

/// The state lists of the SQL below come from the model's rules (`holds_slot`,
/// `reserves_budget`, …), so a state added there is counted here without edits. States are
/// stored as text (`AttemptState::as_str`).
fn states(pred: fn(AttemptState) -> bool) -> String {
    AttemptState::sql_list(pred)
}

/// The sweeper's attempts whose lease has run out (`?1`: now), from the partial index of the
/// leased states.
fn expired_leases_sql() -> String {
    format!(
        "SELECT {ATTEMPT_COLS} FROM attempts a INDEXED BY attempts_leased \
         WHERE a.state IN {} AND a.lease_expires_at <= ?1",
        states(AttemptState::leased)
    )
}

/// The sweeper's receipts past their permit's retention (`?1`: now; `?2`: now less the
/// shortest retention), with that retention. The index is named: with the statistics of a
/// store holding millions of attempts (`ANALYZE`, or `PRAGMA optimize`) SQLite's planner
/// chose to scan every permit and read each one's attempts, a read of the whole history
/// (5.8 s at 10^7 attempts, on the writer thread, once a second) instead of the range of
/// the prunable index that ends at `?2`.
fn prunable_receipts_sql() -> String {
    format!(
        "SELECT {ATTEMPT_COLS}, p.retention_ms AS retention_ms \
         FROM attempts a INDEXED BY attempts_prunable \
         JOIN permits p ON p.id = a.permit_id \
         WHERE a.pruned_at IS NULL AND a.state IN {} \
         AND COALESCE(a.finished_at, a.updated_at) <= ?2 \
         AND COALESCE(a.finished_at, a.updated_at) + p.retention_ms <= ?1",
        states(AttemptState::replays)
    )
}

pub struct SqliteStore {
    /// Operations for the writer, which owns the only writing connection.
    jobs: tokio::sync::mpsc::UnboundedSender<Box<dyn Op>>,
    /// A second connection for the reads that decide nothing (WAL lets it read beside the
    /// writer).
    reader: Arc<Mutex<Connection>>,
    path: PathBuf,
    commits: Arc<CommitCounters>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.path)
            .finish()
    }
}

fn sql_err(e: rusqlite::Error) -> LedgerError {
    LedgerError::from(e)
}

/// The SQLite boundary: a driver error as the ledger's. The file busy or locked past the busy
/// timeout, the disk full or read-only, an I/O error, no memory, or a file that cannot be
/// opened is an outage ([`LedgerError::Unavailable`]): the same call may succeed once the disk
/// does. A damaged file is [`LedgerError::Corrupt`]; anything else (a constraint, a type or
/// column mismatch, misuse) is a bug ([`LedgerError::Invariant`]).
impl From<rusqlite::Error> for LedgerError {
    fn from(e: rusqlite::Error) -> Self {
        use rusqlite::ErrorCode;
        let message = format!("sqlite: {e}");
        match e.sqlite_error_code() {
            Some(
                ErrorCode::DatabaseBusy
                | ErrorCode::DatabaseLocked
                | ErrorCode::DiskFull
                | ErrorCode::ReadOnly
                | ErrorCode::SystemIoFailure
                | ErrorCode::OutOfMemory
                | ErrorCode::CannotOpen
                | ErrorCode::PermissionDenied
                | ErrorCode::FileLockingProtocolFailed
                | ErrorCode::OperationInterrupted,
            ) => LedgerError::Unavailable(message),
            Some(ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase) => {
                LedgerError::Corrupt(message)
            }
            _ => LedgerError::Invariant(message),
        }
    }
}

impl SqliteStore {
    /// Opens (creating if needed) the store under `data_dir`, its writer on a thread of its
    /// own (the CLI's commands, the tests).
    pub fn open_dir(data_dir: &Path) -> Result<Self, LedgerError> {
        Self::open_file(&Self::file_in(data_dir)?)
    }

    /// Opens (creating if needed) the store under `data_dir`, its writer a task of `runtime`:
    /// the ledger gives it the runtime of the thread that reads the filter's requests, so a
    /// decision goes from socket to commit on that one thread.
    pub fn open_dir_on(
        data_dir: &Path,
        runtime: &tokio::runtime::Handle,
    ) -> Result<Self, LedgerError> {
        Self::open(&Self::file_in(data_dir)?, WriterHome::Runtime(runtime))
    }

    fn file_in(data_dir: &Path) -> Result<PathBuf, LedgerError> {
        std::fs::create_dir_all(data_dir).map_err(|e| {
            LedgerError::Unavailable(format!(
                "cannot create data dir {}: {e}",
                data_dir.display()
            ))
        })?;
        Ok(data_dir.join(DB_FILE))
    }

    /// Opens (creating if needed) the database file at `path`: migrates it, starts the writer
    /// on a thread of its own on one connection and opens a second one for the admin API's
    /// reads.
    pub fn open_file(path: &Path) -> Result<Self, LedgerError> {
        Self::open(path, WriterHome::OwnThread)
    }

    fn open(path: &Path, home: WriterHome<'_>) -> Result<Self, LedgerError> {
        let mut conn = open_conn(path)?;
        migrate(&mut conn)?;
        let reader = open_conn(path)?;
        reader.execute_batch("PRAGMA query_only = ON;")?;
        // WAL mode made it; the writer syncs it where a commit was answered before its sync.
        let wal = std::fs::File::open(wal_path(path)).ok();
        let (jobs, queue) = tokio::sync::mpsc::unbounded_channel::<Box<dyn Op>>();
        let commits = Arc::new(CommitCounters::default());
        let counts = Arc::clone(&commits);
        match home {
            WriterHome::Runtime(runtime) => {
                runtime.spawn(writer(conn, wal, queue, counts));
            }
            WriterHome::OwnThread => {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_time()
                    .build()
                    .map_err(|e| {
                        LedgerError::Unavailable(format!("cannot start the sqlite writer: {e}"))
                    })?;
                std::thread::Builder::new()
                    .name("atmost-sqlite-writer".into())
                    .spawn(move || runtime.block_on(writer(conn, wal, queue, counts)))
                    .map_err(|e| {
                        LedgerError::Unavailable(format!("cannot start the sqlite writer: {e}"))
                    })?;
            }
        }
        Ok(SqliteStore {
            jobs,
            reader: Arc::new(Mutex::new(reader)),
            path: path.to_path_buf(),
            commits,
        })
    }

    /// The writer's group commits so far, by how they reached the disk.
    pub fn commit_counts(&self) -> CommitCounts {
        self.commits.read()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` in the writer, inside the next group transaction and its own savepoint, and
    /// answers only once that transaction committed durably (or failed).
    /// A person's move of one attempt (a resolution, a decision on an approval): the attempt
    /// read, passed through the pure `step`, and what it returns written, in one transaction.
    async fn move_attempt<E, F>(&self, id: &str, step: F) -> Result<Attempt, E>
    where
        E: AttemptMoveError,
        F: FnOnce(&Attempt) -> Result<Attempt, E> + Send + 'static,
    {
        let id = id.to_string();
        self.write(move |tx: &GroupTx<'_>| {
            let Some(existing) = load_attempt(tx, &id)? else {
                return Err(E::unknown_attempt());
            };
            let next = step(&existing)?;
            write_attempt(tx, Some(&existing), &next)?;
            Ok(next)
        })
        .await
    }

    async fn write<R, E, F>(&self, f: F) -> Result<R, E>
    where
        R: Send + 'static,
        E: From<LedgerError> + Send + 'static,
        F: FnOnce(&GroupTx<'_>) -> Result<R, E> + Send + 'static,
    {
        self.write_by(None, Durability::BeforeAnswer, f).await
    }

    /// [`SqliteStore::write`], committed before `deadline` or not at all, and on disk before
    /// the answer or soon after it (`durability`).
    async fn write_by<R, E, F>(
        &self,
        deadline: Option<Deadline>,
        durability: Durability,
        f: F,
    ) -> Result<R, E>
    where
        R: Send + 'static,
        E: From<LedgerError> + Send + 'static,
        F: FnOnce(&GroupTx<'_>) -> Result<R, E> + Send + 'static,
    {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let op: Box<dyn Op> = Box::new(Pending {
            work: Some(f),
            durability,
            deadline,
            result: None,
            reply,
        });
        if self.jobs.send(op).is_err() {
            return Err(E::from(LedgerError::Unavailable(
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

/// Where the writer runs.
enum WriterHome<'a> {
    /// A task of this runtime (the ledger's decision loop).
    Runtime(&'a tokio::runtime::Handle),
    /// A thread of its own, with a runtime of its own.
    OwnThread,
}

/// The WAL file SQLite keeps beside the database in WAL mode.
fn wal_path(db: &Path) -> PathBuf {
    let mut name = db.as_os_str().to_os_string();
    name.push("-wal");
    PathBuf::from(name)
}

/// One connection with the store's settings: WAL, `synchronous=FULL`, foreign keys.
fn open_conn(path: &Path) -> Result<Connection, LedgerError> {
    let conn = Connection::open(path)?;
    // A file the ledger may not write (a read-only file system or mount, no write
    // permission) opens read-only without an error, and reads keep working: the ledger would
    // come up ready and fail every decision. Refused here, with the cause.
    if conn.is_readonly(rusqlite::MAIN_DB)? {
        return Err(LedgerError::Unavailable(format!(
            "the database file {} is read-only (read-only file system or no write permission)",
            path.display()
        )));
    }
    conn.busy_timeout(Duration::from_secs(10))?;
    let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(LedgerError::Unavailable(format!(
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

#[async_trait]
impl Decisions for SqliteStore {
    async fn ping(&self) -> Result<(), LedgerError> {
        // Through the writer: ready means decisions can be made (its write lock taken, the
        // file read). One read of the header, whatever the store holds: this runs once a
        // second on the thread that decides.
        self.write(|c: &GroupTx<'_>| {
            c.prepare_cached("PRAGMA user_version")?
                .query_row([], |r| r.get::<_, i64>(0))?;
            Ok::<_, LedgerError>(())
        })
        .await
    }

    async fn create_permit(&self, permit: &Permit) -> Result<(), LedgerError> {
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

    async fn authorize_with(
        &self,
        req: &AuthorizeRequest,
        credential: Option<CredentialUse>,
        leases: Leases,
        now: Millis,
        deadline: Deadline,
    ) -> Result<Decision, LedgerError> {
        let req = req.clone();
        let params = DecideParams {
            lease_ms: leases.call_ms,
            approval_wait_ms: leases.approval_wait_ms,
            new_attempt_id: token::new_attempt_id()?,
            new_capability: token::new_capability()?,
            credential,
        };
        self.write_by(
            Some(deadline),
            Durability::BeforeAnswer,
            move |tx: &GroupTx<'_>| {
                let key_hash = decide::key_hash(&req);
                let snap = load_snapshot(tx, &req, key_hash.as_deref(), now)?;
                let decision = decide::decide(&req, &snap, &params);
                match &decision.mutation {
                    Mutation::None => {}
                    Mutation::Reserve(a) => write_attempt(tx, None, a)?,
                    Mutation::Update(a) => {
                        let old =
                            snap.existing
                                .as_ref()
                                .filter(|e| e.id == a.id)
                                .ok_or_else(|| {
                                    LedgerError::Invariant(
                                        "an update names an attempt that was not read".into(),
                                    )
                                })?;
                        write_attempt(tx, Some(old), a)?
                    }
                }
                Ok(decision)
            },
        )
        .await
    }

    async fn record_outcome(
        &self,
        report: &OutcomeReport,
        now: Millis,
    ) -> Result<OutcomeResult, LedgerError> {
        let report = report.clone();
        self.write_by(None, Durability::Soon, move |tx: &GroupTx<'_>| {
            apply_report(tx, &report, now)
        })
        .await
    }

    async fn record_outcomes(
        &self,
        reports: &[OutcomeReport],
        now: Millis,
    ) -> Result<Vec<OutcomeResult>, LedgerError> {
        let reports = reports.to_vec();
        self.write_by(None, Durability::Soon, move |tx: &GroupTx<'_>| {
            let mut out = Vec::with_capacity(reports.len());
            for report in &reports {
                out.push(apply_report(tx, report, now)?);
            }
            Ok(out)
        })
        .await
    }

    async fn resolve_attempt(
        &self,
        id: &str,
        input: &ResolveInput,
        now: Millis,
    ) -> Result<Attempt, ResolveError> {
        let input = input.clone();
        self.move_attempt(id, move |a| decide::resolve(a, &input, now))
            .await
    }

    async fn decide_approval(
        &self,
        id: &str,
        input: &ApprovalInput,
        now: Millis,
    ) -> Result<Attempt, ApprovalError> {
        let input = input.clone();
        self.move_attempt(id, move |a| {
            decide::decide_approval(a, &input, now).map_err(ApprovalError::from)
        })
        .await
    }

    async fn sweep(&self, now: Millis) -> Result<SweepReport, LedgerError> {
        self.write(move |tx: &GroupTx<'_>| {
            let mut report = SweepReport::default();
            for a in query_attempts(tx, &expired_leases_sql(), &[&now])? {
                if let Some(next) = decide::expire_lease(&a, now) {
                    write_attempt(tx, Some(&a), &next)?;
                    report.count_expiry(&next);
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
            let candidates: Vec<(Attempt, i64)> = {
                let mut stmt = tx.prepare_cached(&prunable_receipts_sql())?;
                let before = now.saturating_sub(shortest.max(0));
                let rows = stmt.query_map(params![now, before], |r| {
                    Ok((
                        AttemptRow::from_sqlite(r)?,
                        r.get::<_, i64>("retention_ms")?,
                    ))
                })?;
                let mut out = Vec::new();
                for r in rows {
                    let (a, retention) = r?;
                    out.push((Attempt::try_from(a)?, retention));
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

    /// One writer operation per batch, so decisions are taken between batches.
    async fn purge(&self, ended_before: Millis, limit: u64) -> Result<PurgeReport, LedgerError> {
        let mut report = PurgeReport::default();
        while let Some(batch) = next_batch(limit, report.attempts_purged) {
            let r = self
                .write(move |tx: &GroupTx<'_>| purge::purge_batch(tx, ended_before, batch))
                .await?;
            if r == PurgeReport::default() {
                break;
            }
            report.absorb(r);
        }
        Ok(report)
    }

    async fn ensure_signing_key(&self, now: Millis) -> Result<SigningKey, LedgerError> {
        let (candidate, row) = SigningKey::generate(now)?;
        let active = self
            .write(move |tx: &GroupTx<'_>| keys::ensure_key(tx, row))
            .await?;
        if active.kid == candidate.kid() {
            return Ok(candidate);
        }
        SigningKey::from_stored(&active)
    }

    async fn put_credential(&self, c: &StoredCredential) -> Result<StoredCredential, LedgerError> {
        let c = c.clone();
        self.write(move |tx: &GroupTx<'_>| credentials::put_credential(tx, &c))
            .await
    }

    async fn rotate_signing_key(&self, now: Millis) -> Result<Rotation, LedgerError> {
        let (active, row) = SigningKey::generate(now)?;
        let retired = self
            .write(move |tx: &GroupTx<'_>| keys::rotate_key(tx, &row, now))
            .await?;
        Ok(Rotation { active, retired })
    }

    async fn open_inbox_session(
        &self,
        id_hash: &str,
        now: Millis,
        expires_at: Millis,
    ) -> Result<(), LedgerError> {
        let id_hash = id_hash.to_string();
        self.write(move |tx: &GroupTx<'_>| {
            tx.prepare_cached("DELETE FROM inbox_sessions WHERE expires_at <= ?1")?
                .execute(params![now])?;
            tx.prepare_cached(
                "INSERT OR REPLACE INTO inbox_sessions (id_hash, created_at, expires_at) VALUES (?1, ?2, ?3)",
            )?
            .execute(params![id_hash, now, expires_at])?;
            Ok::<_, LedgerError>(())
        })
        .await
    }

    async fn inbox_session_open(&self, id_hash: &str, now: Millis) -> Result<bool, LedgerError> {
        let id_hash = id_hash.to_string();
        self.write(move |tx: &GroupTx<'_>| {
            let n: i64 = tx
                .prepare_cached(
                    "SELECT COUNT(*) FROM inbox_sessions WHERE id_hash = ?1 AND expires_at > ?2",
                )?
                .query_row(params![id_hash, now], |r| r.get(0))?;
            Ok::<_, LedgerError>(n > 0)
        })
        .await
    }

    async fn end_inbox_session(&self, id_hash: &str) -> Result<bool, LedgerError> {
        let id_hash = id_hash.to_string();
        self.write(move |tx: &GroupTx<'_>| {
            let n = tx
                .prepare_cached("DELETE FROM inbox_sessions WHERE id_hash = ?1")?
                .execute(params![id_hash])?;
            Ok::<_, LedgerError>(n > 0)
        })
        .await
    }

    async fn end_all_inbox_sessions(&self, now: Millis) -> Result<u64, LedgerError> {
        self.write(move |tx: &GroupTx<'_>| {
            let open: i64 = tx
                .prepare_cached("SELECT COUNT(*) FROM inbox_sessions WHERE expires_at > ?1")?
                .query_row(params![now], |r| r.get(0))?;
            tx.prepare_cached("DELETE FROM inbox_sessions")?
                .execute([])?;
            Ok::<_, LedgerError>(u64::try_from(open).unwrap_or(0))
        })
        .await
    }
}

/// How the shared reads are spelled here: `?n`, and one row of counts per state.
pub(super) const DIALECT: Dialect = Dialect {
    param: placeholder,
    nullable_text: placeholder,
    state_counts: "attempt_state_counts",
};

fn placeholder(n: u8) -> String {
    format!("?{n}")
}

/// The shared reads run on the read connection (WAL lets it read beside the writer), in one
/// transaction when a read has several statements.
#[async_trait]
impl ReadQueries for SqliteStore {
    fn dialect(&self) -> Dialect {
        DIALECT
    }

    async fn run(&self, statements: Vec<Statement>) -> Result<Vec<Rows>, LedgerError> {
        self.read(move |c| {
            if let [one] = statements.as_slice() {
                return Ok(vec![run_statement(c, one)?]);
            }
            let tx = c.transaction()?;
            statements.iter().map(|s| run_statement(&tx, s)).collect()
        })
        .await
    }
}

#[cfg(test)]
mod tests;
