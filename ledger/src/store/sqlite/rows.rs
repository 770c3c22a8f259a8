//! Rows: the permit and attempt columns as SQLite returns them, the reads of the decisions,
//! and how the shared reads' statements are run.

use std::sync::LazyLock;

use rusqlite::{params, Connection, OptionalExtension, Row, ToSql};

use crate::credentials::StoredCredential;
use crate::error::LedgerError;
use crate::keys::{PrivateKeyText, StoredSigningKey};
use crate::model::{Attempt, Permit};
use crate::store::reads::{Param, RowShape, Rows, Statement};
use crate::store::rows::{AttemptRow, CredentialRow, PermitRow, ATTEMPT_COLS, PERMIT_COLS};

/// The columns of [`SIGNING_KEY_COLS`](crate::store::rows::SIGNING_KEY_COLS) as SQLite
/// returns them.
pub(super) fn read_signing_key(row: &Row<'_>) -> rusqlite::Result<StoredSigningKey> {
    Ok(StoredSigningKey {
        kid: row.get(0)?,
        public_key: row.get(1)?,
        private_pkcs8: row.get::<_, Option<String>>(2)?.map(PrivateKeyText::new),
        created_at_ms: row.get(3)?,
        retired_at_ms: row.get(4)?,
    })
}

/// The columns of [`CREDENTIAL_COLS`](crate::store::rows::CREDENTIAL_COLS) as SQLite returns
/// them.
fn read_credential(row: &Row<'_>) -> rusqlite::Result<CredentialRow> {
    Ok(CredentialRow {
        name: row.get(0)?,
        version: row.get(1)?,
        header: row.get(2)?,
        form: row.get(3)?,
        route: row.get(4)?,
        sealed: row.get(5)?,
        created_at: row.get(6)?,
    })
}

pub(super) fn load_permit(conn: &Connection, id: &str) -> Result<Option<Permit>, LedgerError> {
    static SQL: LazyLock<String> =
        LazyLock::new(|| format!("SELECT {PERMIT_COLS} FROM permits WHERE id = ?1"));
    conn.prepare_cached(&SQL)?
        .query_row(params![id], PermitRow::from_sqlite)
        .optional()?
        .map(Permit::try_from)
        .transpose()
}

pub(super) fn load_attempt(conn: &Connection, id: &str) -> Result<Option<Attempt>, LedgerError> {
    static SQL: LazyLock<String> =
        LazyLock::new(|| format!("SELECT {ATTEMPT_COLS} FROM attempts a WHERE a.id = ?1"));
    conn.prepare_cached(&SQL)?
        .query_row(params![id], AttemptRow::from_sqlite)
        .optional()?
        .map(Attempt::try_from)
        .transpose()
}

pub(super) fn query_attempts(
    conn: &Connection,
    sql: &str,
    args: &[&dyn rusqlite::ToSql],
) -> Result<Vec<Attempt>, LedgerError> {
    let mut stmt = conn.prepare_cached(sql)?;
    let rows = stmt.query_map(args, AttemptRow::from_sqlite)?;
    let mut out = Vec::new();
    for r in rows {
        out.push(Attempt::try_from(r?)?);
    }
    Ok(out)
}

/// Slots held for one tool, as the counter stores them.
pub(super) fn slots_held(
    conn: &Connection,
    permit_id: &str,
    tool: &str,
) -> Result<i64, LedgerError> {
    let n: Option<i64> = conn
        .prepare_cached(
            "SELECT slots_held FROM permit_tool_usage WHERE permit_id = ?1 AND tool = ?2",
        )?
        .query_row(params![permit_id, tool], |r| r.get(0))
        .optional()?;
    Ok(n.unwrap_or(0))
}

/// (reserved, spent) budget, as the counters store them.
pub(super) fn budget_counters(
    conn: &Connection,
    permit_id: &str,
) -> Result<(i64, i64), LedgerError> {
    Ok(conn
        .prepare_cached("SELECT reserved, spent FROM permits WHERE id = ?1")?
        .query_row(params![permit_id], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?
        .unwrap_or((0, 0)))
}

/// Runs one statement of the shared reads and reads its rows as its shape says.
pub(super) fn run_statement(conn: &Connection, s: &Statement) -> Result<Rows, LedgerError> {
    let params: Vec<&dyn ToSql> = s
        .params
        .iter()
        .map(|p| match p {
            Param::Int(n) => n as &dyn ToSql,
            Param::Text(t) => t,
            Param::NullableText(t) => t,
        })
        .collect();
    let mut stmt = conn.prepare_cached(&s.sql)?;
    let mut rows = stmt.query(&*params)?;
    let rows = &mut rows;
    Ok(match s.rows {
        RowShape::Permit => Rows::Permits(each_row(rows, |r| {
            Permit::try_from(PermitRow::from_sqlite(r)?)
        })?),
        RowShape::Attempt => Rows::Attempts(each_row(rows, |r| {
            Attempt::try_from(AttemptRow::from_sqlite(r)?)
        })?),
        RowShape::Count { keys } => Rows::Counts(each_row(rows, |r| {
            let names = (0..keys).map(|i| r.get(i)).collect::<Result<_, _>>()?;
            Ok((names, r.get(keys)?))
        })?),
        RowShape::Numbers { columns } => Rows::Numbers(each_row(rows, |r| {
            Ok((0..columns).map(|i| r.get(i)).collect::<Result<_, _>>()?)
        })?),
        RowShape::SigningKey => Rows::SigningKeys(each_row(rows, |r| Ok(read_signing_key(r)?))?),
        RowShape::Credential => Rows::Credentials(each_row(rows, |r| {
            StoredCredential::try_from(read_credential(r)?)
        })?),
    })
}

/// Every row of a query, each read by `read`.
fn each_row<T>(
    rows: &mut rusqlite::Rows<'_>,
    read: impl Fn(&Row<'_>) -> Result<T, LedgerError>,
) -> Result<Vec<T>, LedgerError> {
    let mut out = Vec::new();
    while let Some(row) = rows.next()? {
        out.push(read(row)?);
    }
    Ok(out)
}
