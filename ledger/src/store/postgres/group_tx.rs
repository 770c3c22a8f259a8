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
//! `BEGIN` also sets `plan_cache_mode = force_generic_plan` for the transaction: the group's
//! statements are prepared once per connection and each plan is an index probe per array
//! element whatever the parameters (see `docs/postgresql.md`), so planning them again at
//! every execution (the default's custom plans) is CPU spent for nothing. Only the group
//! statements run under it; the sweeper and the admin queries keep the server's default.

use std::future::Future;
use std::task::{Context, Poll, Waker};

use deadpool_postgres::{Client, GenericClient, Object, Pool};

use super::{pg_err, pool_err};
use crate::error::LedgerError;

/// The first message of a group's first flight.
const BEGIN: &str = "BEGIN; SET LOCAL plan_cache_mode = force_generic_plan";

/// A pooled connection with a group transaction on it. A group that did not commit (an
/// error, or its deadline dropped it mid-flight) queues `ROLLBACK` on its connection when
/// dropped, without waiting for the answer, and the connection goes back to the pool: the
/// next user's statements run after the rollback, as with a dropped tokio-postgres
/// `Transaction`.
pub(super) struct GroupTx {
    conn: Option<Object>,
    committed: bool,
}

impl GroupTx {
    /// Takes a pooled connection; nothing is sent yet (`BEGIN` leaves with the first flight).
    pub(super) async fn start(pool: &Pool) -> Result<Self, LedgerError> {
        let conn = pool.get().await.map_err(pool_err)?;
        Ok(GroupTx {
            conn: Some(conn),
            committed: false,
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

    /// `COMMIT`: poll it last among the second flight's statements, and call
    /// [`GroupTx::committed`] only when it and every statement before it succeeded.
    pub(super) async fn commit(&self) -> Result<(), LedgerError> {
        self.client()?.batch_execute("COMMIT").await.map_err(pg_err)
    }

    /// The group committed: the connection goes back to the pool.
    pub(super) fn committed(mut self) {
        self.committed = true;
    }
}

impl Drop for GroupTx {
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else {
            return;
        };
        if self.committed {
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
