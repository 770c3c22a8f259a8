//! Typed errors of the ledger.
//!
//! A store error says which kind of failure it is, because the answer differs: an outage is
//! transient (the caller is told to come back, and nothing is dispatched meanwhile), a broken
//! invariant is a bug to fix. Each store maps its driver's errors at its own boundary, so this
//! type names no driver.

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LedgerError {
    /// The store cannot answer or commit now: unreachable, connection lost, timed out, busy or
    /// locked, read-only, disk full, pool exhausted, restarting. Transient.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The caller's deadline passed before the decision could be committed: nothing was
    /// committed, and the caller (which no longer waits) is answered as for an outage.
    #[error("deadline passed: {0}")]
    DeadlinePassed(String),
    /// A store task ended without an answer (its worker or thread is gone).
    #[error("store task failed: {0}")]
    Join(String),
    #[error("random source failed: {0}")]
    Random(String),
    /// A stored row cannot be read back as what was written.
    #[error("stored data is corrupt: {0}")]
    Corrupt(String),
    /// A state the ledger's own rules never produce, or a statement that should not fail: a bug.
    #[error("broken invariant: {0}")]
    Invariant(String),
    #[error("{0}")]
    Invalid(String),
    /// The database's schema needs a newer ledger than this one (a migration that is not
    /// additive was applied by a newer release): refused at start, never transient.
    #[error(
        "schema too new: the database is at schema version {database} and needs a ledger that \
         knows at least {required}; this ledger knows up to {known} (upgrade this replica, or \
         see docs/postgresql.md, \"Upgrades\")"
    )]
    SchemaTooNew {
        database: i64,
        required: i64,
        known: i64,
    },
}

impl LedgerError {
    /// True when the same operation may succeed later without anything being fixed (HTTP 503
    /// `store_unavailable`); false for a bug or bad data (HTTP 500 `internal`).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            LedgerError::Unavailable(_) | LedgerError::Join(_) | LedgerError::DeadlinePassed(_)
        )
    }
}

impl LedgerError {
    /// The error of an operation whose caller's `deadline` passed before `what`.
    pub fn deadline_passed(what: &str, deadline: crate::clock::Deadline) -> Self {
        let late = std::time::Instant::now().saturating_duration_since(deadline.instant());
        LedgerError::DeadlinePassed(format!(
            "the caller's deadline passed {} ms before {what}; nothing was committed",
            late.as_millis()
        ))
    }
}

impl From<serde_json::Error> for LedgerError {
    fn from(e: serde_json::Error) -> Self {
        LedgerError::Corrupt(e.to_string())
    }
}

/// Why an admin resolution was refused.
#[derive(Debug, Error)]
pub enum ResolveError {
    #[error("no attempt has that id")]
    UnknownAttempt,
    #[error("attempt is {0}, only uncertain attempts can be resolved")]
    NotUncertain(crate::model::AttemptState),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}

/// Why a person's decision on a waiting call was refused by the decision itself
/// ([`crate::decide::decide_approval`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum ApprovalRefused {
    #[error("attempt is {0}; only an awaiting_approval attempt can be decided")]
    NotAwaiting(crate::model::AttemptState),
    #[error("the request lapsed before the decision; the sweeper expires it")]
    Lapsed,
}

/// Why a person's decision on an approval was refused.
#[derive(Debug, Error)]
pub enum ApprovalError {
    #[error("no attempt has that id")]
    UnknownAttempt,
    #[error(transparent)]
    Refused(#[from] ApprovalRefused),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}

/// The error of a person's move of one attempt (a resolution, a decision on an approval): the
/// attempt may be unknown, the pure step may refuse, the store may fail. Both stores apply
/// such a move the same way, generic over it.
pub trait AttemptMoveError: From<LedgerError> + Send + 'static {
    /// No attempt has the id.
    fn unknown_attempt() -> Self;
}

impl AttemptMoveError for ResolveError {
    fn unknown_attempt() -> Self {
        ResolveError::UnknownAttempt
    }
}

impl AttemptMoveError for ApprovalError {
    fn unknown_attempt() -> Self {
        ApprovalError::UnknownAttempt
    }
}
