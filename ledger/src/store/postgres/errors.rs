//! The PostgreSQL boundary: driver and pool errors as the ledger's, an outage told apart
//! from a bug.

use crate::error::LedgerError;

/// SQLSTATE classes and codes of a database that cannot serve now but may soon: connection
/// exceptions (08), insufficient resources (53: disk full, out of memory, too many
/// connections), operator intervention (57: shutdown, restart, statement timeout), system
/// errors (58), a read-only transaction (25006: a standby or a failover in progress), a lock
/// timeout (55P03), and a serialization failure or deadlock (40001, 40P01).
pub(super) fn transient_sqlstate(code: &str) -> bool {
    matches!(code.get(..2), Some("08" | "53" | "57" | "58"))
        || matches!(code, "25006" | "55P03" | "40001" | "40P01")
}

/// A driver error as the ledger's: an outage is [`LedgerError::Unavailable`]; an error the
/// database raised for any other reason (a constraint, a missing table, bad SQL) is a bug.
pub(super) fn pg_err(e: tokio_postgres::Error) -> LedgerError {
    match e.as_db_error() {
        Some(db) => {
            let code = db.code().code();
            let message = format!("postgres: {} ({code})", db.message());
            if transient_sqlstate(code) {
                LedgerError::Unavailable(message)
            } else {
                LedgerError::Invariant(message)
            }
        }
        // Without a server error: the connection failed, closed or timed out.
        None => LedgerError::Unavailable(format!("postgres: {e}")),
    }
}

/// A column that cannot be read as the type the ledger wrote there.
pub(super) fn column_err(e: tokio_postgres::Error) -> LedgerError {
    LedgerError::Corrupt(format!("postgres: {e}"))
}

pub(super) fn pool_err(e: deadpool_postgres::PoolError) -> LedgerError {
    match e {
        deadpool_postgres::PoolError::Backend(e) => pg_err(e),
        // Timed out waiting for a connection, or the pool is closed: an outage.
        other => LedgerError::Unavailable(format!("postgres pool: {other}")),
    }
}
