//! The signing keys' writes: made sure of and rotated in the writer's group transaction,
//! which `BEGIN IMMEDIATE` serializes with every other process on the file.

use rusqlite::{params, Connection, OptionalExtension};

use super::rows::read_signing_key;
use crate::clock::Millis;
use crate::error::LedgerError;
use crate::keys::{PublicSigningKey, StoredSigningKey};
use crate::store::rows::SIGNING_KEY_COLS;

/// The active key's row, its private half included.
pub(super) fn active_key(conn: &Connection) -> Result<Option<StoredSigningKey>, LedgerError> {
    let sql = format!("SELECT {SIGNING_KEY_COLS} FROM signing_keys WHERE retired_at IS NULL");
    Ok(conn
        .prepare_cached(&sql)?
        .query_row([], read_signing_key)
        .optional()?)
}

pub(super) fn insert_key(conn: &Connection, row: &StoredSigningKey) -> Result<(), LedgerError> {
    let private = row.private_pkcs8.as_ref().ok_or_else(|| {
        LedgerError::Invariant("a new signing key without its private half".into())
    })?;
    conn.prepare_cached(
        "INSERT INTO signing_keys (kid, public_key, private_pkcs8, created_at, retired_at) \
         VALUES (?1, ?2, ?3, ?4, ?5)",
    )?
    .execute(params![
        row.kid,
        row.public_key,
        private.expose(),
        row.created_at_ms,
        row.retired_at_ms
    ])?;
    Ok(())
}

/// The active key, or `candidate` stored as the active key when there is none.
pub(super) fn ensure_key(
    conn: &Connection,
    candidate: StoredSigningKey,
) -> Result<StoredSigningKey, LedgerError> {
    if let Some(active) = active_key(conn)? {
        return Ok(active);
    }
    insert_key(conn, &candidate)?;
    Ok(candidate)
}

/// Retires the active key at `now` and stores `next` as the active one; answers the retired
/// key.
pub(super) fn rotate_key(
    conn: &Connection,
    next: &StoredSigningKey,
    now: Millis,
) -> Result<Option<PublicSigningKey>, LedgerError> {
    let retired = active_key(conn)?.map(|old| PublicSigningKey {
        retired_at_ms: Some(now),
        ..old.public()
    });
    conn.prepare_cached("UPDATE signing_keys SET retired_at = ?1 WHERE retired_at IS NULL")?
        .execute(params![now])?;
    insert_key(conn, next)?;
    Ok(retired)
}
