//! The signing keys' writes. Each runs in its own transaction under an advisory lock, so
//! replicas that start or rotate together take turns: the second to make sure of a key finds
//! the first one's, and two rotations retire one key after the other. The partial unique
//! index on the active key holds even without the lock.

use deadpool_postgres::GenericClient;

use super::rows::{exec, query, read_signing_key};
use crate::clock::Millis;
use crate::error::LedgerError;
use crate::keys::{PublicSigningKey, StoredSigningKey};
use crate::store::rows::SIGNING_KEY_COLS;

/// Key of the advisory lock that serializes the key writes of every replica (the migrations
/// take [`super::migrations::MIGRATION_LOCK`]).
const KEYS_LOCK: i64 = 0x6174_6d6f_7374_0002;

/// Takes the key lock until the transaction ends.
pub(super) async fn lock_keys<C: GenericClient>(c: &C) -> Result<(), LedgerError> {
    query(c, "SELECT pg_advisory_xact_lock($1)", &[&KEYS_LOCK]).await?;
    Ok(())
}

/// The active key's row, its private half included.
async fn active_key<C: GenericClient>(c: &C) -> Result<Option<StoredSigningKey>, LedgerError> {
    let sql = format!("SELECT {SIGNING_KEY_COLS} FROM signing_keys WHERE retired_at IS NULL");
    query(c, &sql, &[])
        .await?
        .first()
        .map(read_signing_key)
        .transpose()
}

async fn insert_key<C: GenericClient>(c: &C, row: &StoredSigningKey) -> Result<(), LedgerError> {
    let private = row.private_pkcs8.as_ref().ok_or_else(|| {
        LedgerError::Invariant("a new signing key without its private half".into())
    })?;
    exec(
        c,
        "INSERT INTO signing_keys (kid, public_key, private_pkcs8, created_at, retired_at) \
         VALUES ($1, $2, $3, $4, $5)",
        &[
            &row.kid,
            &row.public_key,
            &private.expose(),
            &row.created_at_ms,
            &row.retired_at_ms,
        ],
    )
    .await?;
    Ok(())
}

/// The active key, or `candidate` stored as the active key when there is none (under the
/// key lock).
pub(super) async fn ensure_key<C: GenericClient>(
    c: &C,
    candidate: &StoredSigningKey,
) -> Result<StoredSigningKey, LedgerError> {
    if let Some(active) = active_key(c).await? {
        return Ok(active);
    }
    insert_key(c, candidate).await?;
    Ok(candidate.clone())
}

/// Retires the active key at `now` and stores `next` as the active one (under the key lock);
/// answers the retired key.
pub(super) async fn rotate_key<C: GenericClient>(
    c: &C,
    next: &StoredSigningKey,
    now: Millis,
) -> Result<Option<PublicSigningKey>, LedgerError> {
    let retired = active_key(c).await?.map(|old| PublicSigningKey {
        retired_at_ms: Some(now),
        ..old.public()
    });
    exec(
        c,
        "UPDATE signing_keys SET retired_at = $1 WHERE retired_at IS NULL",
        &[&now],
    )
    .await?;
    insert_key(c, next).await?;
    Ok(retired)
}
