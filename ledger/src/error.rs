//! Typed errors of the ledger.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum LedgerError {
    #[error("store error: {0}")]
    Store(String),
    #[error("store task failed: {0}")]
    Join(String),
    #[error("random source failed: {0}")]
    Random(String),
    #[error("stored data is corrupt: {0}")]
    Corrupt(String),
    #[error("{0}")]
    Invalid(String),
}

impl From<rusqlite::Error> for LedgerError {
    fn from(e: rusqlite::Error) -> Self {
        LedgerError::Store(e.to_string())
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
