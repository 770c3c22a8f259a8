//! The group transaction an operation of the writer runs in. It sits beneath both the writer
//! (which opens one per operation) and the writes (which add their counter moves to it), so
//! neither has to import the other for it.

use std::cell::RefCell;

use rusqlite::Connection;

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

impl<'a> GroupTx<'a> {
    /// The transaction of one operation, after the group's earlier ones moved `earlier`.
    pub(super) fn new(conn: &'a Connection, earlier: &'a CounterMoves) -> Self {
        GroupTx {
            conn,
            earlier,
            own: RefCell::default(),
        }
    }

    /// This operation's own counter moves, once it has run.
    pub(super) fn into_own(self) -> CounterMoves {
        self.own.into_inner()
    }

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
