//! The credentials' write: a new version in the writer's group transaction, which
//! `BEGIN IMMEDIATE` serializes with every other process on the file.

use rusqlite::{params, Connection};

use crate::credentials::{routes_column, StoredCredential};
use crate::error::LedgerError;

/// Stores `c` as the next version of its name; answers it with that version.
pub(super) fn put_credential(
    conn: &Connection,
    c: &StoredCredential,
) -> Result<StoredCredential, LedgerError> {
    let sealed = c.sealed.as_deref().ok_or_else(|| {
        LedgerError::Invariant("a credential stored without its sealed secret".into())
    })?;
    let newest: i64 = conn
        .prepare_cached("SELECT COALESCE(MAX(version), 0) FROM credentials WHERE name = ?1")?
        .query_row(params![c.name], |r| r.get(0))?;
    let version = u32::try_from(newest + 1).map_err(|_| {
        LedgerError::Invalid(format!("credential {:?} has too many versions", c.name))
    })?;
    conn.prepare_cached(
        "INSERT INTO credentials (name, version, header, form, route, sealed, created_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    )?
    .execute(params![
        c.name,
        version,
        c.header,
        c.form.as_str(),
        routes_column(&c.routes),
        sealed,
        c.created_at_ms
    ])?;
    Ok(StoredCredential {
        version,
        ..c.clone()
    })
}
