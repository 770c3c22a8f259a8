//! The writer thread: queued operations grouped into one `BEGIN IMMEDIATE` transaction each,
//! one savepoint per operation, answered once the group committed.

use std::cell::RefCell;

use rusqlite::Connection;

use super::writes::write_counters;
use crate::clock::Deadline;
use crate::error::LedgerError;
use crate::model::Attempt;
use crate::store::counters::CounterMoves;
use crate::store::snapshot::PendingMoves;

/// The group transaction one queued operation runs in: the connection (it derefs to it), the
/// counter moves of the group's earlier operations (written once, before the commit) and its
/// own. Counter reads add both to what is stored.
pub(super) struct GroupTx<'a> {
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
    /// Adds what this operation's write of an attempt moves to its own counter moves.
    pub(super) fn record_move(&self, old: Option<&Attempt>, new: &Attempt) {
        self.own.borrow_mut().record(old, new);
    }
}

/// The group's earlier operations' moves plus this one's, none written yet.
impl PendingMoves for GroupTx<'_> {
    fn slots(&self, permit_id: &str, tool: &str) -> i64 {
        self.earlier
            .slots(permit_id, tool)
            .saturating_add(self.own.borrow().slots(permit_id, tool))
    }

    fn budget(&self, permit_id: &str) -> (i64, i64) {
        let (a, b) = (
            self.earlier.budget(permit_id),
            self.own.borrow().budget(permit_id),
        );
        (a.0.saturating_add(b.0), a.1.saturating_add(b.1))
    }
}

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
}

pub(super) struct Pending<R, E, F> {
    pub(super) work: Option<F>,
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
}

/// The writer thread: owns the connection; each round takes up to [`MAX_GROUP`] queued
/// operations into one `BEGIN IMMEDIATE` transaction, one savepoint each, commits once
/// (`synchronous=FULL`: durable when COMMIT returns) and only then answers them all. Ops run
/// one after another, so check + reserve stays atomic; `BEGIN IMMEDIATE` keeps it so across
/// processes sharing the file.
pub(super) fn writer(conn: Connection, queue: std::sync::mpsc::Receiver<Box<dyn Op>>) {
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
pub(super) fn exec_cached(conn: &Connection, sql: &str) -> rusqlite::Result<usize> {
    conn.prepare_cached(sql)?.execute([])
}

pub(super) fn fail_all(conn: &Connection, group: Vec<Box<dyn Op>>, error: LedgerError) {
    if !conn.is_autocommit() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    for op in group {
        op.finish(Err(error.clone()));
    }
}

pub(super) fn run_group(conn: &Connection, mut group: Vec<Box<dyn Op>>) {
    if let Err(e) = exec_cached(conn, "BEGIN IMMEDIATE") {
        return fail_all(conn, group, LedgerError::from(e));
    }
    let mut moves = CounterMoves::default();
    for op in group.iter_mut() {
        if let Err(e) = exec_cached(conn, "SAVEPOINT op") {
            return fail_all(conn, group, LedgerError::from(e));
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
                LedgerError::Unavailable("the store rolled the transaction back".to_string()),
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
            for op in group {
                op.finish(Ok(()));
            }
        }
        Err(e) => fail_all(conn, group, LedgerError::from(e)),
    }
}
