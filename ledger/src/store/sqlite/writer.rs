//! The writer: queued operations grouped into one `BEGIN IMMEDIATE` transaction each, one
//! savepoint per operation, answered once the group committed. It is a task of the thread
//! that reads the requests (the ledger's decision loop), so a decision goes from socket to
//! commit without a hand-off to another thread (docs/design.md#the-ledgers-hot-path).

use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rusqlite::Connection;
use tokio::sync::mpsc::UnboundedReceiver;

use super::group_tx::GroupTx;
use super::writes::write_counters;
use crate::clock::Deadline;
use crate::error::LedgerError;
use crate::store::counters::CounterMoves;

/// Most operations one group transaction takes from the queue.
pub(super) const MAX_GROUP: usize = 256;

/// One queued write: run inside the group transaction, then answered with the commit's result.
pub(super) trait Op: Send {
    /// Runs the work; `true` if it succeeded (its savepoint is kept).
    fn run(&mut self, tx: &GroupTx<'_>) -> bool;
    /// Answers the caller once the group transaction is over.
    fn finish(self: Box<Self>, commit: Result<(), LedgerError>);
    /// The deadline of an operation whose writes are in the group: the group commits before
    /// it or not at all.
    fn commit_deadline(&self) -> Option<Deadline>;
    /// Whether its commit must be on disk before it is answered. Only outcome reports may
    /// not: lost in a crash, their attempt stays in flight until its lease makes it
    /// `uncertain`, which holds its slot (docs/design.md#the-ledgers-hot-path).
    fn durable(&self) -> bool;
}

/// When an operation's commit reaches the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Durability {
    /// Before it is answered (`synchronous=FULL`): every decision, every admin write.
    BeforeAnswer,
    /// With the next durable commit, or at most [`LAZY_SYNC_WITHIN`] later: outcome reports.
    Soon,
}

pub(super) struct Pending<R, E, F> {
    pub(super) work: Option<F>,
    pub(super) durability: Durability,
    /// When the caller stops waiting: an operation not yet run by then is not run.
    pub(super) deadline: Option<Deadline>,
    pub(super) result: Option<Result<R, E>>,
    pub(super) reply: tokio::sync::oneshot::Sender<Result<R, E>>,
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
        if let Some(deadline) = self.deadline.filter(Deadline::passed) {
            self.result = Some(Err(E::from(LedgerError::deadline_passed(
                "it was run",
                deadline,
            ))));
            return false;
        }
        let r = work(tx);
        let ok = r.is_ok();
        self.result = Some(r);
        ok
    }

    fn finish(self: Box<Self>, commit: Result<(), LedgerError>) {
        let answer = match (self.result, commit) {
            // A failed operation was rolled back to its savepoint: its own error stands.
            (Some(Err(e)), _) => Err(e),
            (Some(Ok(r)), Ok(())) => Ok(r),
            (Some(Ok(_)), Err(e)) | (None, Err(e)) => Err(E::from(e)),
            (None, Ok(())) => Err(E::from(LedgerError::Invariant(
                "the operation was not run".into(),
            ))),
        };
        // The caller may have gone away (request cancelled): nothing to answer then.
        let _ = self.reply.send(answer);
    }

    fn commit_deadline(&self) -> Option<Deadline> {
        self.deadline.filter(|_| matches!(self.result, Some(Ok(_))))
    }

    fn durable(&self) -> bool {
        self.durability == Durability::BeforeAnswer
    }
}

/// The longest a commit answered before it was durable waits for its `fdatasync`: the next
/// durable commit covers it (the WAL is written in order), and without one the writer syncs
/// the WAL file itself this long after.
pub(super) const LAZY_SYNC_WITHIN: Duration = Duration::from_millis(100);

/// The writer: owns the connection; each turn takes every queued operation (up to
/// [`MAX_GROUP`]) into one `BEGIN IMMEDIATE` transaction, one savepoint each, commits once and
/// only then answers them all. A group with a decision or an admin write in it commits with
/// `synchronous=FULL` (durable when COMMIT returns); a group of outcome reports only, with
/// `synchronous=NORMAL` (written, its `fdatasync` left to the next durable commit or to
/// [`LAZY_SYNC_WITHIN`]). Ops run one after another, so check + reserve stays atomic; `BEGIN
/// IMMEDIATE` keeps it so across processes sharing the file. `wal` is the WAL file, opened to
/// sync it.
pub(super) async fn writer(
    conn: Connection,
    wal: Option<File>,
    mut queue: UnboundedReceiver<Box<dyn Op>>,
    counts: Arc<CommitCounters>,
) {
    let mut unsynced = None;
    loop {
        let first = match unsynced {
            None => queue.recv().await,
            Some(since) => {
                match tokio::time::timeout_at(since + LAZY_SYNC_WITHIN, queue.recv()).await {
                    Ok(op) => op,
                    Err(_) => {
                        sync_wal(wal.as_ref());
                        counts.wal_syncs.fetch_add(1, Ordering::Relaxed);
                        unsynced = None;
                        continue;
                    }
                }
            }
        };
        let Some(first) = first else { break };
        // Every request this thread read in the same turn queues before the group starts:
        // the tasks the sockets' readiness woke are polled first, then this one again.
        tokio::task::yield_now().await;
        let mut group = Vec::with_capacity(16);
        group.push(first);
        while group.len() < MAX_GROUP {
            match queue.try_recv() {
                Ok(op) => group.push(op),
                Err(_) => break,
            }
        }
        let durable = group.iter().any(|op| op.durable());
        match run_group(&conn, group, durable, &counts) {
            Committed::Durably => unsynced = None,
            Committed::Lazily => {
                unsynced.get_or_insert_with(tokio::time::Instant::now);
            }
            // A commit that wrote nothing (a readiness check) synced nothing either.
            Committed::Unwritten | Committed::Not => {}
        }
    }
    sync_wal(wal.as_ref());
}

/// Group commits so far, by how they reached the disk, and the writer's own syncs of the WAL.
#[derive(Debug, Default)]
pub(super) struct CommitCounters {
    pub(super) durable: AtomicU64,
    pub(super) lazy: AtomicU64,
    pub(super) wal_syncs: AtomicU64,
}

/// A reading of [`CommitCounters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommitCounts {
    /// Groups committed with `synchronous=FULL`: on disk before their answers.
    pub durable: u64,
    /// Groups of outcome reports committed with `synchronous=NORMAL`.
    pub lazy: u64,
    /// Syncs of the WAL the writer made itself, no durable commit having come within
    /// [`LAZY_SYNC_WITHIN`] of a lazy one.
    pub wal_syncs: u64,
}

impl CommitCounters {
    pub(super) fn read(&self) -> CommitCounts {
        CommitCounts {
            durable: self.durable.load(Ordering::Relaxed),
            lazy: self.lazy.load(Ordering::Relaxed),
            wal_syncs: self.wal_syncs.load(Ordering::Relaxed),
        }
    }
}

/// Makes what the WAL holds durable. A failure is left to the next durable commit, whose own
/// `fdatasync` reports it to the decision that waits for it.
fn sync_wal(wal: Option<&File>) {
    if let Some(file) = wal {
        if let Err(e) = file.sync_data() {
            tracing::warn!(error = %e, "could not sync the sqlite WAL; the next durable commit will");
        }
    }
}

/// How a group ended.
pub(super) enum Committed {
    /// On disk before the answers went out, with every commit before it.
    Durably,
    /// Written, its sync still to come.
    Lazily,
    /// Committed without a row written: nothing reached the WAL, nothing was synced.
    Unwritten,
    /// Rolled back; every operation was answered with the error.
    Not,
}

/// Runs one statement without parameters through the statement cache (these run per operation).
pub(super) fn exec_cached(conn: &Connection, sql: &str) -> rusqlite::Result<usize> {
    conn.prepare_cached(sql)?.execute([])
}

pub(super) fn fail_all(
    conn: &Connection,
    group: Vec<Box<dyn Op>>,
    error: LedgerError,
) -> Committed {
    if !conn.is_autocommit() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    for op in group {
        op.finish(Err(error.clone()));
    }
    Committed::Not
}

/// Runs `group` in one transaction, committed durably or not (see [`writer`]), counted in
/// `counts` before any of its operations is answered.
pub(super) fn run_group(
    conn: &Connection,
    mut group: Vec<Box<dyn Op>>,
    durable: bool,
    counts: &CommitCounters,
) -> Committed {
    // Outside a transaction, as SQLite requires; the group's commit syncs or not by it.
    let sync = if durable {
        "PRAGMA synchronous = FULL"
    } else {
        "PRAGMA synchronous = NORMAL"
    };
    if let Err(e) = exec_cached(conn, sync) {
        return fail_all(conn, group, LedgerError::from(e));
    }
    if let Err(e) = exec_cached(conn, "BEGIN IMMEDIATE") {
        return fail_all(conn, group, LedgerError::from(e));
    }
    // An operation alone needs no savepoint: where it fails, the transaction is rolled back
    // whole, which is what rolling back to its savepoint would leave.
    let alone = group.len() == 1;
    let changes_before = conn.total_changes();
    let mut moves = CounterMoves::default();
    for op in group.iter_mut() {
        if !alone {
            if let Err(e) = exec_cached(conn, "SAVEPOINT op") {
                return fail_all(conn, group, LedgerError::from(e));
            }
        }
        let tx = GroupTx::new(conn, &moves);
        let ok = op.run(&tx);
        let own = tx.into_own();
        if conn.is_autocommit() {
            // SQLite rolled the whole transaction back (disk full, I/O error): nothing of
            // this group is durable.
            return fail_all(
                conn,
                group,
                LedgerError::Unavailable("the store rolled the transaction back".to_string()),
            );
        }
        if alone && !ok {
            // Its own error stands (Op::finish), nothing of it is kept.
            if let Err(e) = exec_cached(conn, "ROLLBACK") {
                return fail_all(conn, group, LedgerError::from(e));
            }
            for op in group {
                op.finish(Ok(()));
            }
            return Committed::Not;
        }
        if ok {
            // A failed operation's moves were rolled back with its savepoint.
            moves.absorb(own);
        }
        let end = match (alone, ok) {
            (true, _) => Ok(0),
            (false, true) => exec_cached(conn, "RELEASE op"),
            (false, false) => {
                exec_cached(conn, "ROLLBACK TO op").and_then(|_| exec_cached(conn, "RELEASE op"))
            }
        };
        if let Err(e) = end {
            return fail_all(conn, group, LedgerError::from(e));
        }
    }
    // The group's deadline is its oldest member's: a commit after it would reserve for a
    // caller already told that nothing was.
    if let Some(deadline) = group.iter().filter_map(|op| op.commit_deadline()).min() {
        if deadline.passed() {
            return fail_all(
                conn,
                group,
                LedgerError::deadline_passed("the commit", deadline),
            );
        }
    }
    if let Err(e) = write_counters(conn, &moves) {
        return fail_all(conn, group, e);
    }
    match exec_cached(conn, "COMMIT") {
        Ok(_) => {
            let committed = match (conn.total_changes() == changes_before, durable) {
                (true, _) => Committed::Unwritten,
                (false, true) => {
                    counts.durable.fetch_add(1, Ordering::Relaxed);
                    Committed::Durably
                }
                (false, false) => {
                    counts.lazy.fetch_add(1, Ordering::Relaxed);
                    Committed::Lazily
                }
            };
            for op in group {
                op.finish(Ok(()));
            }
            committed
        }
        Err(e) => fail_all(conn, group, LedgerError::from(e)),
    }
}
