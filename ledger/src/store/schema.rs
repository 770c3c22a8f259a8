//! The compatibility rule between ledger versions and schema versions, shared by both stores.
//!
//! Schema changes are expand/contract: a migration that only adds (a table, a nullable or
//! defaulted column, an index) leaves every older ledger able to serve on the database, so
//! replicas of two versions can share it during a rolling upgrade. A migration that removes
//! something or changes what stored data means would break an older ledger that still runs:
//! it declares so. Each migration records `compatible_from`, the oldest schema version a
//! ledger may know and still serve on a database that has it; a ledger checks the newest
//! such requirement before it serves (docs/postgresql.md, "Upgrades").

use crate::error::LedgerError;

/// The schema version this build writes: its newest migration, in both stores.
#[cfg(not(feature = "schema-rehearsal"))]
pub const SCHEMA_VERSION: i64 = 13;
/// The schema version this build writes: the rehearsal build adds version 14 (see
/// `schema-rehearsal` in ledger/Cargo.toml), never a released one.
#[cfg(feature = "schema-rehearsal")]
pub const SCHEMA_VERSION: i64 = 14;

/// What a ledger does on a database whose schema it found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchemaVerdict {
    /// The database is at or below this ledger's version (what it lacks is migrated).
    Known,
    /// A newer ledger migrated the database further, only additively: serve, with a warning.
    NewerCompatible { database: i64 },
}

/// Decides whether a ledger that knows schema versions up to `known` may serve on a database
/// whose newest applied migration is `database` and whose applied migrations require a ledger
/// of at least `required` (the largest `compatible_from` recorded; 0 when none is).
pub fn check_compatibility(
    known: i64,
    database: i64,
    required: i64,
) -> Result<SchemaVerdict, LedgerError> {
    if required > known {
        return Err(LedgerError::SchemaTooNew {
            database,
            required,
            known,
        });
    }
    if database > known {
        Ok(SchemaVerdict::NewerCompatible { database })
    } else {
        Ok(SchemaVerdict::Known)
    }
}

/// Logs what [`check_compatibility`] found, the same way for both stores.
pub fn log_verdict(verdict: SchemaVerdict, known: i64) {
    if let SchemaVerdict::NewerCompatible { database } = verdict {
        tracing::warn!(
            database_version = database,
            known,
            "the database has a newer schema than this ledger knows (a newer replica migrated it, \
             additively): serving"
        );
    }
}

/// What both stores' tests expect once a database is two versions ahead of this ledger and
/// its newest migration requires the version before it.
#[cfg(all(test, any(feature = "sqlite", feature = "postgres-tests")))]
pub(crate) fn two_versions_ahead_refusal() -> LedgerError {
    LedgerError::SchemaTooNew {
        database: SCHEMA_VERSION + 2,
        required: SCHEMA_VERSION + 1,
        known: SCHEMA_VERSION,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_database_at_or_below_the_ledger_is_served() {
        assert_eq!(check_compatibility(5, 5, 4), Ok(SchemaVerdict::Known));
        assert_eq!(check_compatibility(5, 3, 3), Ok(SchemaVerdict::Known));
        assert_eq!(check_compatibility(5, 0, 0), Ok(SchemaVerdict::Known));
    }

    #[test]
    fn an_additive_newer_schema_is_served_with_a_warning() {
        assert_eq!(
            check_compatibility(5, 6, 5),
            Ok(SchemaVerdict::NewerCompatible { database: 6 })
        );
        // Several additive versions ahead: still served.
        assert_eq!(
            check_compatibility(5, 8, 4),
            Ok(SchemaVerdict::NewerCompatible { database: 8 })
        );
    }

    #[test]
    fn a_schema_that_needs_a_newer_ledger_is_refused_naming_both_versions() {
        let refused = check_compatibility(5, 7, 6);
        assert_eq!(
            refused,
            Err(LedgerError::SchemaTooNew {
                database: 7,
                required: 6,
                known: 5
            })
        );
        let message = refused.map(|_| ()).unwrap_err().to_string();
        assert!(message.contains("schema version 7"), "{message}");
        assert!(message.contains("at least 6"), "{message}");
        assert!(message.contains("knows up to 5"), "{message}");
    }
}
