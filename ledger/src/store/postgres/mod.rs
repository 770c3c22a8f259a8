//! The PostgreSQL store: several ledger replicas on one database, with the embedded store's
//! guarantees.
//!
//! # Why READ COMMITTED with one row lock is enough
//!
//! Every transaction that reads or changes a permit's attempts, usage or keys (authorize,
//! outcome reports, resolutions, the sweeper) first takes `SELECT … FOR UPDATE` on that
//! permit's row. So all of them are serialized per permit, across connections and replicas.
//! Under READ COMMITTED each later statement of the transaction takes a fresh snapshot, which
//! therefore contains every commit of every transaction that held the lock before: the
//! snapshot the decision is made on is current, and the reservation written after it commits
//! before the next holder reads. Check and reserve are one atomic step, as with SQLite's
//! `BEGIN IMMEDIATE`; only the lock's scope is one permit instead of the whole file.
//!
//! # Failing closed
//!
//! A pool bounds connections; connecting, waiting for a pooled connection and every
//! statement have timeouts (server side `statement_timeout`, client side a deadline on the
//! whole operation), so a hung or unreachable database turns into a [`LedgerError::Store`]
//! (HTTP 503, the filter denies `gateway_unavailable`), never a hang and never a decision
//! that was not committed. `idle_in_transaction_session_timeout` frees a row lock held by a
//! replica that stopped mid-transaction.
//!
//! States are stored as TEXT via [`AttemptState::as_str`]; which states hold a slot, reserve
//! or spend budget, expire or get pruned is asked of the model and of the pure transitions in
//! [`crate::decide`], so a new state needs no change here.

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use atmost_protocol::{AuthorizeRequest, OutcomeReport};
use deadpool_postgres::GenericClient;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::config::SslMode;
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};
use tokio_postgres::types::ToSql;
use tokio_postgres::{Row, Socket};

use super::counters::CounterMoves;
use super::{AttemptFilter, OutcomeResult, PermitCounters, Store, SweepReport};
use crate::clock::Millis;
use crate::decide::{self, DecideParams, Decision, Mutation, ResolveInput, Snapshot};
use crate::error::{LedgerError, ResolveError};
use crate::model::{
    Attempt, AttemptState, BudgetTotals, GuardMode, Permit, PermitDetail, Policy, Resolution,
    ToolUsage,
};
use crate::token;

/// Key of the advisory lock that serializes migrations of every replica.
const MIGRATION_LOCK: i64 = 0x6174_6d6f_7374_0001;

/// Versioned migrations, applied in order, each once, recorded in `atmost_migrations`.
/// Never edit a released one: add the next version.
const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "permits, attempts, idempotency keys",
        r#"
CREATE TABLE permits (
    id           TEXT PRIMARY KEY,
    token_hash   TEXT NOT NULL,
    label        TEXT NOT NULL,
    created_at   BIGINT NOT NULL,
    expires_at   BIGINT NOT NULL,
    revoked_at   BIGINT,
    retention_ms BIGINT NOT NULL,
    policy       TEXT NOT NULL
);
CREATE TABLE attempts (
    id                TEXT PRIMARY KEY,
    permit_id         TEXT NOT NULL REFERENCES permits(id),
    tool              TEXT NOT NULL,
    key_hash          TEXT,
    fingerprint       TEXT NOT NULL,
    cost              BIGINT NOT NULL,
    state             TEXT NOT NULL,
    created_at        BIGINT NOT NULL,
    updated_at        BIGINT NOT NULL,
    lease_expires_at  BIGINT NOT NULL,
    finished_at       BIGINT,
    receipt           TEXT,
    reason            TEXT,
    replay_count      BIGINT NOT NULL DEFAULT 0,
    pruned_at         BIGINT,
    resolved_executed BOOLEAN,
    resolved_by       TEXT,
    resolved_at       BIGINT,
    resolution_note   TEXT
);
CREATE INDEX attempts_by_permit_tool_state ON attempts(permit_id, tool, state);
CREATE INDEX attempts_by_permit_fingerprint ON attempts(permit_id, fingerprint, created_at);
CREATE INDEX attempts_by_state_lease ON attempts(state, lease_expires_at);
CREATE INDEX attempts_unpruned ON attempts(state, permit_id) WHERE pruned_at IS NULL;
CREATE INDEX attempts_by_created ON attempts(created_at);
CREATE TABLE idempotency_keys (
    permit_id  TEXT NOT NULL,
    key_hash   TEXT NOT NULL,
    attempt_id TEXT NOT NULL REFERENCES attempts(id),
    PRIMARY KEY (permit_id, key_hash)
);
"#,
    ),
    (
        2,
        "O(1) counters: slots held per permit and tool, reserved and spent budget per permit",
        // The state lists are the model's rules when this was written (a migration never changes).
        r#"
CREATE TABLE permit_tool_usage (
    permit_id  TEXT NOT NULL,
    tool       TEXT NOT NULL,
    slots_held BIGINT NOT NULL,
    PRIMARY KEY (permit_id, tool)
);
ALTER TABLE permits ADD COLUMN reserved BIGINT NOT NULL DEFAULT 0;
ALTER TABLE permits ADD COLUMN spent BIGINT NOT NULL DEFAULT 0;
INSERT INTO permit_tool_usage (permit_id, tool, slots_held)
    SELECT permit_id, tool, COUNT(*) FROM attempts
    WHERE state IN ('in_flight','completed','uncertain','resolved_executed','awaiting_input','accepted')
    GROUP BY permit_id, tool;
UPDATE permits p SET
    reserved = COALESCE(t.reserved, 0),
    spent = COALESCE(t.spent, 0)
FROM (SELECT permit_id,
             SUM(cost) FILTER (WHERE state IN ('in_flight','awaiting_input')) AS reserved,
             SUM(cost) FILTER (WHERE state IN ('completed','uncertain','resolved_executed','accepted')) AS spent
      FROM attempts GROUP BY permit_id) t
WHERE t.permit_id = p.id;
"#,
    ),
    (
        3,
        "attempts per permit and state counted; sweeper candidates in partial indexes",
        // As in SQLite's version 3: the metrics and the sweeper no longer read every attempt.
        // Counts are per permit, so they are moved under the permit's row lock that every
        // writer already holds (no row shared by all permits). The state lists are the
        // model's `leased` and `replays` when this was written; a test keeps the queries'
        // lists equal to them (a partial index is only used for the same literal list).
        r#"
CREATE TABLE permit_state_counts (
    permit_id TEXT NOT NULL,
    state     TEXT NOT NULL,
    n         BIGINT NOT NULL,
    PRIMARY KEY (permit_id, state)
);
INSERT INTO permit_state_counts (permit_id, state, n)
    SELECT permit_id, state, COUNT(*) FROM attempts GROUP BY permit_id, state;
DROP INDEX attempts_by_permit_tool_state;
DROP INDEX attempts_by_state_lease;
DROP INDEX attempts_unpruned;
CREATE INDEX attempts_leased ON attempts(lease_expires_at)
    WHERE state IN ('in_flight','awaiting_input');
CREATE INDEX attempts_prunable ON attempts((COALESCE(finished_at, updated_at)))
    WHERE pruned_at IS NULL AND state IN ('completed','resolved_executed','accepted');
"#,
    ),
    (
        4,
        "dispatch rounds: each attempt's current round and its capability's hash",
        // As in SQLite's version 4: older attempts keep round 1 and no capability, so no
        // report moves them; their lease turns them uncertain (fail closed).
        r#"
ALTER TABLE attempts ADD COLUMN round INTEGER NOT NULL DEFAULT 1;
ALTER TABLE attempts ADD COLUMN capability_hash TEXT;
"#,
    ),
];

/// How many columns [`ATTEMPT_COLS`] selects: queries append their own columns after them.
const ATTEMPT_NCOLS: usize = 21;

const ATTEMPT_COLS: &str = "a.id, a.permit_id, a.tool, a.key_hash, a.fingerprint, a.cost, a.state, a.created_at, \
     a.updated_at, a.lease_expires_at, a.finished_at, a.receipt, a.reason, a.replay_count, a.pruned_at, \
     a.resolved_executed, a.resolved_by, a.resolved_at, a.resolution_note, a.round, a.capability_hash";

const PERMIT_COLS: &str = "id, token_hash, label, created_at, expires_at, revoked_at, policy";

/// How to reach the database and how long to wait for it.
#[derive(Clone)]
pub struct PgOptions {
    /// `postgres://…` or `postgresql://…` (libpq URL; `sslmode=require` turns TLS on).
    pub url: String,
    /// Most connections this replica opens.
    pub pool_size: usize,
    /// Connecting (TCP, TLS, authentication) and waiting for a pooled connection.
    pub connect_timeout: Duration,
    /// One statement, server side; the whole operation gets `connect_timeout` + 2× this.
    pub statement_timeout: Duration,
    /// Schema for the tables (created if missing); `None`: the server's `search_path`.
    pub schema: Option<String>,
    /// PEM file of CA certificates to trust for TLS instead of the system's roots.
    pub ca_file: Option<PathBuf>,
}

impl std::fmt::Debug for PgOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgOptions")
            .field("url", &redact_url(&self.url))
            .field("pool_size", &self.pool_size)
            .field("connect_timeout", &self.connect_timeout)
            .field("statement_timeout", &self.statement_timeout)
            .field("schema", &self.schema)
            .field("ca_file", &self.ca_file)
            .finish()
    }
}

impl PgOptions {
    pub fn new(url: impl Into<String>) -> Self {
        PgOptions {
            url: url.into(),
            pool_size: 16,
            connect_timeout: Duration::from_secs(5),
            statement_timeout: Duration::from_secs(5),
            schema: None,
            ca_file: None,
        }
    }
}

/// True for a `--store` value that names PostgreSQL.
pub fn is_postgres_url(s: &str) -> bool {
    s.starts_with("postgres://") || s.starts_with("postgresql://")
}

/// The URL without its password, for logs.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "<unparsable url>".into();
    };
    let (authority, tail) = match rest.find(['/', '?']) {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{scheme}://{user}:***@{host}{tail}")
        }
        None => url.to_string(),
    }
    .split("password=")
    .next()
    .unwrap_or("")
    .to_string()
}

fn valid_schema_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && s.len() <= 63
}

/// State lists the SQL needs (bound as `TEXT[]` parameters), from the model's rules, so that
/// a state added there needs no change here. The pure transitions in `decide` still have the
/// last word on every row.
#[derive(Debug, Clone)]
struct StateSets {
    reserved: Vec<String>,
    spent: Vec<String>,
    gave_back: Vec<String>,
}

impl StateSets {
    fn new() -> Self {
        let names = |pred: &dyn Fn(AttemptState) -> bool| -> Vec<String> {
            AttemptState::ALL
                .into_iter()
                .filter(|s| pred(*s))
                .map(|s| s.as_str().to_string())
                .collect()
        };
        StateSets {
            reserved: names(&|s| s.reserves_budget()),
            spent: names(&|s| s.spends_budget()),
            gave_back: names(&|s| s.gave_back()),
        }
    }
}

pub struct PgStore {
    pool: Pool,
    /// Decisions waiting for their permit's next group transaction.
    decisions: DecisionQueue,
    /// Outcome reports waiting for the next group transaction.
    outcomes: OutcomeQueue,
    states: StateSets,
    op_timeout: Duration,
    description: String,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("database", &self.description)
            .finish()
    }
}

fn pg_err(e: tokio_postgres::Error) -> LedgerError {
    match e.as_db_error() {
        Some(db) => {
            LedgerError::Store(format!("postgres: {} ({})", db.message(), db.code().code()))
        }
        None => LedgerError::Store(format!("postgres: {e}")),
    }
}

fn pool_err(e: deadpool_postgres::PoolError) -> LedgerError {
    match e {
        deadpool_postgres::PoolError::Backend(e) => pg_err(e),
        other => LedgerError::Store(format!("postgres pool: {other}")),
    }
}

fn to_i64(n: u64) -> Result<i64, LedgerError> {
    i64::try_from(n).map_err(|_| LedgerError::Invalid(format!("{n} is too large to store")))
}

fn to_u64(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

fn read_permit(row: &Row) -> Result<Permit, LedgerError> {
    let policy_json: String = row.try_get(6).map_err(pg_err)?;
    let policy: Policy = serde_json::from_str(&policy_json)?;
    Ok(Permit {
        id: row.try_get(0).map_err(pg_err)?,
        token_hash: row.try_get(1).map_err(pg_err)?,
        label: row.try_get(2).map_err(pg_err)?,
        created_at_ms: row.try_get(3).map_err(pg_err)?,
        expires_at_ms: row.try_get(4).map_err(pg_err)?,
        revoked_at_ms: row.try_get(5).map_err(pg_err)?,
        policy,
    })
}

fn read_attempt(row: &Row) -> Result<Attempt, LedgerError> {
    let g = |e| pg_err(e);
    let state: String = row.try_get(6).map_err(g)?;
    let resolved_executed: Option<bool> = row.try_get(15).map_err(g)?;
    let resolved_by: Option<String> = row.try_get(16).map_err(g)?;
    let resolved_at: Option<i64> = row.try_get(17).map_err(g)?;
    let note: Option<String> = row.try_get(18).map_err(g)?;
    let resolution = match (resolved_executed, resolved_by, resolved_at) {
        (Some(executed), Some(by), Some(at_ms)) => Some(Resolution {
            executed,
            by,
            at_ms,
            note,
        }),
        _ => None,
    };
    Ok(Attempt {
        id: row.try_get(0).map_err(g)?,
        permit_id: row.try_get(1).map_err(g)?,
        tool: row.try_get(2).map_err(g)?,
        key_hash: row.try_get(3).map_err(g)?,
        fingerprint: row.try_get(4).map_err(g)?,
        cost: to_u64(row.try_get(5).map_err(g)?),
        state: state.parse().map_err(LedgerError::Corrupt)?,
        created_at_ms: row.try_get(7).map_err(g)?,
        updated_at_ms: row.try_get(8).map_err(g)?,
        lease_expires_at_ms: row.try_get(9).map_err(g)?,
        finished_at_ms: row.try_get(10).map_err(g)?,
        receipt: row.try_get(11).map_err(g)?,
        reason: row.try_get(12).map_err(g)?,
        replay_count: to_u64(row.try_get(13).map_err(g)?),
        pruned_at_ms: row.try_get(14).map_err(g)?,
        resolution,
        round: u32::try_from(row.try_get::<_, i32>(19).map_err(g)?)
            .map_err(|_| LedgerError::Corrupt("attempt round below 0".into()))?,
        capability_hash: row.try_get(20).map_err(g)?,
    })
}

/// Runs one query through the connection's statement cache (one round trip once prepared).
async fn query<C: GenericClient>(
    c: &C,
    sql: &str,
    args: &[&(dyn ToSql + Sync)],
) -> Result<Vec<Row>, LedgerError> {
    let st = c.prepare_cached(sql).await.map_err(pg_err)?;
    c.query(&st, args).await.map_err(pg_err)
}

/// A statement from the connection's cache, prepared on first use.
async fn prepared<C: GenericClient>(
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
const LOCK_PERMITS_OF_ATTEMPTS: &str = "SELECT p.id FROM permits p WHERE p.id IN \
     (SELECT a.permit_id FROM unnest($1::TEXT[]) AS u(id) \
      CROSS JOIN LATERAL (SELECT permit_id FROM attempts x WHERE x.id = u.id LIMIT 1) a) \
     ORDER BY p.id FOR UPDATE";

/// The attempts whose ids are `$1` (see [`LOCK_PERMITS_OF_ATTEMPTS`] for the form).
fn load_attempts_sql() -> String {
    format!(
        "SELECT {ATTEMPT_COLS} FROM unnest($1::TEXT[]) AS u(id) \
         CROSS JOIN LATERAL (SELECT * FROM attempts x WHERE x.id = u.id LIMIT 1) a"
    )
}

/// The attempts that the keys `$2` of the permits `$1` (pairwise) name, each row ending with
/// its permit and key (see [`LOCK_PERMITS_OF_ATTEMPTS`] for the form).
fn attempts_by_keys_sql() -> String {
    format!(
        "SELECT {ATTEMPT_COLS}, u.p, u.kh FROM unnest($1::TEXT[], $2::TEXT[]) AS u(p, kh) CROSS JOIN LATERAL \
         (SELECT x.* FROM idempotency_keys k JOIN attempts x ON x.id = k.attempt_id \
          WHERE k.permit_id = u.p AND k.key_hash = u.kh LIMIT 1) a"
    )
}

/// Takes the row locks of the permits of these attempts (in id order) and then reads the
/// attempts, pipelined: both statements are prepared first, so they are sent in this order and
/// the server runs the read (with a fresh READ COMMITTED snapshot) only after the locks are held.
async fn lock_then_load<C: GenericClient>(
    c: &C,
    ids: &[&str],
) -> Result<Vec<Attempt>, LedgerError> {
    let lock = prepared(c, LOCK_PERMITS_OF_ATTEMPTS).await?;
    let load = prepared(c, &load_attempts_sql()).await?;
    let args: [&(dyn ToSql + Sync); 1] = [&ids];
    let (locked, loaded) = tokio::join!(biased; c.query(&lock, &args), c.query(&load, &args));
    locked.map_err(pg_err)?;
    loaded.map_err(pg_err)?.iter().map(read_attempt).collect()
}

/// Runs one statement through the connection's statement cache.
async fn exec<C: GenericClient>(
    c: &C,
    sql: &str,
    args: &[&(dyn ToSql + Sync)],
) -> Result<u64, LedgerError> {
    let st = c.prepare_cached(sql).await.map_err(pg_err)?;
    c.execute(&st, args).await.map_err(pg_err)
}

async fn query_attempts<C: GenericClient>(
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

async fn load_attempt<C: GenericClient>(c: &C, id: &str) -> Result<Option<Attempt>, LedgerError> {
    let sql = format!("SELECT {ATTEMPT_COLS} FROM attempts a WHERE a.id = $1");
    Ok(query_attempts(c, &sql, &[&id]).await?.into_iter().next())
}

/// Takes the row lock of the permit an attempt belongs to (see the module docs).
async fn lock_permit_of_attempt<C: GenericClient>(
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

/// The attempts' rounds as PostgreSQL's INTEGER (a round past `i32::MAX` cannot happen: each
/// takes a client round trip; it would be stored as the largest value).
fn rounds(attempts: &[Attempt]) -> Vec<i32> {
    attempts
        .iter()
        .map(|a| i32::try_from(a.round).unwrap_or(i32::MAX))
        .collect()
}

/// Inserts attempts and points their keys at them in ONE statement (one round trip under the
/// lock, however many). No two of them may have the same key.
async fn insert_attempts<C: GenericClient>(c: &C, attempts: &[Attempt]) -> Result<(), LedgerError> {
    if attempts.is_empty() {
        return Ok(());
    }
    let mut costs = Vec::with_capacity(attempts.len());
    let mut replays = Vec::with_capacity(attempts.len());
    for a in attempts {
        costs.push(to_i64(a.cost)?);
        replays.push(to_i64(a.replay_count)?);
    }
    let col = |f: fn(&Attempt) -> &str| attempts.iter().map(f).collect::<Vec<&str>>();
    let opt =
        |f: fn(&Attempt) -> Option<&str>| attempts.iter().map(f).collect::<Vec<Option<&str>>>();
    let num = |f: fn(&Attempt) -> Millis| attempts.iter().map(f).collect::<Vec<Millis>>();
    let opt_num =
        |f: fn(&Attempt) -> Option<Millis>| attempts.iter().map(f).collect::<Vec<Option<Millis>>>();
    exec(
        c,
        "WITH ins AS (INSERT INTO attempts (id, permit_id, tool, key_hash, fingerprint, cost, state, created_at, \
         updated_at, lease_expires_at, finished_at, receipt, reason, replay_count, pruned_at, round, capability_hash) \
         SELECT * FROM unnest($1::TEXT[], $2::TEXT[], $3::TEXT[], $4::TEXT[], $5::TEXT[], $6::BIGINT[], \
         $7::TEXT[], $8::BIGINT[], $9::BIGINT[], $10::BIGINT[], $11::BIGINT[], $12::TEXT[], $13::TEXT[], \
         $14::BIGINT[], $15::BIGINT[], $16::INTEGER[], $17::TEXT[]) RETURNING id, permit_id, key_hash) \
         INSERT INTO idempotency_keys (permit_id, key_hash, attempt_id) \
         SELECT permit_id, key_hash, id FROM ins WHERE key_hash IS NOT NULL \
         ON CONFLICT (permit_id, key_hash) DO UPDATE SET attempt_id = excluded.attempt_id",
        &[
            &col(|a| &a.id),
            &col(|a| &a.permit_id),
            &col(|a| &a.tool),
            &opt(|a| a.key_hash.as_deref()),
            &col(|a| &a.fingerprint),
            &costs,
            &col(|a| a.state.as_str()),
            &num(|a| a.created_at_ms),
            &num(|a| a.updated_at_ms),
            &num(|a| a.lease_expires_at_ms),
            &opt_num(|a| a.finished_at_ms),
            &opt(|a| a.receipt.as_deref()),
            &opt(|a| a.reason.as_deref()),
            &replays,
            &opt_num(|a| a.pruned_at_ms),
            &rounds(attempts),
            &opt(|a| a.capability_hash.as_deref()),
        ],
    )
    .await?;
    Ok(())
}

/// Writes the new versions of attempts in ONE statement (one round trip, however many). No
/// two of them may be the same attempt (only one of the two would be written).
async fn update_attempts<C: GenericClient>(c: &C, attempts: &[Attempt]) -> Result<(), LedgerError> {
    if attempts.is_empty() {
        return Ok(());
    }
    let mut replays = Vec::with_capacity(attempts.len());
    for a in attempts {
        replays.push(to_i64(a.replay_count)?);
    }
    fn res(a: &Attempt) -> Option<&Resolution> {
        a.resolution.as_ref()
    }
    exec(
        c,
        "UPDATE attempts a SET state = u.state, updated_at = u.updated_at, lease_expires_at = u.lease_expires_at, \
         finished_at = u.finished_at, receipt = u.receipt, reason = u.reason, replay_count = u.replay_count, \
         pruned_at = u.pruned_at, resolved_executed = u.resolved_executed, resolved_by = u.resolved_by, \
         resolved_at = u.resolved_at, resolution_note = u.resolution_note, round = u.round, \
         capability_hash = u.capability_hash \
         FROM unnest($1::TEXT[], $2::TEXT[], $3::BIGINT[], $4::BIGINT[], $5::BIGINT[], $6::TEXT[], $7::TEXT[], \
         $8::BIGINT[], $9::BIGINT[], $10::BOOLEAN[], $11::TEXT[], $12::BIGINT[], $13::TEXT[], $14::INTEGER[], \
         $15::TEXT[]) \
         AS u(id, state, updated_at, lease_expires_at, finished_at, receipt, reason, replay_count, pruned_at, \
         resolved_executed, resolved_by, resolved_at, resolution_note, round, capability_hash) \
         WHERE a.id = u.id",
        &[
            &attempts.iter().map(|a| a.id.as_str()).collect::<Vec<_>>(),
            &attempts.iter().map(|a| a.state.as_str()).collect::<Vec<_>>(),
            &attempts.iter().map(|a| a.updated_at_ms).collect::<Vec<_>>(),
            &attempts.iter().map(|a| a.lease_expires_at_ms).collect::<Vec<_>>(),
            &attempts.iter().map(|a| a.finished_at_ms).collect::<Vec<_>>(),
            &attempts.iter().map(|a| a.receipt.as_deref()).collect::<Vec<_>>(),
            &attempts.iter().map(|a| a.reason.as_deref()).collect::<Vec<_>>(),
            &replays,
            &attempts.iter().map(|a| a.pruned_at_ms).collect::<Vec<_>>(),
            &attempts.iter().map(|a| res(a).map(|r| r.executed)).collect::<Vec<_>>(),
            &attempts.iter().map(|a| res(a).map(|r| r.by.as_str())).collect::<Vec<_>>(),
            &attempts.iter().map(|a| res(a).map(|r| r.at_ms)).collect::<Vec<_>>(),
            &attempts.iter().map(|a| res(a).and_then(|r| r.note.as_deref())).collect::<Vec<_>>(),
            &rounds(attempts),
            &attempts.iter().map(|a| a.capability_hash.as_deref()).collect::<Vec<_>>(),
        ],
    )
    .await?;
    Ok(())
}

/// Writes the counter moves a transaction summed ([`CounterMoves`]), in the caller's
/// transaction (which holds the row locks of the permits involved), just before it commits:
/// each counter row once, however many attempts moved it. The statements are sent together
/// (pipelined; the server runs them in order).
async fn write_counters<C: GenericClient>(c: &C, moves: &CounterMoves) -> Result<(), LedgerError> {
    let (mut sp, mut st, mut sn) = (Vec::new(), Vec::new(), Vec::new());
    for (p, t, n) in moves.slot_rows() {
        sp.push(p);
        st.push(t);
        sn.push(n);
    }
    let (mut bp, mut br, mut bs) = (Vec::new(), Vec::new(), Vec::new());
    for (p, r, s) in moves.budget_rows() {
        bp.push(p);
        br.push(r);
        bs.push(s);
    }
    let (mut cp, mut cs, mut cn) = (Vec::new(), Vec::new(), Vec::new());
    for (p, s, n) in moves.state_rows() {
        cp.push(p);
        cs.push(s.as_str());
        cn.push(n);
    }
    let (slots, budget, states) = tokio::join!(
        biased;
        add_to_rows(
            c,
            "INSERT INTO permit_tool_usage (permit_id, tool, slots_held) \
             SELECT * FROM unnest($1::TEXT[], $2::TEXT[], $3::BIGINT[]) \
             ON CONFLICT (permit_id, tool) DO UPDATE SET slots_held = permit_tool_usage.slots_held + excluded.slots_held",
            (&sp, &st, &sn),
        ),
        async {
            if bp.is_empty() {
                return Ok(0);
            }
            exec(
                c,
                "UPDATE permits p SET reserved = p.reserved + m.r, spent = p.spent + m.s \
                 FROM unnest($1::TEXT[], $2::BIGINT[], $3::BIGINT[]) AS m(id, r, s) WHERE p.id = m.id",
                &[&bp, &br, &bs],
            )
            .await
        },
        add_to_rows(
            c,
            "INSERT INTO permit_state_counts (permit_id, state, n) \
             SELECT * FROM unnest($1::TEXT[], $2::TEXT[], $3::BIGINT[]) \
             ON CONFLICT (permit_id, state) DO UPDATE SET n = permit_state_counts.n + excluded.n",
            (&cp, &cs, &cn),
        )
    );
    slots?;
    budget?;
    states?;
    Ok(())
}

/// Adds to counter rows keyed by two texts (created at the amount when missing); nothing is
/// sent when there is nothing to add.
async fn add_to_rows<C: GenericClient>(
    c: &C,
    upsert: &str,
    (first, second, amounts): (&Vec<&str>, &Vec<&str>, &Vec<i64>),
) -> Result<u64, LedgerError> {
    if first.is_empty() {
        return Ok(0);
    }
    exec(c, upsert, &[first, second, amounts]).await
}

/// Writes a new version of an attempt in the caller's transaction (which holds the permit's
/// row lock) and adds what it moves to `moves`, which the transaction writes with
/// [`write_counters`] before it commits.
async fn write_attempt<C: GenericClient>(
    c: &C,
    old: &Attempt,
    new: &Attempt,
    moves: &mut CounterMoves,
) -> Result<(), LedgerError> {
    // Checked before anything is sent, so a value that cannot be stored leaves no half write.
    storable(new)?;
    update_attempts(c, std::slice::from_ref(new)).await?;
    moves.record(Some(old), new);
    Ok(())
}

async fn budget_totals<C: GenericClient>(
    c: &C,
    states: &StateSets,
    permit_id: &str,
) -> Result<BudgetTotals, LedgerError> {
    let rows = query(
        c,
        "SELECT COALESCE(SUM(cost) FILTER (WHERE state = ANY($2)), 0)::BIGINT, \
                COALESCE(SUM(cost) FILTER (WHERE state = ANY($3)), 0)::BIGINT \
         FROM attempts WHERE permit_id = $1",
        &[&permit_id, &states.reserved, &states.spent],
    )
    .await?;
    let row = rows
        .first()
        .ok_or_else(|| LedgerError::Store("budget query returned no row".into()))?;
    Ok(BudgetTotals {
        reserved: to_u64(row.try_get(0).map_err(pg_err)?),
        spent: to_u64(row.try_get(1).map_err(pg_err)?),
    })
}

/// One queued authorize call.
/// Waits for a queued operation's answer from its group worker, at most `deadline`.
async fn group_answer<T>(
    answer: tokio::sync::oneshot::Receiver<Result<T, LedgerError>>,
    deadline: Duration,
    dropped: &str,
) -> Result<T, LedgerError> {
    match tokio::time::timeout(deadline, answer).await {
        Ok(Ok(r)) => r,
        Ok(Err(_)) => Err(LedgerError::Join(dropped.into())),
        Err(_) => Err(LedgerError::Store(format!(
            "postgres did not answer within {} ms",
            deadline.as_millis()
        ))),
    }
}

/// Answers every member of a group once its transaction committed, failed, or ran out of
/// time: one result each on success, the group's error for all otherwise.
fn answer_group<T>(
    replies: impl Iterator<Item = tokio::sync::oneshot::Sender<Result<T, LedgerError>>>,
    outcome: Result<Result<Vec<Result<T, LedgerError>>, LedgerError>, tokio::time::error::Elapsed>,
    op_timeout: Duration,
) {
    match outcome {
        Ok(Ok(results)) => {
            for (reply, r) in replies.zip(results) {
                let _ = reply.send(r);
            }
        }
        Ok(Err(e)) => {
            for reply in replies {
                let _ = reply.send(Err(LedgerError::Store(e.to_string())));
            }
        }
        Err(_) => {
            for reply in replies {
                let _ = reply.send(Err(LedgerError::Store(format!(
                    "postgres did not answer within {} ms",
                    op_timeout.as_millis()
                ))));
            }
        }
    }
}

struct AuthJob {
    req: AuthorizeRequest,
    params: DecideParams,
    now: Millis,
    reply: tokio::sync::oneshot::Sender<Result<Decision, LedgerError>>,
}

/// Queued decisions; `Some` while the decision worker runs.
type DecisionQueue = Arc<std::sync::Mutex<Option<Vec<AuthJob>>>>;

/// Most decisions one group transaction takes.
const MAX_GROUP: usize = 256;

/// Takes the queued decisions, of every permit, in groups until none is left. A group is one
/// transaction: it locks the rows of the permits its calls name, in id order (as the outcome
/// transactions do, so no two transactions wait on each other in a cycle), decides them all
/// and commits once. Many agents, one permit each, then share one commit per group instead
/// of paying one per permit.
async fn decision_worker(
    pool: Pool,
    states: StateSets,
    op_timeout: Duration,
    queue: DecisionQueue,
) {
    loop {
        let jobs: Vec<AuthJob> = {
            let mut q = queue.lock().unwrap_or_else(|p| p.into_inner());
            let Some(waiting) = q.as_mut() else {
                return;
            };
            if waiting.is_empty() {
                *q = None;
                return;
            }
            let n = waiting.len().min(MAX_GROUP);
            waiting.drain(..n).collect()
        };
        let work = async {
            let mut conn = pool.get().await.map_err(pool_err)?;
            let tx = conn.transaction().await.map_err(pg_err)?;
            let mut ids: Vec<&str> = jobs
                .iter()
                .filter_map(|j| token::permit_id_of(&j.req.permit_token))
                .collect();
            ids.sort_unstable();
            ids.dedup();
            // The locks every decision on these permits serializes on (module docs). The
            // budget totals come with them: nothing else writes them while the locks are held.
            let sql = format!(
                "SELECT {PERMIT_COLS}, reserved, spent FROM permits WHERE id = ANY($1) ORDER BY id FOR UPDATE"
            );
            let mut permits = std::collections::HashMap::new();
            for row in query(&tx, &sql, &[&ids]).await? {
                let p = read_permit(&row)?;
                let budget: (i64, i64) = (
                    row.try_get(7).map_err(pg_err)?,
                    row.try_get(8).map_err(pg_err)?,
                );
                permits.insert(p.id.clone(), (p, budget));
            }
            let mut moves = CounterMoves::default();
            let decisions = decide_group(&tx, &states, &permits, &jobs, &mut moves).await?;
            // No answer leaves before the commit did: a group that cannot commit is an error.
            tx.commit().await.map_err(pg_err)?;
            Ok(decisions)
        };
        let outcome = tokio::time::timeout(op_timeout, work).await;
        answer_group(jobs.into_iter().map(|j| j.reply), outcome, op_timeout);
    }
}

/// The locked permits of a group, by id, with their stored budget totals (reserved, spent).
type LockedPermits = std::collections::HashMap<String, (Permit, (i64, i64))>;

/// The permit a job names, if it is locked (it exists), and whether the job's token
/// authenticates for it.
fn permit_of<'a>(permits: &'a LockedPermits, job: &AuthJob) -> (Option<&'a Permit>, bool) {
    let permit = token::permit_id_of(&job.req.permit_token)
        .and_then(|id| permits.get(id))
        .map(|(p, _)| p);
    (
        permit,
        decide::authenticate(&job.req.permit_token, permit).is_some(),
    )
}

/// What one batch of a group read: the attempts its keys name, the slots of its tools and
/// each job's duplicate candidate.
#[derive(Default)]
struct BatchReads {
    /// (permit, key hash) → the attempt.
    by_key: std::collections::HashMap<(String, String), Attempt>,
    /// (permit, tool) → slots held.
    slots: std::collections::HashMap<(String, String), i64>,
    /// Index of the job among the batch's authenticated jobs → the newest attempt its
    /// duplicate guard would match.
    duplicates: std::collections::HashMap<usize, Attempt>,
}

/// Splits a group into batches in which no job's reads can be changed by an earlier job of
/// the same batch: a job whose key or fingerprint an earlier job of the batch already has
/// under the same permit starts a new batch (that earlier job may write the very attempt it
/// would read). Counters are the exception, handled by [`CounterMoves`]. Returns the
/// batches' end indexes.
fn batch_ends(jobs: &[AuthJob]) -> Vec<usize> {
    let mut ends = Vec::new();
    let mut keys = std::collections::HashSet::new();
    let mut prints = std::collections::HashSet::new();
    for (i, job) in jobs.iter().enumerate() {
        let permit = token::permit_id_of(&job.req.permit_token).unwrap_or_default();
        let key = job.req.idempotency_key.as_deref().map(|k| (permit, k));
        let print = (permit, job.req.fingerprint.as_str());
        let clash = key.is_some_and(|k| keys.contains(&k)) || prints.contains(&print);
        if clash {
            ends.push(i);
            keys.clear();
            prints.clear();
        }
        if let Some(k) = key {
            keys.insert(k);
        }
        prints.insert(print);
    }
    ends.push(jobs.len());
    ends
}

/// One authenticated job of a batch, with its permit and key hash.
struct Authed<'a> {
    job: &'a AuthJob,
    permit: &'a Permit,
    key_hash: Option<String>,
}

/// Reads everything a batch's decisions need, whatever their permits, in one round trip: the
/// three statements are sent together (pipelined), after the permits' locks are held.
async fn read_batch<C: GenericClient>(
    tx: &C,
    states: &StateSets,
    authed: &[Authed<'_>],
) -> Result<BatchReads, LedgerError> {
    let (mut key_permits, mut key_hashes) = (Vec::new(), Vec::new());
    let mut tools: Vec<(&str, &str)> = Vec::new();
    let (mut dup_permits, mut fps, mut kh_of, mut since, mut dup_of) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (i, a) in authed.iter().enumerate() {
        let policy = &a.permit.policy;
        if let Some(kh) = a.key_hash.as_deref() {
            key_permits.push(a.permit.id.as_str());
            key_hashes.push(kh);
        }
        if policy.limit_for(&a.job.req.tool).is_some() {
            tools.push((a.permit.id.as_str(), a.job.req.tool.as_str()));
        }
        if policy.duplicate_guard != GuardMode::Off {
            dup_permits.push(a.permit.id.as_str());
            fps.push(a.job.req.fingerprint.as_str());
            kh_of.push(a.key_hash.as_deref());
            since.push(a.job.now.saturating_sub(policy.retention_ms));
            dup_of.push(i);
        }
    }
    tools.sort_unstable();
    tools.dedup();
    let (tool_permits, tool_names): (Vec<&str>, Vec<&str>) = tools.into_iter().unzip();
    let st_keys = prepared(tx, &attempts_by_keys_sql()).await?;
    let st_slots = prepared(
        tx,
        "SELECT u.p, u.t, s.slots_held FROM unnest($1::TEXT[], $2::TEXT[]) AS u(p, t) CROSS JOIN LATERAL \
         (SELECT slots_held FROM permit_tool_usage x WHERE x.permit_id = u.p AND x.tool = u.t LIMIT 1) s",
    )
    .await?;
    // One index lookup per job (the same one the single-job query made), numbered by the
    // job's position in the arrays.
    let st_dup = prepared(
        tx,
        &format!(
            "SELECT {ATTEMPT_COLS}, j.i FROM unnest($1::TEXT[], $2::TEXT[], $3::TEXT[], $4::BIGINT[]) WITH ORDINALITY \
             AS j(p, fp, kh, since, i) CROSS JOIN LATERAL (SELECT * FROM attempts d WHERE d.permit_id = j.p \
             AND d.fingerprint = j.fp AND NOT (d.state = ANY($5)) AND d.created_at >= j.since \
             AND (j.kh IS NULL OR d.key_hash IS NULL OR d.key_hash <> j.kh) \
             ORDER BY d.created_at DESC LIMIT 1) a"
        ),
    )
    .await?;
    let (keys, slots, dups) = tokio::join!(
        biased;
        async {
            if key_hashes.is_empty() {
                return Ok(Vec::new());
            }
            tx.query(&st_keys, &[&key_permits, &key_hashes]).await
        },
        async {
            if tool_permits.is_empty() {
                return Ok(Vec::new());
            }
            tx.query(&st_slots, &[&tool_permits, &tool_names]).await
        },
        async {
            if fps.is_empty() {
                return Ok(Vec::new());
            }
            tx.query(
                &st_dup,
                &[&dup_permits, &fps, &kh_of, &since, &states.gave_back],
            )
            .await
        }
    );
    let mut reads = BatchReads::default();
    for row in keys.map_err(pg_err)? {
        let (permit, kh): (String, String) = (
            row.try_get(ATTEMPT_NCOLS).map_err(pg_err)?,
            row.try_get(ATTEMPT_NCOLS + 1).map_err(pg_err)?,
        );
        reads.by_key.insert((permit, kh), read_attempt(&row)?);
    }
    for row in slots.map_err(pg_err)? {
        reads.slots.insert(
            (
                row.try_get(0).map_err(pg_err)?,
                row.try_get(1).map_err(pg_err)?,
            ),
            row.try_get(2).map_err(pg_err)?,
        );
    }
    for row in dups.map_err(pg_err)? {
        let i: i64 = row.try_get(ATTEMPT_NCOLS).map_err(pg_err)?;
        // ORDINALITY counts from 1.
        let job = usize::try_from(i)
            .ok()
            .and_then(|i| i.checked_sub(1))
            .and_then(|i| dup_of.get(i).copied());
        if let Some(job) = job {
            reads.duplicates.insert(job, read_attempt(&row)?);
        }
    }
    Ok(reads)
}

/// Decides a group's jobs in order, inside the transaction that holds their permits' row
/// locks. Each batch (see [`batch_ends`]) is read in one round trip, decided in memory
/// (counters as stored plus the group's moves so far) and written in one more, the last one
/// together with the group's counters. An `Invalid` error is one job's, raised before its
/// writes were sent (its moves are not counted); any other error breaks the transaction and
/// fails the group.
async fn decide_group<C: GenericClient>(
    tx: &C,
    states: &StateSets,
    permits: &LockedPermits,
    jobs: &[AuthJob],
    moves: &mut CounterMoves,
) -> Result<Vec<Result<Decision, LedgerError>>, LedgerError> {
    let mut decisions = Vec::with_capacity(jobs.len());
    let mut start = 0;
    for end in batch_ends(jobs) {
        let batch = &jobs[start..end];
        start = end;
        // Nothing else is read for a token that does not authenticate. Each job's permit, and
        // its position among the authenticated jobs (the duplicate reads are numbered by it).
        let mut authed: Vec<Authed<'_>> = Vec::new();
        let mut checked: Vec<(Option<&Permit>, Option<usize>)> = Vec::with_capacity(batch.len());
        for job in batch {
            let (permit, ok) = permit_of(permits, job);
            let pos = match permit {
                Some(permit) if ok => {
                    authed.push(Authed {
                        job,
                        permit,
                        key_hash: decide::key_hash(&job.req),
                    });
                    Some(authed.len() - 1)
                }
                _ => None,
            };
            checked.push((permit, pos));
        }
        let reads = if authed.is_empty() {
            BatchReads::default()
        } else {
            read_batch(tx, states, &authed).await?
        };
        let mut inserts: Vec<Attempt> = Vec::new();
        let mut updates: Vec<Attempt> = Vec::new();
        for (job, (permit, pos)) in batch.iter().zip(checked) {
            let mut snap = Snapshot {
                now_ms: job.now,
                permit: permit.cloned(),
                ..Snapshot::default()
            };
            if let (Some(p), Some(pos)) = (permit, pos) {
                if let Some(kh) = authed[pos].key_hash.as_deref() {
                    snap.existing = reads.by_key.get(&(p.id.clone(), kh.to_string())).cloned();
                }
                let need = decide::reads_needed(&job.req, p, snap.existing.as_ref());
                if need.usage {
                    let stored = reads
                        .slots
                        .get(&(p.id.clone(), job.req.tool.clone()))
                        .copied()
                        .unwrap_or(0);
                    // The group's earlier decisions' slots are not written yet.
                    snap.usage = ToolUsage {
                        calls_made: to_u64(
                            stored.saturating_add(moves.slots(&p.id, &job.req.tool)),
                        ),
                    };
                }
                if need.budget {
                    let stored = permits.get(&p.id).map(|(_, b)| *b).unwrap_or_default();
                    let pending = moves.budget(&p.id);
                    snap.budget = BudgetTotals {
                        reserved: to_u64(stored.0.saturating_add(pending.0)),
                        spent: to_u64(stored.1.saturating_add(pending.1)),
                    };
                }
                if need.duplicate {
                    snap.recent_duplicate = reads.duplicates.get(&pos).cloned();
                }
            }
            let decision = decide::decide(&job.req, &snap, &job.params);
            let write = match &decision.mutation {
                Mutation::None => Ok(None),
                Mutation::Reserve(a) => storable(a).map(|()| Some((None, a))),
                Mutation::Update(a) => match snap.existing.as_ref().filter(|e| e.id == a.id) {
                    Some(old) => storable(a).map(|()| Some((Some(old), a))),
                    None => {
                        return Err(LedgerError::Store(
                            "an update names an attempt that was not read".into(),
                        ))
                    }
                },
            };
            match write {
                Ok(None) => {}
                Ok(Some((old, a))) => {
                    moves.record(old, a);
                    if old.is_none() {
                        inserts.push(a.clone());
                    } else {
                        updates.push(a.clone());
                    }
                }
                Err(e) => {
                    decisions.push(Err(e));
                    continue;
                }
            }
            decisions.push(Ok(decision));
        }
        // The last batch's writes go out with the group's counters: one round trip.
        let last = end == jobs.len();
        let (inserted, updated, counters) = tokio::join!(
            biased;
            insert_attempts(tx, &inserts),
            update_attempts(tx, &updates),
            async {
                if last {
                    write_counters(tx, moves).await
                } else {
                    Ok(())
                }
            }
        );
        inserted?;
        updated?;
        counters?;
    }
    Ok(decisions)
}

/// A value the attempts table cannot hold is refused before anything is sent.
fn storable(a: &Attempt) -> Result<(), LedgerError> {
    to_i64(a.cost)?;
    to_i64(a.replay_count)?;
    Ok(())
}

/// One queued outcome report.
struct OutcomeJob {
    report: OutcomeReport,
    now: Millis,
    reply: tokio::sync::oneshot::Sender<Result<OutcomeResult, LedgerError>>,
}

/// Queued outcome reports; `Some` while a worker runs.
type OutcomeQueue = Arc<std::sync::Mutex<Option<Vec<OutcomeJob>>>>;

/// Applies queued outcome reports in groups until none is left: each group is one transaction
/// that locks the permits of its attempts in id order (so it never waits in a cycle with
/// another transaction: every other one locks a single permit), applies the reports in order
/// and commits once.
async fn outcome_worker(pool: Pool, op_timeout: Duration, queue: OutcomeQueue) {
    loop {
        let jobs: Vec<OutcomeJob> = {
            let mut q = queue.lock().unwrap_or_else(|p| p.into_inner());
            let Some(waiting) = q.as_mut() else {
                return;
            };
            if waiting.is_empty() {
                *q = None;
                return;
            }
            let n = waiting.len().min(MAX_GROUP);
            waiting.drain(..n).collect()
        };
        let work = async {
            let mut conn = pool.get().await.map_err(pool_err)?;
            let tx = conn.transaction().await.map_err(pg_err)?;
            let ids: Vec<&str> = jobs.iter().map(|j| j.report.attempt_id.as_str()).collect();
            let mut current: BTreeMap<String, Attempt> = lock_then_load(&tx, &ids)
                .await?
                .into_iter()
                .map(|a| (a.id.clone(), a))
                .collect();
            let mut out: Vec<Result<OutcomeResult, LedgerError>> = Vec::with_capacity(jobs.len());
            let mut moves = CounterMoves::default();
            // Reports are applied in order in memory; each attempt's last version is written
            // once, all in one statement sent with the counters: one round trip.
            let mut changed = std::collections::BTreeSet::new();
            for job in &jobs {
                let existing = current.get(&job.report.attempt_id).cloned();
                let (ack, next) = decide::apply_outcome(existing.as_ref(), &job.report, job.now);
                if let (Some(old), Some(a)) = (existing.as_ref(), next) {
                    // Refused before anything is sent: this report only.
                    if let Err(e) = storable(&a) {
                        out.push(Err(e));
                        continue;
                    }
                    moves.record(Some(old), &a);
                    changed.insert(a.id.clone());
                    current.insert(a.id.clone(), a);
                }
                out.push(Ok(OutcomeResult {
                    ack,
                    previous: existing.map(|a| a.state),
                }));
            }
            let written: Vec<Attempt> = changed
                .iter()
                .filter_map(|id| current.get(id).cloned())
                .collect();
            let (rows, counters) = tokio::join!(
                biased;
                update_attempts(&tx, &written),
                write_counters(&tx, &moves)
            );
            rows?;
            counters?;
            tx.commit().await.map_err(pg_err)?;
            Ok(out)
        };
        let outcome = tokio::time::timeout(op_timeout, work).await;
        answer_group(jobs.into_iter().map(|j| j.reply), outcome, op_timeout);
    }
}

impl PgStore {
    /// Connects, runs the migrations (under an advisory lock) and returns the store.
    pub async fn connect(opts: &PgOptions) -> Result<Self, LedgerError> {
        if opts.pool_size == 0 {
            return Err(LedgerError::Invalid(
                "the pool size must be at least 1".into(),
            ));
        }
        if let Some(s) = opts.schema.as_deref() {
            if !valid_schema_name(s) {
                return Err(LedgerError::Invalid(format!(
                    "schema {s:?}: use lowercase letters, digits and '_', starting with a letter or '_'"
                )));
            }
        }
        let config = pg_config(opts)?;
        let tls = if config.get_ssl_mode() == SslMode::Disable {
            RustlsMakeTls::disabled()
        } else {
            RustlsMakeTls::new(opts.ca_file.as_deref())?
        };
        let manager = Manager::from_config(
            config,
            tls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(opts.pool_size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(opts.connect_timeout))
            .create_timeout(Some(opts.connect_timeout))
            .recycle_timeout(Some(opts.connect_timeout))
            .build()
            .map_err(|e| LedgerError::Store(format!("postgres pool: {e}")))?;
        let store = PgStore {
            pool,
            decisions: Arc::default(),
            outcomes: Arc::default(),
            states: StateSets::new(),
            op_timeout: opts.connect_timeout + opts.statement_timeout * 2,
            description: format!(
                "{}{}",
                redact_url(&opts.url),
                opts.schema
                    .as_deref()
                    .map(|s| format!(" schema {s}"))
                    .unwrap_or_default()
            ),
        };
        store.migrate(opts.schema.as_deref()).await?;
        Ok(store)
    }

    /// The database (password redacted) and schema, for logs.
    pub fn description(&self) -> &str {
        &self.description
    }

    async fn migrate(&self, schema: Option<&str>) -> Result<(), LedgerError> {
        let schema = schema.map(str::to_string);
        self.timed(async move |c: &mut deadpool_postgres::Object| {
            let tx = c.transaction().await.map_err(pg_err)?;
            tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
                .await
                .map_err(pg_err)?;
            if let Some(s) = schema.as_deref() {
                // Validated: lowercase letters, digits, '_'.
                tx.batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {s}"))
                    .await
                    .map_err(pg_err)?;
            }
            tx.batch_execute(
                "CREATE TABLE IF NOT EXISTS atmost_migrations (\
                   version INTEGER PRIMARY KEY, description TEXT NOT NULL, \
                   applied_at TIMESTAMPTZ NOT NULL DEFAULT now())",
            )
            .await
            .map_err(pg_err)?;
            let applied: Vec<i32> = tx
                .query("SELECT version FROM atmost_migrations ORDER BY version", &[])
                .await
                .map_err(pg_err)?
                .iter()
                .map(|r| r.try_get(0))
                .collect::<Result<_, _>>()
                .map_err(pg_err)?;
            for (version, description, sql) in MIGRATIONS {
                if applied.contains(version) {
                    continue;
                }
                tx.batch_execute(sql).await.map_err(pg_err)?;
                tx.execute(
                    "INSERT INTO atmost_migrations (version, description) VALUES ($1, $2)",
                    &[version, description],
                )
                .await
                .map_err(pg_err)?;
                tracing::info!(version, description, "migration applied");
            }
            let known = MIGRATIONS.iter().map(|m| m.0).max().unwrap_or(0);
            if let Some(newer) = applied.iter().copied().filter(|v| *v > known).max() {
                tracing::warn!(
                    database_version = newer,
                    known,
                    "the database has migrations this ledger does not know (a newer replica ran them)"
                );
            }
            tx.commit().await.map_err(pg_err)?;
            Ok(())
        })
        .await
    }

    /// Runs `f` on a pooled connection under the operation deadline: a database that does not
    /// answer becomes an error, never a hang.
    async fn timed<R, E, F>(&self, f: F) -> Result<R, E>
    where
        E: From<LedgerError>,
        F: AsyncFnOnce(&mut deadpool_postgres::Object) -> Result<R, E>,
    {
        let work = async {
            let mut conn = self.pool.get().await.map_err(pool_err)?;
            f(&mut conn).await
        };
        match tokio::time::timeout(self.op_timeout, work).await {
            Ok(r) => r,
            Err(_) => Err(E::from(LedgerError::Store(format!(
                "postgres did not answer within {} ms",
                self.op_timeout.as_millis()
            )))),
        }
    }
}

/// The connection config: the URL plus timeouts, keepalives and the session settings.
fn pg_config(opts: &PgOptions) -> Result<tokio_postgres::Config, LedgerError> {
    // tokio-postgres knows disable/prefer/require; this store always verifies the server's
    // certificate and host name, so libpq's stricter modes mean the same here.
    let url = opts
        .url
        .replace("sslmode=verify-full", "sslmode=require")
        .replace("sslmode=verify-ca", "sslmode=require");
    let mut config: tokio_postgres::Config = url.parse().map_err(|e| {
        LedgerError::Invalid(format!("bad PostgreSQL URL {}: {e}", redact_url(&opts.url)))
    })?;
    // libpq's default `prefer` would try TLS and fall back silently: here TLS is on only when
    // asked for (`sslmode=require`), and then it is verified.
    if config.get_ssl_mode() == SslMode::Prefer {
        config.ssl_mode(SslMode::Disable);
    }
    if config.get_application_name().is_none() {
        config.application_name("atmost-ledger");
    }
    config.connect_timeout(opts.connect_timeout);
    config.keepalives(true);
    config.keepalives_idle(Duration::from_secs(10));
    let stmt_ms = opts.statement_timeout.as_millis().max(1);
    let idle_tx_ms = (stmt_ms * 2).max(1000);
    let mut options = config.get_options().unwrap_or("").to_string();
    options.push_str(&format!(
        " -c statement_timeout={stmt_ms} -c lock_timeout={stmt_ms} \
         -c idle_in_transaction_session_timeout={idle_tx_ms} -c default_transaction_isolation=read\\ committed"
    ));
    if let Some(s) = opts.schema.as_deref() {
        options.push_str(&format!(" -c search_path={s}"));
    }
    config.options(options.trim());
    Ok(config)
}

#[async_trait]
impl Store for PgStore {
    async fn ping(&self, _now: Millis) -> Result<(), LedgerError> {
        self.timed(async |c: &mut deadpool_postgres::Object| {
            query(&*c, "SELECT 1 FROM atmost_migrations LIMIT 1", &[]).await?;
            Ok::<_, LedgerError>(())
        })
        .await
    }

    async fn create_permit(&self, p: &Permit, _now: Millis) -> Result<(), LedgerError> {
        let policy =
            serde_json::to_string(&p.policy).map_err(|e| LedgerError::Invalid(e.to_string()))?;
        self.timed(async |c: &mut deadpool_postgres::Object| {
            exec(
                &*c,
                "INSERT INTO permits (id, token_hash, label, created_at, expires_at, revoked_at, retention_ms, policy) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
                &[
                    &p.id,
                    &p.token_hash,
                    &p.label,
                    &p.created_at_ms,
                    &p.expires_at_ms,
                    &p.revoked_at_ms,
                    &p.policy.retention_ms,
                    &policy,
                ],
            )
            .await?;
            Ok(())
        })
        .await
    }

    async fn list_permits(&self, _now: Millis) -> Result<Vec<Permit>, LedgerError> {
        self.timed(async |c: &mut deadpool_postgres::Object| {
            let sql = format!("SELECT {PERMIT_COLS} FROM permits ORDER BY created_at, id");
            query(&*c, &sql, &[])
                .await?
                .iter()
                .map(read_permit)
                .collect()
        })
        .await
    }

    async fn permit_detail(
        &self,
        id: &str,
        _now: Millis,
    ) -> Result<Option<PermitDetail>, LedgerError> {
        self.timed(async |c: &mut deadpool_postgres::Object| {
            // One consistent snapshot for the permit, its counts and its budget.
            let tx = c
                .build_transaction()
                .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
                .read_only(true)
                .start()
                .await
                .map_err(pg_err)?;
            let sql = format!("SELECT {PERMIT_COLS} FROM permits WHERE id = $1");
            let Some(permit) = query(&tx, &sql, &[&id]).await?.first().map(read_permit).transpose()?
            else {
                return Ok(None);
            };
            let mut usage: BTreeMap<String, ToolUsage> = permit
                .policy
                .max_calls
                .keys()
                .map(|t| (t.clone(), ToolUsage::default()))
                .collect();
            let mut attempts_by_state = BTreeMap::new();
            let rows = query(
                &tx,
                "SELECT tool, state, COUNT(*) FROM attempts WHERE permit_id = $1 GROUP BY tool, state",
                &[&id],
            )
            .await?;
            for r in &rows {
                let tool: String = r.try_get(0).map_err(pg_err)?;
                let state: String = r.try_get(1).map_err(pg_err)?;
                let n: i64 = r.try_get(2).map_err(pg_err)?;
                let state: AttemptState = state.parse().map_err(LedgerError::Corrupt)?;
                let n = to_u64(n);
                *attempts_by_state.entry(state).or_insert(0) += n;
                let u = usage.entry(tool).or_default();
                if state.holds_slot() {
                    u.calls_made += n;
                }
            }
            let budget = budget_totals(&tx, &self.states, id).await?;
            tx.commit().await.map_err(pg_err)?;
            Ok(Some(PermitDetail {
                permit,
                usage,
                budget,
                attempts_by_state,
            }))
        })
        .await
    }

    async fn revoke_permit(&self, id: &str, now: Millis) -> Result<Option<Permit>, LedgerError> {
        self.timed(async |c: &mut deadpool_postgres::Object| {
            let tx = c.transaction().await.map_err(pg_err)?;
            exec(
                &tx,
                "UPDATE permits SET revoked_at = $2 WHERE id = $1 AND revoked_at IS NULL",
                &[&id, &now],
            )
            .await?;
            let sql = format!("SELECT {PERMIT_COLS} FROM permits WHERE id = $1");
            let p = query(&tx, &sql, &[&id])
                .await?
                .first()
                .map(read_permit)
                .transpose()?;
            tx.commit().await.map_err(pg_err)?;
            Ok(p)
        })
        .await
    }

    /// Decisions on one permit are queued and taken in groups: one transaction, one row lock
    /// and one commit for the whole group, the decisions made one after another inside it
    /// (each sees the writes of the ones before). No answer leaves before the group committed.
    async fn authorize(
        &self,
        req: &AuthorizeRequest,
        lease_ms: u64,
        now: Millis,
    ) -> Result<Decision, LedgerError> {
        let params = DecideParams {
            lease_ms,
            new_attempt_id: token::new_attempt_id()?,
            new_capability: token::new_capability()?,
        };
        if token::permit_id_of(&req.permit_token).is_none() {
            // No permit is named: nothing to read or write.
            let snap = Snapshot {
                now_ms: now,
                ..Snapshot::default()
            };
            return Ok(decide::decide(req, &snap, &params));
        }
        let (reply, answer) = tokio::sync::oneshot::channel();
        let job = AuthJob {
            req: req.clone(),
            params,
            now,
            reply,
        };
        let start_worker = {
            let mut q = self.decisions.lock().unwrap_or_else(|p| p.into_inner());
            match q.as_mut() {
                Some(waiting) => {
                    waiting.push(job);
                    false
                }
                None => {
                    *q = Some(vec![job]);
                    true
                }
            }
        };
        if start_worker {
            tokio::spawn(decision_worker(
                self.pool.clone(),
                self.states.clone(),
                self.op_timeout,
                Arc::clone(&self.decisions),
            ));
        }
        // A queued decision waits for the group before it too: at most two deadlines.
        group_answer(answer, self.op_timeout * 2, "the decision was dropped").await
    }

    /// Reports are queued and applied in groups (see [`outcome_worker`]): one transaction and
    /// one commit per group; no answer leaves before its group committed.
    async fn record_outcome(
        &self,
        report: &OutcomeReport,
        now: Millis,
    ) -> Result<OutcomeResult, LedgerError> {
        let mut results = self
            .record_outcomes(std::slice::from_ref(report), now)
            .await?;
        results
            .pop()
            .ok_or_else(|| LedgerError::Store("the outcome report was dropped".into()))
    }

    /// The batch's reports join the queue together and in order (see [`outcome_worker`]), so
    /// batches sent at the same time share one transaction and one commit. If any report
    /// fails, the call fails: none of them is known to be recorded (retrying is safe: a
    /// report already applied is acknowledged again).
    async fn record_outcomes(
        &self,
        reports: &[OutcomeReport],
        now: Millis,
    ) -> Result<Vec<OutcomeResult>, LedgerError> {
        if reports.is_empty() {
            return Ok(Vec::new());
        }
        let mut answers = Vec::with_capacity(reports.len());
        let jobs: Vec<OutcomeJob> = reports
            .iter()
            .map(|report| {
                let (reply, answer) = tokio::sync::oneshot::channel();
                answers.push(answer);
                OutcomeJob {
                    report: report.clone(),
                    now,
                    reply,
                }
            })
            .collect();
        let start_worker = {
            let mut q = self.outcomes.lock().unwrap_or_else(|p| p.into_inner());
            match q.as_mut() {
                Some(waiting) => {
                    waiting.extend(jobs);
                    false
                }
                None => {
                    *q = Some(jobs);
                    true
                }
            }
        };
        if start_worker {
            tokio::spawn(outcome_worker(
                self.pool.clone(),
                self.op_timeout,
                Arc::clone(&self.outcomes),
            ));
        }
        let mut out = Vec::with_capacity(answers.len());
        for answer in answers {
            // A queued report waits for the group before it too: at most two deadlines.
            out.push(
                group_answer(
                    answer,
                    self.op_timeout * 2,
                    "the outcome report was dropped",
                )
                .await?,
            );
        }
        Ok(out)
    }

    async fn permit_counters(&self, id: &str) -> Result<Option<PermitCounters>, LedgerError> {
        self.timed(async |c: &mut deadpool_postgres::Object| {
            let tx = c
                .build_transaction()
                .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
                .read_only(true)
                .start()
                .await
                .map_err(pg_err)?;
            let rows = query(
                &tx,
                "SELECT reserved, spent FROM permits WHERE id = $1",
                &[&id],
            )
            .await?;
            let Some(row) = rows.first() else {
                return Ok(None);
            };
            let reserved: i64 = row.try_get(0).map_err(pg_err)?;
            let spent: i64 = row.try_get(1).map_err(pg_err)?;
            let mut slots_held = BTreeMap::new();
            for r in &query(
                &tx,
                "SELECT tool, slots_held FROM permit_tool_usage WHERE permit_id = $1",
                &[&id],
            )
            .await?
            {
                let tool: String = r.try_get(0).map_err(pg_err)?;
                let n: i64 = r.try_get(1).map_err(pg_err)?;
                slots_held.insert(tool, n);
            }
            tx.commit().await.map_err(pg_err)?;
            Ok(Some(PermitCounters {
                slots_held,
                reserved,
                spent,
            }))
        })
        .await
    }

    async fn get_attempt(&self, id: &str, _now: Millis) -> Result<Option<Attempt>, LedgerError> {
        self.timed(async |c: &mut deadpool_postgres::Object| load_attempt(&*c, id).await)
            .await
    }

    async fn list_attempts(
        &self,
        filter: &AttemptFilter,
        _now: Millis,
    ) -> Result<Vec<Attempt>, LedgerError> {
        let state = filter.state.map(|s| s.as_str().to_string());
        let permit = filter.permit_id.clone();
        let limit = i64::from(filter.limit.unwrap_or(1000));
        self.timed(async |c: &mut deadpool_postgres::Object| {
            let sql = format!(
                "SELECT {ATTEMPT_COLS} FROM attempts a WHERE ($1::TEXT IS NULL OR a.state = $1::TEXT) \
                 AND ($2::TEXT IS NULL OR a.permit_id = $2::TEXT) ORDER BY a.created_at DESC, a.id LIMIT $3"
            );
            query_attempts(&*c, &sql, &[&state, &permit, &limit]).await
        })
        .await
    }

    async fn resolve_attempt(
        &self,
        id: &str,
        input: &ResolveInput,
        now: Millis,
    ) -> Result<Attempt, ResolveError> {
        self.timed(async |c: &mut deadpool_postgres::Object| {
            let tx = c.transaction().await.map_err(pg_err)?;
            lock_permit_of_attempt(&tx, id).await?;
            let Some(existing) = load_attempt(&tx, id).await? else {
                return Err(ResolveError::UnknownAttempt);
            };
            let next = decide::resolve(&existing, input, now)?;
            let mut moves = CounterMoves::default();
            write_attempt(&tx, &existing, &next, &mut moves).await?;
            write_counters(&tx, &moves).await?;
            tx.commit().await.map_err(pg_err)?;
            Ok(next)
        })
        .await
    }

    /// Safe with every replica sweeping at once: each permit is swept in its own transaction
    /// under its row lock, and each row is re-read under that lock and passed through the pure
    /// transition again, so a row another replica already moved is left alone (and not counted).
    async fn sweep(&self, now: Millis) -> Result<SweepReport, LedgerError> {
        self.timed(async |c: &mut deadpool_postgres::Object| {
            let mut report = SweepReport::default();
            // Nothing finished after `now - shortest retention` can be due, so the prunable
            // index is read up to there only (the same bound as in the SQLite store).
            let shortest: Option<i64> = query(&*c, "SELECT MIN(retention_ms) FROM permits", &[])
                .await?
                .first()
                .map(|r| r.try_get(0))
                .transpose()
                .map_err(pg_err)?
                .flatten();
            let before = now.saturating_sub(shortest.unwrap_or(0).max(0));
            let sql = format!(
                "SELECT permit_id FROM attempts WHERE state IN {leased} AND lease_expires_at <= $1 \
                 UNION \
                 SELECT a.permit_id FROM attempts a JOIN permits p ON p.id = a.permit_id \
                 WHERE a.pruned_at IS NULL AND a.state IN {replays} \
                 AND COALESCE(a.finished_at, a.updated_at) <= $2 \
                 AND COALESCE(a.finished_at, a.updated_at) + p.retention_ms <= $1 \
                 ORDER BY 1",
                leased = AttemptState::sql_list(AttemptState::leased),
                replays = AttemptState::sql_list(AttemptState::replays),
            );
            let permits: Vec<String> = query(&*c, &sql, &[&now, &before])
            .await?
            .iter()
            .map(|r| r.try_get(0))
            .collect::<Result<_, _>>()
            .map_err(pg_err)?;
            for permit_id in permits {
                let tx = c.transaction().await.map_err(pg_err)?;
                let locked = query(
                    &tx,
                    "SELECT retention_ms FROM permits WHERE id = $1 FOR UPDATE",
                    &[&permit_id],
                )
                .await?;
                let Some(row) = locked.first() else {
                    continue;
                };
                let retention: i64 = row.try_get(0).map_err(pg_err)?;
                let mut moves = CounterMoves::default();
                let sql = format!(
                    "SELECT {ATTEMPT_COLS} FROM attempts a WHERE a.state IN {} \
                     AND a.lease_expires_at <= $2 AND a.permit_id = $1",
                    AttemptState::sql_list(AttemptState::leased)
                );
                for a in query_attempts(&tx, &sql, &[&permit_id, &now]).await? {
                    if let Some(next) = decide::expire_lease(&a, now) {
                        write_attempt(&tx, &a, &next, &mut moves).await?;
                        report.leases_expired += 1;
                    }
                }
                let sql = format!(
                    "SELECT {ATTEMPT_COLS} FROM attempts a WHERE a.pruned_at IS NULL AND a.state IN {} \
                     AND COALESCE(a.finished_at, a.updated_at) <= $2 AND a.permit_id = $1",
                    AttemptState::sql_list(AttemptState::replays)
                );
                let due = now.saturating_sub(retention);
                for a in query_attempts(&tx, &sql, &[&permit_id, &due]).await? {
                    if let Some(next) = decide::prune(&a, retention, now) {
                        write_attempt(&tx, &a, &next, &mut moves).await?;
                        report.receipts_pruned += 1;
                    }
                }
                write_counters(&tx, &moves).await?;
                tx.commit().await.map_err(pg_err)?;
            }
            Ok(report)
        })
        .await
    }

    async fn attempt_counts(
        &self,
        _now: Millis,
    ) -> Result<BTreeMap<AttemptState, u64>, LedgerError> {
        self.timed(async |c: &mut deadpool_postgres::Object| {
            let rows = query(
                &*c,
                "SELECT state, SUM(n)::BIGINT FROM permit_state_counts GROUP BY state",
                &[],
            )
            .await?;
            let mut out: BTreeMap<AttemptState, u64> =
                AttemptState::ALL.iter().map(|s| (*s, 0)).collect();
            for r in &rows {
                let s: String = r.try_get(0).map_err(pg_err)?;
                let n: i64 = r.try_get(1).map_err(pg_err)?;
                let s: AttemptState = s.parse().map_err(LedgerError::Corrupt)?;
                out.insert(s, to_u64(n));
            }
            Ok(out)
        })
        .await
    }
}

// --- TLS (rustls, ring) for `sslmode=require` ---------------------------------------------

/// Makes verified TLS connections: the system's roots (or `--pg-ca-file`) and the host name.
#[derive(Clone)]
struct RustlsMakeTls {
    config: Option<Arc<rustls::ClientConfig>>,
}

impl RustlsMakeTls {
    /// For `sslmode=disable`: never asked to connect.
    fn disabled() -> Self {
        RustlsMakeTls { config: None }
    }

    fn new(ca_file: Option<&std::path::Path>) -> Result<Self, LedgerError> {
        use rustls_pki_types::pem::PemObject;
        use rustls_pki_types::CertificateDer;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| LedgerError::Invalid(format!("TLS: {e}")))?;
        let config = match ca_file {
            Some(path) => {
                let mut roots = rustls::RootCertStore::empty();
                let certs = CertificateDer::pem_file_iter(path).map_err(|e| {
                    LedgerError::Invalid(format!("CA file {}: {e}", path.display()))
                })?;
                for cert in certs {
                    let cert = cert.map_err(|e| {
                        LedgerError::Invalid(format!("CA file {}: {e}", path.display()))
                    })?;
                    roots.add(cert).map_err(|e| {
                        LedgerError::Invalid(format!("CA file {}: {e}", path.display()))
                    })?;
                }
                if roots.is_empty() {
                    return Err(LedgerError::Invalid(format!(
                        "CA file {} holds no certificate",
                        path.display()
                    )));
                }
                builder.with_root_certificates(roots).with_no_client_auth()
            }
            None => {
                use rustls_platform_verifier::BuilderVerifierExt;
                builder
                    .with_platform_verifier()
                    .map_err(|e| LedgerError::Invalid(format!("TLS: {e}")))?
                    .with_no_client_auth()
            }
        };
        Ok(RustlsMakeTls {
            config: Some(Arc::new(config)),
        })
    }
}

struct RustlsConnect {
    config: Option<Arc<rustls::ClientConfig>>,
    name: rustls_pki_types::ServerName<'static>,
}

impl MakeTlsConnect<Socket> for RustlsMakeTls {
    type Stream = RustlsStream;
    type TlsConnect = RustlsConnect;
    type Error = io::Error;

    fn make_tls_connect(&mut self, domain: &str) -> Result<RustlsConnect, io::Error> {
        let name = rustls_pki_types::ServerName::try_from(domain.to_string())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        Ok(RustlsConnect {
            config: self.config.clone(),
            name,
        })
    }
}

impl TlsConnect<Socket> for RustlsConnect {
    type Stream = RustlsStream;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<RustlsStream>> + Send>>;

    fn connect(self, stream: Socket) -> Self::Future {
        Box::pin(async move {
            let config = self.config.ok_or_else(|| {
                io::Error::other("TLS requested but the store was opened with sslmode=disable")
            })?;
            let tls = tokio_rustls::TlsConnector::from(config)
                .connect(self.name, stream)
                .await?;
            Ok(RustlsStream(Box::new(tls)))
        })
    }
}

struct RustlsStream(Box<tokio_rustls::client::TlsStream<Socket>>);

impl AsyncRead for RustlsStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for RustlsStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_shutdown(cx)
    }
}

impl tokio_postgres::tls::TlsStream for RustlsStream {
    fn channel_binding(&self) -> ChannelBinding {
        // SCRAM without channel binding (`channel_binding=prefer`, the default).
        ChannelBinding::none()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use async_trait::async_trait;
    use serde_json::json;

    use super::{
        attempts_by_keys_sql, load_attempts_sql, pg_config, PgOptions, PgStore, RustlsMakeTls,
        LOCK_PERMITS_OF_ATTEMPTS, MIGRATIONS,
    };
    use crate::store::conformance::{self, Harness, LEASE_MS, T0};
    use crate::store::Store;
    use crate::token;

    /// The server the PostgreSQL tests use. They never skip: without it they fail.
    pub fn database_url() -> String {
        match std::env::var("DATABASE_URL") {
            Ok(u) if !u.trim().is_empty() => u,
            _ => panic!(
                "DATABASE_URL is not set. The PostgreSQL store tests need a server and never skip: \
                 `make test` finds or starts one (scripts/with-postgres); by hand, e.g. \
                 DATABASE_URL=postgres://postgres@127.0.0.1:5432/test cargo test -p atmost-ledger"
            ),
        }
    }

    fn opts(url: &str, schema: &str) -> PgOptions {
        PgOptions {
            pool_size: 8,
            connect_timeout: Duration::from_secs(10),
            statement_timeout: Duration::from_secs(15),
            schema: Some(schema.to_string()),
            ..PgOptions::new(url)
        }
    }

    fn new_schema() -> String {
        format!("atmost_test_{}", token::random_hex(6).unwrap())
    }

    /// A plain client on the database (no schema), for set-up and clean-up.
    async fn raw_client(url: &str) -> tokio_postgres::Client {
        let config = pg_config(&PgOptions::new(url)).unwrap();
        let tls = if config.get_ssl_mode() == tokio_postgres::config::SslMode::Disable {
            RustlsMakeTls::disabled()
        } else {
            RustlsMakeTls::new(None).unwrap()
        };
        let (client, conn) = config
            .connect(tls)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to DATABASE_URL: {e}"));
        tokio::spawn(conn);
        client
    }

    /// Drops a test schema, from any context (also from `Drop` inside a runtime).
    fn drop_schema(url: String, schema: String) {
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let c = raw_client(&url).await;
                let _ = c
                    .batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
                    .await;
            });
        })
        .join();
    }

    /// One fresh schema per test: `store` and `second_handle` are two pools on it (like two
    /// replicas), `reopen` a new pool; the schema is dropped at the end.
    struct PgHarness {
        url: String,
        schema: String,
        first: Arc<PgStore>,
    }

    impl PgHarness {
        async fn new() -> Self {
            let url = database_url();
            let schema = new_schema();
            let first = Arc::new(PgStore::connect(&opts(&url, &schema)).await.unwrap());
            PgHarness { url, schema, first }
        }

        async fn handle(&self) -> Arc<dyn Store> {
            Arc::new(
                PgStore::connect(&opts(&self.url, &self.schema))
                    .await
                    .unwrap(),
            )
        }
    }

    impl Drop for PgHarness {
        fn drop(&mut self) {
            drop_schema(self.url.clone(), self.schema.clone());
        }
    }

    #[async_trait]
    impl Harness for PgHarness {
        async fn store(&self) -> Arc<dyn Store> {
            self.first.clone()
        }
        async fn second_handle(&self) -> Arc<dyn Store> {
            self.handle().await
        }
        async fn reopen(&self) -> Arc<dyn Store> {
            self.handle().await
        }
    }

    crate::conformance_suite!(PgHarness::new().await);

    /// "dispatch", or the denial's code.
    fn answer_name(r: atmost_protocol::AuthorizeResponse) -> String {
        match r {
            atmost_protocol::AuthorizeResponse::Dispatch { .. } => "dispatch".to_string(),
            atmost_protocol::AuthorizeResponse::Deny(d) => format!("{:?}", d.code),
            other => format!("{other:?}"),
        }
    }

    /// A client holding the permit's row lock in an open transaction (`COMMIT` releases it),
    /// so what the store queues meanwhile forms one group.
    async fn hold_permit_lock(h: &PgHarness, permit_id: &str) -> tokio_postgres::Client {
        let raw = raw_client(&h.url).await;
        raw.batch_execute(&format!(
            "BEGIN; SELECT 1 FROM {}.permits WHERE id = '{permit_id}' FOR UPDATE",
            h.schema
        ))
        .await
        .unwrap();
        raw
    }

    /// Decisions waiting for the next group (`None`: no decision worker runs).
    fn queued_decisions(s: &PgStore) -> Option<usize> {
        s.decisions.lock().unwrap().as_ref().map(Vec::len)
    }

    /// Outcome reports waiting for the next group (`None`: no outcome worker runs).
    fn queued_outcomes(s: &PgStore) -> Option<usize> {
        s.outcomes.lock().unwrap().as_ref().map(Vec::len)
    }

    /// Waits until the queue holds `want` jobs. A spawned call may first run at any time, in
    /// any order with the others, so the grouping tests order their calls on the queue by
    /// waiting for each to arrive there, not by waiting for a while. A call answered
    /// meanwhile (it failed, or never queued) fails the test instead of letting it hang.
    async fn until_queued<T>(
        queued: impl Fn() -> Option<usize>,
        want: usize,
        calls: &[&tokio::task::JoinHandle<T>],
    ) {
        while queued() != Some(want) {
            assert!(
                calls.iter().all(|c| !c.is_finished()),
                "a call was answered while {want} were expected in the queue (queued: {:?})",
                queued()
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Decisions queued while the permit's lock is held elsewhere are decided together, in
    /// one transaction: each must see what the earlier ones of its group decided (a slot
    /// taken, a fingerprint in flight, a key reserved), though none of it is committed yet.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn one_group_of_queued_decisions_sees_its_own_earlier_decisions() {
        use crate::model::GuardMode;
        use atmost_protocol::{AuthorizeResponse, DenialCode};
        let h = PgHarness::new().await;
        let s = h.first.clone();
        let mut pol = conformance::policy();
        pol.duplicate_guard = GuardMode::Enforce;
        pol.max_calls.insert("pay".into(), 3);
        let (p, tok) = conformance::make_permit(&*s, pol, T0 + conformance::HOUR).await;
        let raw = hold_permit_lock(&h, &p.id).await;
        let call = |r: atmost_protocol::AuthorizeRequest| {
            let s = s.clone();
            tokio::spawn(async move { s.authorize(&r, LEASE_MS, T0).await.unwrap().response })
        };
        // The first call is its worker's first group alone, waiting for the lock ...
        let first = call(conformance::req(
            &tok,
            "other",
            Some("k0"),
            "fp-0",
            json!({}),
        ));
        until_queued(|| queued_decisions(&s), 0, &[&first]).await;
        // ... so these queue behind it and form the next group.
        let mut calls = Vec::new();
        for i in 0..8 {
            let key = format!("d{i}");
            calls.push((
                "dup",
                call(conformance::req(
                    &tok,
                    "x",
                    Some(&key),
                    "one-print",
                    json!({}),
                )),
            ));
        }
        for i in 0..8 {
            let (key, fp) = (format!("c{i}"), format!("fp-c{i}"));
            calls.push((
                "cap",
                call(conformance::req(&tok, "pay", Some(&key), &fp, json!({}))),
            ));
        }
        // One key with other arguments each time (so only the key ties them together).
        for i in 0..4 {
            let fp = format!("fp-k{i}");
            calls.push((
                "key",
                call(conformance::req(&tok, "y", Some("same"), &fp, json!({}))),
            ));
        }
        let waiting: Vec<_> = calls.iter().map(|(_, c)| c).chain([&first]).collect();
        until_queued(|| queued_decisions(&s), calls.len(), &waiting).await;
        raw.batch_execute("COMMIT").await.unwrap();
        assert!(matches!(
            first.await.unwrap(),
            AuthorizeResponse::Dispatch { .. }
        ));
        let mut got = std::collections::BTreeMap::<(&str, String), usize>::new();
        for (kind, c) in calls {
            let outcome = answer_name(c.await.unwrap());
            *got.entry((kind, outcome)).or_default() += 1;
        }
        let want: std::collections::BTreeMap<(&str, String), usize> = [
            (("dup", "dispatch".to_string()), 1),
            (
                (
                    "dup",
                    format!("{:?}", DenialCode::DuplicateRequestSuspected),
                ),
                7,
            ),
            (("cap", "dispatch".to_string()), 3),
            (
                ("cap", format!("{:?}", DenialCode::PermitMaxCallsExceeded)),
                5,
            ),
            (("key", "dispatch".to_string()), 1),
            (
                ("key", format!("{:?}", DenialCode::IdempotencyKeyConflict)),
                3,
            ),
        ]
        .into_iter()
        .collect();
        assert_eq!(got, want);
        let counters = s.permit_counters(&p.id).await.unwrap().unwrap();
        assert_eq!(counters.slots_held.get("pay"), Some(&3));
    }

    /// Version 3's partial indexes carry the model's state lists, and the sweeper's queries
    /// (as generic plans, the way prepared statements end up) are answered from them.
    #[tokio::test]
    async fn sweeper_queries_read_the_partial_indexes() {
        use crate::model::AttemptState;
        let (_, _, v3) = MIGRATIONS.iter().find(|m| m.0 == 3).unwrap();
        let leased = AttemptState::sql_list(AttemptState::leased);
        let replays = AttemptState::sql_list(AttemptState::replays);
        assert!(v3.contains(&format!("WHERE state IN {leased};")), "{v3}");
        assert!(
            v3.contains(&format!("WHERE pruned_at IS NULL AND state IN {replays};")),
            "{v3}"
        );
        let h = PgHarness::new().await;
        let c = raw_client(&h.url).await;
        c.batch_execute(&format!(
            "SET search_path = {}; SET plan_cache_mode = force_generic_plan; SET enable_seqscan = off",
            h.schema
        ))
        .await
        .unwrap();
        let queries = [
            ("attempts_leased", format!(
                "SELECT a.id FROM attempts a WHERE a.state IN {leased} AND a.lease_expires_at <= $2 AND a.permit_id = $1"
            )),
            ("attempts_prunable", format!(
                "SELECT a.id FROM attempts a WHERE a.pruned_at IS NULL AND a.state IN {replays} \
                 AND COALESCE(a.finished_at, a.updated_at) <= $2 AND a.permit_id = $1"
            )),
        ];
        for (n, (index, sql)) in queries.iter().enumerate() {
            c.batch_execute(&format!("PREPARE q{n}(text, bigint) AS {sql}"))
                .await
                .unwrap();
            let plan: Vec<String> = c
                .query(&format!("EXPLAIN EXECUTE q{n}('p', 0)"), &[])
                .await
                .unwrap()
                .iter()
                .map(|r| r.get(0))
                .collect();
            assert!(plan.iter().any(|l| l.contains(index)), "{index}: {plan:?}");
        }
    }

    /// One group holds the calls of several permits: keys, fingerprints, slots and budgets
    /// stay each permit's own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn one_group_of_several_permits_keeps_each_permits_own_keys_and_counters() {
        use crate::model::GuardMode;
        use atmost_protocol::AuthorizeResponse;
        let h = PgHarness::new().await;
        let s = h.first.clone();
        let mut pol = conformance::policy();
        pol.duplicate_guard = GuardMode::Enforce;
        pol.max_calls.insert("pay".into(), 2);
        pol.budget = Some(10);
        pol.cost_default = 4;
        let (pa, ta) = conformance::make_permit(&*s, pol.clone(), T0 + conformance::HOUR).await;
        let (pb, tb) = conformance::make_permit(&*s, pol, T0 + conformance::HOUR).await;
        let raw = hold_permit_lock(&h, &pa.id).await;
        let call = |tok: &str, key: &str, fp: &str| {
            let (s, r) = (
                s.clone(),
                conformance::req(tok, "pay", Some(key), fp, json!({})),
            );
            tokio::spawn(async move { s.authorize(&r, LEASE_MS, T0).await.unwrap().response })
        };
        // Waits for the lock alone; the rest queue behind it as one group.
        let first = call(&ta, "k0", "same");
        until_queued(|| queued_decisions(&s), 0, &[&first]).await;
        // Permit b's key k0 and its call with fingerprint "same" under another key are other
        // calls than permit a's (already committed); each permit has two slots and budget
        // for two calls (4 each, of 10). They join the queue in this order: each is spawned
        // once the one before it is there, so the group decides them in this order.
        let mut calls = Vec::new();
        for (tok, key, fp) in [
            (&ta, "k1", "fp-a1"),
            (&tb, "k0", "fp-b0"),
            (&tb, "kb", "same"),
            (&ta, "k2", "fp-a2"),
            (&tb, "k3", "fp-b3"),
        ] {
            calls.push(call(tok, key, fp));
            let waiting: Vec<_> = calls.iter().chain([&first]).collect();
            until_queued(|| queued_decisions(&s), calls.len(), &waiting).await;
        }
        raw.batch_execute("COMMIT").await.unwrap();
        assert!(matches!(
            first.await.unwrap(),
            AuthorizeResponse::Dispatch { .. }
        ));
        let mut got = Vec::new();
        for c in calls {
            got.push(answer_name(c.await.unwrap()));
        }
        // a: the first call and k1, then no slot for k2; b: k0 and kb, then none for k3.
        assert_eq!(
            got,
            [
                "dispatch",
                "dispatch",
                "dispatch",
                "PermitMaxCallsExceeded",
                "PermitMaxCallsExceeded"
            ]
        );
        for p in [&pa, &pb] {
            let c = s.permit_counters(&p.id).await.unwrap().unwrap();
            assert_eq!(
                (c.slots_held.get("pay"), c.reserved),
                (Some(&2), 8),
                "{}",
                p.id
            );
        }
    }

    /// Outcome batches sent while the permit's lock is held elsewhere are applied together,
    /// in the order they arrived, each answered for its own reports.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn outcome_batches_queued_together_are_applied_in_order() {
        use crate::model::AttemptState;
        use atmost_protocol::{AuthorizeResponse, Outcome, OutcomeAck, OutcomeReport};
        let h = PgHarness::new().await;
        let s = h.first.clone();
        let (p, tok) =
            conformance::make_permit(&*s, conformance::policy(), T0 + conformance::HOUR).await;
        let mut ids = Vec::new();
        for i in 0..3 {
            let key = format!("k{i}");
            let r = conformance::req(&tok, "pay", Some(&key), &key, json!({}));
            match conformance::auth(&*s, &r, T0).await {
                AuthorizeResponse::Dispatch { attempt_id, .. } => ids.push(attempt_id),
                other => panic!("{other:?}"),
            }
        }
        let raw = hold_permit_lock(&h, &p.id).await;
        let done = |r: &str| Outcome::Completed { receipt: r.into() };
        let gone = || Outcome::Released {
            reason: "connection_refused".into(),
        };
        let batches = vec![
            vec![(0, done("R0")), (1, gone())],
            vec![(2, done("R2")), (0, gone())],
            vec![(1, done("late")), (2, done("R2"))],
        ];
        let mut calls = Vec::new();
        // In this order: the first waits for the lock alone, in its worker's first group;
        // each later batch is sent once the one before it is in the queue.
        let mut want_queued = 0;
        for (n, batch) in batches.into_iter().enumerate() {
            let reports: Vec<OutcomeReport> = batch
                .into_iter()
                .map(|(i, outcome)| conformance::report_of(&ids[i], outcome))
                .collect();
            let s = s.clone();
            let sent = reports.len();
            calls.push(tokio::spawn(async move {
                s.record_outcomes(&reports, T0 + 1).await.unwrap()
            }));
            if n > 0 {
                want_queued += sent;
            }
            let waiting: Vec<_> = calls.iter().collect();
            until_queued(|| queued_outcomes(&h.first), want_queued, &waiting).await;
        }
        raw.batch_execute("COMMIT").await.unwrap();
        let mut acks = Vec::new();
        for c in calls {
            acks.push(
                c.await
                    .unwrap()
                    .into_iter()
                    .map(|r| r.ack)
                    .collect::<Vec<_>>(),
            );
        }
        assert_eq!(
            acks,
            vec![
                vec![OutcomeAck::Applied, OutcomeAck::Applied],
                vec![OutcomeAck::Applied, OutcomeAck::Conflict],
                vec![OutcomeAck::Conflict, OutcomeAck::AlreadyRecorded],
            ]
        );
        let counts = s.attempt_counts(T0).await.unwrap();
        assert_eq!(counts.get(&AttemptState::Completed), Some(&2));
        assert_eq!(counts.get(&AttemptState::Released), Some(&1));
        assert_eq!(counts.get(&AttemptState::InFlight).copied().unwrap_or(0), 0);
        let c = s.permit_counters(&p.id).await.unwrap().unwrap();
        assert_eq!(c.slots_held.get("pay"), Some(&2));
    }

    /// The lookups of a list of ids or keys probe the unique index once per element, also
    /// when the statistics know nothing of the permit (never analyzed: PostgreSQL then guesses
    /// that one permit holds 0.5 % of the keys, when it holds all of them).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn list_lookups_probe_the_index_per_element_whatever_the_statistics() {
        let h = PgHarness::new().await;
        let c = raw_client(&h.url).await;
        c.batch_execute(&format!(
            "SET search_path = {s}; \
             ALTER TABLE attempts SET (autovacuum_enabled = false); \
             ALTER TABLE idempotency_keys SET (autovacuum_enabled = false); \
             INSERT INTO permits (id, token_hash, label, created_at, expires_at, retention_ms, policy) \
                 VALUES ('p', 'h', 'l', 0, 1, 1, '{{}}'); \
             INSERT INTO attempts (id, permit_id, tool, key_hash, fingerprint, cost, state, created_at, \
                 updated_at, lease_expires_at) \
                 SELECT 'a' || g, 'p', 't', 'k' || g, 'f' || g, 0, 'completed', g, g, g \
                 FROM generate_series(1, 20000) g; \
             INSERT INTO idempotency_keys (permit_id, key_hash, attempt_id) \
                 SELECT 'p', 'k' || g, 'a' || g FROM generate_series(1, 20000) g; \
             SET plan_cache_mode = force_custom_plan",
            s = h.schema
        ))
        .await
        .unwrap();
        let list: Vec<String> = (1..=64).map(|i| format!("'k{i}'")).collect();
        let ids: Vec<String> = (1..=64).map(|i| format!("'a{i}'")).collect();
        let statements = [
            (
                "keys",
                attempts_by_keys_sql()
                    .replace(
                        "$1::TEXT[]",
                        &format!("ARRAY[{}]", vec!["'p'"; 64].join(",")),
                    )
                    .replace("$2::TEXT[]", &format!("ARRAY[{}]", list.join(","))),
            ),
            (
                "lock",
                LOCK_PERMITS_OF_ATTEMPTS
                    .replace("$1::TEXT[]", &format!("ARRAY[{}]", ids.join(","))),
            ),
            (
                "load",
                load_attempts_sql().replace("$1::TEXT[]", &format!("ARRAY[{}]", ids.join(","))),
            ),
        ];
        for (name, sql) in statements {
            let plan: Vec<String> = c
                .query(&format!("EXPLAIN {sql}"), &[])
                .await
                .unwrap()
                .iter()
                .map(|r| r.get(0))
                .collect();
            let text = plan.join("\n");
            assert!(!text.contains("Seq Scan on attempts"), "{name}: {text}");
            assert!(
                !text.contains("Seq Scan on idempotency_keys"),
                "{name}: {text}"
            );
            assert!(!text.contains("Filter: (key_hash"), "{name}: {text}");
            assert!(text.contains("Nested Loop"), "{name}: {text}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn migrations_are_versioned_idempotent_and_safe_when_replicas_start_together() {
        let url = database_url();
        let schema = new_schema();
        let _cleanup = Cleanup(url.clone(), schema.clone());
        let starts: Vec<_> = (0..4)
            .map(|_| {
                let o = opts(&url, &schema);
                tokio::spawn(async move { PgStore::connect(&o).await.map(|_| ()) })
            })
            .collect();
        for s in starts {
            s.await.unwrap().unwrap();
        }
        PgStore::connect(&opts(&url, &schema)).await.unwrap();
        let c = raw_client(&url).await;
        let rows = c
            .query(
                &format!("SELECT version FROM {schema}.atmost_migrations ORDER BY version"),
                &[],
            )
            .await
            .unwrap();
        let versions: Vec<i32> = rows.iter().map(|r| r.get(0)).collect();
        let known: Vec<i32> = MIGRATIONS.iter().map(|m| m.0).collect();
        assert_eq!(versions, known);
    }

    struct Cleanup(String, String);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            drop_schema(self.0.clone(), self.1.clone());
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn replicas_sweeping_at_once_move_each_attempt_once() {
        let h = PgHarness::new().await;
        let s = h.store().await;
        let (_p, tok) = conformance::make_permit(&*s, conformance::policy(), T0 + 3_600_000).await;
        for i in 0..20 {
            let r = conformance::req(
                &tok,
                "pay",
                Some(&format!("k{i}")),
                &format!("f{i}"),
                json!({}),
            );
            s.authorize(&r, LEASE_MS, T0).await.unwrap();
        }
        let replicas = vec![s.clone(), h.handle().await, h.handle().await];
        let later = T0 + i64::try_from(LEASE_MS).unwrap();
        let sweeps: Vec<_> = replicas
            .into_iter()
            .map(|r| tokio::spawn(async move { r.sweep(later).await.unwrap() }))
            .collect();
        let mut expired = 0;
        for sw in sweeps {
            expired += sw.await.unwrap().leases_expired;
        }
        assert_eq!(expired, 20);
        let counts = s.attempt_counts(T0).await.unwrap();
        assert_eq!(counts[&crate::model::AttemptState::Uncertain], 20);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn unreachable_database_fails_at_start() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let mut o = PgOptions::new(format!("postgres://atmost@127.0.0.1:{port}/none"));
        o.connect_timeout = Duration::from_millis(500);
        o.statement_timeout = Duration::from_millis(500);
        let started = Instant::now();
        let err = PgStore::connect(&o).await.unwrap_err();
        assert!(matches!(err, crate::error::LedgerError::Store(_)), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    /// Serves the ledger's routes on `store`; returns the base URL.
    async fn serve(store: Arc<PgStore>) -> String {
        let state = Arc::new(crate::server::AppState {
            store,
            clock: Arc::new(crate::clock::SystemClock),
            config: crate::server::ServerConfig {
                service_token: "svc".into(),
                admin_token: "adm".into(),
                lease: Duration::from_secs(60),
            },
            metrics: Arc::new(crate::metrics::Metrics::new().unwrap()),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = crate::server::router(state);
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        format!("http://{addr}")
    }

    /// A TCP relay to the database that can stall every byte, like a database that hangs or a
    /// network partition during a failover.
    struct Relay {
        port: u16,
        stalled: Arc<AtomicBool>,
    }

    impl Relay {
        async fn start(target: (String, u16)) -> Relay {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = listener.local_addr().unwrap().port();
            let stalled = Arc::new(AtomicBool::new(false));
            let st = stalled.clone();
            tokio::spawn(async move {
                while let Ok((down, _)) = listener.accept().await {
                    let Ok(up) =
                        tokio::net::TcpStream::connect((target.0.as_str(), target.1)).await
                    else {
                        continue;
                    };
                    let (dr, dw) = down.into_split();
                    let (ur, uw) = up.into_split();
                    tokio::spawn(pump(dr, uw, st.clone()));
                    tokio::spawn(pump(ur, dw, st.clone()));
                }
            });
            Relay { port, stalled }
        }
    }

    async fn pump(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        stalled: Arc<AtomicBool>,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            while stalled.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if to.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    }

    /// Transient database failures fail closed: an error within the deadline (the server
    /// answers 503 → `gateway_unavailable`), never a hang and never a dispatch; readiness
    /// (`ping`) follows the database; the store recovers when the database does.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn hung_database_fails_closed_within_the_deadline_and_recovers() {
        let url = database_url();
        let config: tokio_postgres::Config = url.parse().unwrap();
        let host = match config.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
            _ => "127.0.0.1".to_string(),
        };
        let port = config.get_ports().first().copied().unwrap_or(5432);
        let relay = Relay::start((host.clone(), port)).await;
        let schema = new_schema();
        let _cleanup = Cleanup(url.clone(), schema.clone());
        // The same URL with the relay's address.
        let relayed = url.replacen(
            &format!("{host}:{port}"),
            &format!("127.0.0.1:{}", relay.port),
            1,
        );
        assert_ne!(
            relayed, url,
            "DATABASE_URL must name host:port for this test"
        );
        let mut o = opts(&relayed, &schema);
        o.pool_size = 2;
        o.connect_timeout = Duration::from_millis(700);
        o.statement_timeout = Duration::from_millis(700);
        let s = Arc::new(PgStore::connect(&o).await.unwrap());
        let mut pol = conformance::policy();
        pol.max_calls.insert("pay".into(), 1);
        let (p, tok) = conformance::make_permit(&*s, pol, T0 + 3_600_000).await;
        s.ping(T0).await.unwrap();
        let base = serve(s.clone()).await;
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::new();
        assert_eq!(
            http.get(format!("{base}/readyz"))
                .send()
                .await
                .unwrap()
                .status(),
            200
        );

        relay.stalled.store(true, Ordering::SeqCst);
        let started = Instant::now();
        let r = conformance::req(&tok, "pay", Some("k1"), "A", json!({}));
        let err = s.authorize(&r, LEASE_MS, T0).await.unwrap_err();
        assert!(matches!(err, crate::error::LedgerError::Store(_)), "{err}");
        assert!(s.ping(T0).await.is_err(), "readiness follows the database");
        assert!(
            started.elapsed() < Duration::from_secs(6),
            "bounded by the deadline: {:?}",
            started.elapsed()
        );
        // Through the server: 503, which the filter turns into gateway_unavailable.
        let resp = http
            .post(format!("{base}{}", atmost_protocol::AUTHORIZE_PATH))
            .bearer_auth("svc")
            .json(&r)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 503);
        let body: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(body["error"], "store_unavailable");
        assert_eq!(
            http.get(format!("{base}/readyz"))
                .send()
                .await
                .unwrap()
                .status(),
            503
        );

        relay.stalled.store(false, Ordering::SeqCst);
        let deadline = Instant::now() + Duration::from_secs(20);
        let decision = loop {
            match s.authorize(&r, LEASE_MS, T0).await {
                Ok(d) => break d,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("the store did not recover: {e}"),
            }
        };
        s.ping(T0).await.unwrap();
        // Whatever the stalled attempt left, the cap of one holds: one slot at most.
        let d = s.permit_detail(&p.id, T0).await.unwrap().unwrap();
        assert_eq!(d.usage["pay"].calls_made, 1, "{:?}", decision.response);
    }
}
