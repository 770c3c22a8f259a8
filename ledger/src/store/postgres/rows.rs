//! Rows: the permit and attempt columns as PostgreSQL returns them, the statements that read
//! and lock them for the decisions, and how the shared reads' statements are run.

use std::sync::LazyLock;

use deadpool_postgres::GenericClient;
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use super::column_err;
use super::pg_err;
use crate::credentials::StoredCredential;
use crate::error::LedgerError;
use crate::keys::{PrivateKeyText, StoredSigningKey};
use crate::model::{Attempt, Permit};
use crate::store::reads::{Param, RowShape, Rows, Statement};
use crate::store::rows::{AttemptRow, CredentialRow, PermitRow, ATTEMPT_COLS, PERMIT_COLS};

/// The columns of [`PERMIT_COLS`] as PostgreSQL returns them, read by name (a query may
/// select others after them).
pub(super) fn read_permit(row: &Row) -> Result<Permit, LedgerError> {
    Permit::try_from(PermitRow::from_postgres(row).map_err(column_err)?)
}

/// The permit with this id, if any.
pub(super) async fn load_permit<C: GenericClient>(
    c: &C,
    id: &str,
) -> Result<Option<Permit>, LedgerError> {
    let sql = format!("SELECT {PERMIT_COLS} FROM permits WHERE id = $1");
    query(c, &sql, &[&id])
        .await?
        .first()
        .map(read_permit)
        .transpose()
}

/// The columns of [`ATTEMPT_COLS`] as PostgreSQL returns them, read by name (a query may
/// select others after them).
pub(super) fn read_attempt(row: &Row) -> Result<Attempt, LedgerError> {
    Attempt::try_from(AttemptRow::from_postgres(row).map_err(column_err)?)
}

/// The columns of [`CREDENTIAL_COLS`](crate::store::rows::CREDENTIAL_COLS) as PostgreSQL
/// returns them.
fn read_credential(row: &Row) -> Result<StoredCredential, LedgerError> {
    let read = || -> Result<CredentialRow, tokio_postgres::Error> {
        Ok(CredentialRow {
            name: row.try_get(0)?,
            version: row.try_get(1)?,
            header: row.try_get(2)?,
            form: row.try_get(3)?,
            route: row.try_get(4)?,
            sealed: row.try_get(5)?,
            created_at: row.try_get(6)?,
        })
    };
    StoredCredential::try_from(read().map_err(column_err)?)
}

/// The columns of [`SIGNING_KEY_COLS`](crate::store::rows::SIGNING_KEY_COLS) as PostgreSQL
/// returns them.
pub(super) fn read_signing_key(row: &Row) -> Result<StoredSigningKey, LedgerError> {
    let read = || -> Result<StoredSigningKey, tokio_postgres::Error> {
        Ok(StoredSigningKey {
            kid: row.try_get(0)?,
            public_key: row.try_get(1)?,
            private_pkcs8: row
                .try_get::<_, Option<String>>(2)?
                .map(PrivateKeyText::new),
            created_at_ms: row.try_get(3)?,
            retired_at_ms: row.try_get(4)?,
        })
    };
    read().map_err(column_err)
}

/// Runs one query through the connection's statement cache (one round trip once prepared).
pub(super) async fn query<C: GenericClient>(
    c: &C,
    sql: &str,
    args: &[&(dyn ToSql + Sync)],
) -> Result<Vec<Row>, LedgerError> {
    let st = c.prepare_cached(sql).await.map_err(pg_err)?;
    c.query(&st, args).await.map_err(pg_err)
}

/// A statement from the connection's cache, prepared on first use.
pub(super) async fn prepared<C: GenericClient>(
    c: &C,
    sql: &str,
) -> Result<tokio_postgres::Statement, LedgerError> {
    c.prepare_cached(sql).await.map_err(pg_err)
}

/// Locks the permits of the attempts whose ids are `$1`, in id order.
///
/// This and the other lookups of a list of ids or keys look each one up on its own (a LATERAL
/// subquery with `LIMIT 1` is never turned into a join), one unique-index probe each. With
/// `= ANY($1)` the planner chose by statistics that lag a fast-growing table (or, before the
/// first ANALYZE, by a default guess that one permit holds 0.5 % of the keys): it read every
/// key of the permit and filtered, or the whole attempts table. In a 10-second run on one
/// permit, PostgreSQL's own counters showed 9 million attempt rows read by sequential scans
/// and 4 million index entries read for 13,000 key lookups.
pub(super) const LOCK_PERMITS_OF_ATTEMPTS: &str = "SELECT p.id FROM permits p WHERE p.id IN \
     (SELECT a.permit_id FROM unnest($1::TEXT[]) AS u(id) \
      CROSS JOIN LATERAL (SELECT permit_id FROM attempts x WHERE x.id = u.id LIMIT 1) a) \
     ORDER BY p.id FOR UPDATE";

/// The attempts whose ids are `$1` (see [`LOCK_PERMITS_OF_ATTEMPTS`] for the form).
pub(super) fn load_attempts_sql() -> &'static str {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        format!(
            "SELECT {ATTEMPT_COLS} FROM unnest($1::TEXT[]) AS u(id) \
             CROSS JOIN LATERAL (SELECT * FROM attempts x WHERE x.id = u.id LIMIT 1) a"
        )
    });
    &SQL
}

/// The attempts that the keys `$2` of the permits `$1` (pairwise) name, each row ending with
/// its permit and key as asked (`asked_permit`, `asked_key`); see [`LOCK_PERMITS_OF_ATTEMPTS`]
/// for the form.
pub(super) fn attempts_by_keys_sql() -> &'static str {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        format!(
            "SELECT {ATTEMPT_COLS}, u.p AS asked_permit, u.kh AS asked_key \
             FROM unnest($1::TEXT[], $2::TEXT[]) AS u(p, kh) CROSS JOIN LATERAL \
             (SELECT x.* FROM idempotency_keys k JOIN attempts x ON x.id = k.attempt_id \
              WHERE k.permit_id = u.p AND k.key_hash = u.kh LIMIT 1) a"
        )
    });
    &SQL
}

/// Runs one statement through the connection's statement cache.
pub(super) async fn exec<C: GenericClient>(
    c: &C,
    sql: &str,
    args: &[&(dyn ToSql + Sync)],
) -> Result<u64, LedgerError> {
    let st = c.prepare_cached(sql).await.map_err(pg_err)?;
    c.execute(&st, args).await.map_err(pg_err)
}

pub(super) async fn query_attempts<C: GenericClient>(
    c: &C,
    sql: &str,
    args: &[&(dyn ToSql + Sync)],
) -> Result<Vec<Attempt>, LedgerError> {
    query(c, sql, args)
        .await?
        .iter()
        .map(read_attempt)
        .collect()
}

pub(super) async fn load_attempt<C: GenericClient>(
    c: &C,
    id: &str,
) -> Result<Option<Attempt>, LedgerError> {
    let sql = format!("SELECT {ATTEMPT_COLS} FROM attempts a WHERE a.id = $1");
    Ok(query_attempts(c, &sql, &[&id]).await?.into_iter().next())
}

/// Takes the row lock of the permit an attempt belongs to (see the module docs).
pub(super) async fn lock_permit_of_attempt<C: GenericClient>(
    c: &C,
    attempt_id: &str,
) -> Result<(), LedgerError> {
    query(
        c,
        "SELECT p.id FROM permits p JOIN attempts a ON a.permit_id = p.id WHERE a.id = $1 FOR UPDATE OF p",
        &[&attempt_id],
    )
    .await?;
    Ok(())
}

/// Runs one statement of the shared reads and reads its rows as its shape says.
pub(super) async fn run_statement<C: GenericClient>(
    c: &C,
    s: &Statement,
) -> Result<Rows, LedgerError> {
    let params: Vec<&(dyn ToSql + Sync)> = s
        .params
        .iter()
        .map(|p| match p {
            Param::Int(n) => n as &(dyn ToSql + Sync),
            Param::Text(t) => t,
            Param::NullableText(t) => t,
        })
        .collect();
    let rows = query(c, &s.sql, &params).await?;
    let rows = rows.iter();
    Ok(match s.rows {
        RowShape::Permit => Rows::Permits(rows.map(read_permit).collect::<Result<_, _>>()?),
        RowShape::Attempt => Rows::Attempts(rows.map(read_attempt).collect::<Result<_, _>>()?),
        RowShape::Count { keys } => Rows::Counts(
            rows.map(|r| {
                let names = (0..keys).map(|i| r.try_get(i)).collect::<Result<_, _>>()?;
                Ok((names, r.try_get(keys)?))
            })
            .collect::<Result<_, tokio_postgres::Error>>()
            .map_err(column_err)?,
        ),
        RowShape::Numbers { columns } => Rows::Numbers(
            rows.map(|r| (0..columns).map(|i| r.try_get(i)).collect())
                .collect::<Result<_, tokio_postgres::Error>>()
                .map_err(column_err)?,
        ),
        RowShape::SigningKey => {
            Rows::SigningKeys(rows.map(read_signing_key).collect::<Result<_, _>>()?)
        }
        RowShape::Credential => {
            Rows::Credentials(rows.map(read_credential).collect::<Result<_, _>>()?)
        }
    })
}
