//! The credentials' write: a new version in a transaction of its own under an advisory lock,
//! so two registrations of one name on two replicas take turns and get two versions (the
//! primary key holds even without the lock).

use deadpool_postgres::GenericClient;

use super::rows::{exec, query};
use crate::credentials::{routes_column, StoredCredential};
use crate::error::LedgerError;

/// Key of the advisory lock that serializes the credential writes of every replica.
const CREDENTIALS_LOCK: i64 = 0x6174_6d6f_7374_0003;

/// Stores `c` as the next version of its name (under the lock, which the caller's
/// transaction holds until it ends); answers it with that version.
pub(super) async fn put_credential<C: GenericClient>(
    c: &C,
    cred: &StoredCredential,
) -> Result<StoredCredential, LedgerError> {
    let sealed = cred.sealed.as_deref().ok_or_else(|| {
        LedgerError::Invariant("a credential stored without its sealed secret".into())
    })?;
    query(c, "SELECT pg_advisory_xact_lock($1)", &[&CREDENTIALS_LOCK]).await?;
    let rows = query(
        c,
        "SELECT COALESCE(MAX(version), 0) FROM credentials WHERE name = $1",
        &[&cred.name],
    )
    .await?;
    let newest: i64 = rows
        .first()
        .map(|r| r.try_get(0))
        .transpose()
        .map_err(super::column_err)?
        .unwrap_or(0);
    let version = u32::try_from(newest + 1).map_err(|_| {
        LedgerError::Invalid(format!("credential {:?} has too many versions", cred.name))
    })?;
    exec(
        c,
        "INSERT INTO credentials (name, version, header, form, route, sealed, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
        &[
            &cred.name,
            &i64::from(version),
            &cred.header,
            &cred.form.as_str(),
            &routes_column(&cred.routes),
            &sealed,
            &cred.created_at_ms,
        ],
    )
    .await?;
    Ok(StoredCredential {
        version,
        ..cred.clone()
    })
}
