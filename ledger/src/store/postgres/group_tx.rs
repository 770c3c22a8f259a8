//! The group transaction of the decision and outcome workers, in two round trips.
//!
//! tokio-postgres sends a request as soon as its future is first polled and matches the
//! answers in order, so statements whose futures are polled together share one flight. A group
//! sends `BEGIN`, its row locks and every read in the first flight (the server runs them in
//! that order, so the reads run after the locks are held, each with a fresh READ COMMITTED
//! snapshot), decides in memory, and sends its writes and `COMMIT` in the second. `COMMIT`
//! after a failed statement rolls back instead (PostgreSQL answers it with `ROLLBACK`, not an
//! error), so the group checks every write's result as well as the commit's: it is answered
//! as committed only when all of them succeeded.
//!
//! A decision group's `COMMIT` carries its deadline (see [`GroupTx::commit`]): the server
//! refuses it once the deadline passed, wherever the message was delayed, so no decision
//! commits after its caller gave up. A group cut off by its time limit may still have
//! statements (its `COMMIT` even) on their way to the server: its connection is closed, never
//! handed to the next user, whose statements would queue behind them (see [`within`]).
//!
//! `BEGIN` also sets `plan_cache_mode = force_generic_plan` for the transaction: the group's
//! statements are prepared once per connection and each plan is an index probe per array
//! element whatever the parameters (see `docs/postgresql.md`), so planning them again at
//! every execution (the default's custom plans) is CPU spent for nothing. Only the group
//! statements run under it; the sweeper and the admin queries keep the server's default.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use deadpool_postgres::{Client, GenericClient, Object, Pool};

use super::{pg_err, pool_err};
use crate::error::LedgerError;

/// What the deadline guard raises (as text the server cannot read as an integer: SQLSTATE
/// 22P02) when a `COMMIT` reaches the server too late.
const DEADLINE_GUARD: &str = "atmost: the deadline passed before COMMIT";

/// Runs `work` in a group transaction on a pooled connection, all of it within `limit`;
/// `None` when the time ran out first. A group cut off mid-flight may have statements (its
/// `COMMIT` even) still on their way to the server: its connection is closed, not returned
/// to the pool.
pub(super) async fn within<T>(
    pool: &Pool,
    limit: Duration,
    work: impl AsyncFnOnce(&GroupTx) -> Result<T, LedgerError>,
) -> Option<Result<T, LedgerError>> {
    let started = Instant::now();
    let tx = match tokio::time::timeout(limit, GroupTx::start(pool)).await {
        Ok(Ok(tx)) => tx,
        Ok(Err(e)) => return Some(Err(e)),
        Err(_) => return None,
    };
    match tokio::time::timeout(limit.saturating_sub(started.elapsed()), work(&tx)).await {
        Ok(r) => Some(r),
        Err(_) => {
            tx.abandon();
            None
        }
    }
}

/// The first message of a group's first flight.
const BEGIN: &str = "BEGIN; SET LOCAL plan_cache_mode = force_generic_plan";
/// [`BEGIN`] for a group of outcome reports: its commit is acknowledged before the server
/// flushed it (docs/design.md#the-ledgers-hot-path). Lost in a crash, a report's attempt stays
/// in flight until its lease makes it `uncertain`, which holds its slot; decisions commit
/// durably, and a later durable commit flushes the WAL up to it.
const BEGIN_OUTCOMES: &str =
    "BEGIN; SET LOCAL plan_cache_mode = force_generic_plan; SET LOCAL synchronous_commit = off";

/// A pooled connection with a group transaction on it. A group that did not commit (an
/// error, or its deadline dropped it mid-flight) queues `ROLLBACK` on its connection when
/// dropped, without waiting for the answer, and the connection goes back to the pool: the
/// next user's statements run after the rollback, as with a dropped tokio-postgres
/// `Transaction`.
pub(super) struct GroupTx {
    conn: Option<Object>,
    committed: AtomicBool,
}

impl GroupTx {
    /// Takes a pooled connection; nothing is sent yet (`BEGIN` leaves with the first flight).
    pub(super) async fn start(pool: &Pool) -> Result<Self, LedgerError> {
        let conn = pool.get().await.map_err(pool_err)?;
        Ok(GroupTx {
            conn: Some(conn),
            committed: AtomicBool::new(false),
        })
    }

    pub(super) fn client(&self) -> Result<&Client, LedgerError> {
        self.conn
            .as_ref()
            .ok_or_else(|| LedgerError::Invariant("the group's connection is gone".into()))
    }

    /// `BEGIN`: poll it first among the first flight's statements.
    pub(super) async fn begin(&self) -> Result<(), LedgerError> {
        self.client()?.batch_execute(BEGIN).await.map_err(pg_err)
    }

    /// `BEGIN` of a group of outcome reports, whose commit need not be flushed before it is
    /// acknowledged ([`BEGIN_OUTCOMES`]).
    pub(super) async fn begin_outcomes(&self) -> Result<(), LedgerError> {
        self.client()?
            .batch_execute(BEGIN_OUTCOMES)
            .await
            .map_err(pg_err)
    }

    /// `COMMIT`: poll it last among the second flight's statements, and call
    /// [`GroupTx::committed`] only when it and every statement before it succeeded.
    ///
    /// With a `budget`, the time left before the group's deadline as measured after the
    /// first flight's answers came back, the server commits only while less than `budget`
    /// has passed since the transaction began (`transaction_timestamp()`, when `BEGIN`
    /// reached it, which was before those answers left): so it commits before the deadline
    /// however long this message took to get there, measuring only durations on each clock.
    /// Guard and `COMMIT` are one message: nothing can come between them. A late one fails
    /// with [`LedgerError::DeadlinePassed`] and the transaction rolls back.
    pub(super) async fn commit(&self, budget: Option<Duration>) -> Result<(), LedgerError> {
        let Some(budget) = budget else {
            return self.client()?.batch_execute("COMMIT").await.map_err(pg_err);
        };
        // The condition reads the clock, so the cast of the CASE is evaluated at run time,
        // never folded at plan time.
        let sql = format!(
            "SELECT (CASE WHEN clock_timestamp() < transaction_timestamp() + interval '{} microseconds' \
             THEN '0' ELSE '{DEADLINE_GUARD}' END)::int; COMMIT",
            budget.as_micros()
        );
        self.client()?
            .batch_execute(&sql)
            .await
            .map_err(|e| match e.as_db_error() {
                Some(db) if db.message().contains(DEADLINE_GUARD) => LedgerError::DeadlinePassed(
                    "the COMMIT reached the database after the deadline; rolled back".into(),
                ),
                _ => pg_err(e),
            })
    }

    /// The group committed: the connection goes back to the pool.
    pub(super) fn committed(&self) {
        self.committed.store(true, Ordering::SeqCst);
    }

    /// Cut off mid-flight: the connection is closed (the server rolls the transaction back
    /// when it notices, or at `idle_in_transaction_session_timeout`).
    fn abandon(mut self) {
        if let Some(conn) = self.conn.take() {
            drop(Object::take(conn));
        }
    }
}

impl Drop for GroupTx {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        if self.committed.load(Ordering::SeqCst) {
            return;
        }
        // A request leaves at its future's first poll; the answer is not awaited (the
        // connection drops answers nobody waits for). A connection that cannot take the
        // request is broken and leaves the pool.
        let sent = {
            let rollback = std::pin::pin!(conn.batch_execute("ROLLBACK"));
            let mut cx = Context::from_waker(Waker::noop());
            !matches!(rollback.poll(&mut cx), Poll::Ready(Err(_)))
        };
        if !sent {
            drop(Object::take(conn));
        }
    }
}
