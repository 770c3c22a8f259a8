//! The reads that decide nothing (the admin API, the CLI, the inbox, the reconciler's walk,
//! the sweeper's gauges, `/v1/limits`), written once for every store.
//!
//! Both stores keep the same tables and columns, so each read here is its statements, in the
//! SQL they share ([`ReadSql`]: only the spelling of a parameter and the name of one table
//! differ, see [`Dialect`]), and how their rows make the answer. A store provides
//! [`ReadQueries`]: it runs statements, in one read-only snapshot when there are several, and
//! reads their rows by [`RowShape`] with its driver; [`Reads`] follows for it.

use std::collections::BTreeMap;

use async_trait::async_trait;

use crate::clock::Millis;
use crate::credentials::StoredCredential;
use crate::error::LedgerError;
use crate::keys::{PublicSigningKey, SigningKey, StoredSigningKey, PUBLISHED_AFTER_RETIREMENT_MS};
use crate::model::{Attempt, AttemptState, BudgetTotals, Permit, PermitDetail, ToolUsage};
use crate::store::rows::{
    to_u64, ATTEMPT_COLS, CREDENTIAL_COLS, CREDENTIAL_PUBLIC_COLS, KEY_ORDER, PERMIT_COLS,
    SIGNING_KEY_COLS, SIGNING_KEY_PUBLIC_COLS,
};
use crate::store::{AttemptFilter, PermitCounters};

/// What a store spells its own way in the shared SQL.
#[derive(Debug, Clone, Copy)]
pub struct Dialect {
    /// The n-th statement parameter: `?n` (SQLite), `$n` (PostgreSQL).
    pub param: fn(u8) -> String,
    /// The n-th parameter where it may be NULL and only compared with TEXT: PostgreSQL cannot
    /// infer its type from `$n IS NULL` and needs it spelled (`$n::TEXT`).
    pub nullable_text: fn(u8) -> String,
    /// The table of attempt counts per state (`state`, `n`): SQLite keeps one row per state,
    /// PostgreSQL one per permit and state, so replicas deciding on different permits do not
    /// write the same row.
    pub state_counts: &'static str,
}

/// A value bound to a statement parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Param {
    Int(i64),
    Text(String),
    /// TEXT or NULL.
    NullableText(Option<String>),
}

/// What each row of a statement holds, so the store's driver knows how to read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowShape {
    /// The columns of [`PERMIT_COLS`].
    Permit,
    /// The columns of [`ATTEMPT_COLS`].
    Attempt,
    /// `keys` TEXT columns, then a count (BIGINT).
    Count { keys: usize },
    /// `columns` BIGINT columns, each possibly NULL.
    Numbers { columns: usize },
    /// The columns of [`SIGNING_KEY_COLS`] (the private key may be NULL).
    SigningKey,
    /// The columns of [`CREDENTIAL_COLS`] (the sealed secret may be NULL).
    Credential,
}

/// One statement of a read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Statement {
    pub sql: String,
    pub params: Vec<Param>,
    pub rows: RowShape,
}

/// A statement's rows, read as its [`RowShape`] says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rows {
    Permits(Vec<Permit>),
    Attempts(Vec<Attempt>),
    /// The key columns and the count of each row.
    Counts(Vec<(Vec<String>, i64)>),
    Numbers(Vec<Vec<Option<i64>>>),
    SigningKeys(Vec<StoredSigningKey>),
    Credentials(Vec<StoredCredential>),
}

impl Rows {
    fn permits(self) -> Result<Vec<Permit>, LedgerError> {
        match self {
            Rows::Permits(p) => Ok(p),
            other => Err(shape_mismatch("permits", &other)),
        }
    }

    fn attempts(self) -> Result<Vec<Attempt>, LedgerError> {
        match self {
            Rows::Attempts(a) => Ok(a),
            other => Err(shape_mismatch("attempts", &other)),
        }
    }

    fn counts(self) -> Result<Vec<(Vec<String>, i64)>, LedgerError> {
        match self {
            Rows::Counts(c) => Ok(c),
            other => Err(shape_mismatch("counts", &other)),
        }
    }

    fn numbers(self) -> Result<Vec<Vec<Option<i64>>>, LedgerError> {
        match self {
            Rows::Numbers(n) => Ok(n),
            other => Err(shape_mismatch("numbers", &other)),
        }
    }

    fn signing_keys(self) -> Result<Vec<StoredSigningKey>, LedgerError> {
        match self {
            Rows::SigningKeys(k) => Ok(k),
            other => Err(shape_mismatch("signing keys", &other)),
        }
    }

    fn credentials(self) -> Result<Vec<StoredCredential>, LedgerError> {
        match self {
            Rows::Credentials(c) => Ok(c),
            other => Err(shape_mismatch("credentials", &other)),
        }
    }
}

fn shape_mismatch(wanted: &str, got: &Rows) -> LedgerError {
    LedgerError::Invariant(format!("a read wanted {wanted}, the store read {got:?}"))
}

/// How a store runs the shared reads.
#[async_trait]
pub trait ReadQueries: Send + Sync {
    fn dialect(&self) -> Dialect;

    /// Runs the statements in order (in one read-only snapshot when there are several) and
    /// answers each one's rows, read as its shape says.
    async fn run(&self, statements: Vec<Statement>) -> Result<Vec<Rows>, LedgerError>;
}

/// The statements of the shared reads, spelled for one store.
#[derive(Debug, Clone, Copy)]
pub struct ReadSql {
    dialect: Dialect,
}

impl ReadSql {
    pub fn new(dialect: Dialect) -> Self {
        ReadSql { dialect }
    }

    fn p(&self, n: u8) -> String {
        (self.dialect.param)(n)
    }

    /// The permit with this id.
    pub fn permit(&self, id: &str) -> Statement {
        Statement {
            sql: format!("SELECT {PERMIT_COLS} FROM permits WHERE id = {}", self.p(1)),
            params: vec![Param::Text(id.into())],
            rows: RowShape::Permit,
        }
    }

    /// Every permit, oldest first.
    pub fn permits(&self) -> Statement {
        Statement {
            sql: format!("SELECT {PERMIT_COLS} FROM permits ORDER BY created_at, id"),
            params: Vec::new(),
            rows: RowShape::Permit,
        }
    }

    /// The permit's attempts counted per tool and state.
    pub fn tool_state_counts(&self, permit_id: &str) -> Statement {
        Statement {
            sql: format!(
                "SELECT tool, state, COUNT(*) FROM attempts WHERE permit_id = {} GROUP BY tool, state",
                self.p(1)
            ),
            params: vec![Param::Text(permit_id.into())],
            rows: RowShape::Count { keys: 2 },
        }
    }

    /// The permit's reserved and spent budget, recounted from its attempts (`permit show`).
    pub fn budget_recount(&self, permit_id: &str) -> Statement {
        Statement {
            sql: format!(
                "SELECT CAST(COALESCE(SUM(CASE WHEN state IN {} THEN cost END), 0) AS BIGINT), \
                        CAST(COALESCE(SUM(CASE WHEN state IN {} THEN cost END), 0) AS BIGINT) \
                 FROM attempts WHERE permit_id = {}",
                AttemptState::sql_list(AttemptState::reserves_budget),
                AttemptState::sql_list(AttemptState::spends_budget),
                self.p(1)
            ),
            params: vec![Param::Text(permit_id.into())],
            rows: RowShape::Numbers { columns: 2 },
        }
    }

    /// The permit's stored budget counters: reserved, spent.
    pub fn budget_counters(&self, permit_id: &str) -> Statement {
        Statement {
            sql: format!(
                "SELECT reserved, spent FROM permits WHERE id = {}",
                self.p(1)
            ),
            params: vec![Param::Text(permit_id.into())],
            rows: RowShape::Numbers { columns: 2 },
        }
    }

    /// The permit's stored slot counters, per tool.
    pub fn slot_counters(&self, permit_id: &str) -> Statement {
        Statement {
            sql: format!(
                "SELECT tool, slots_held FROM permit_tool_usage WHERE permit_id = {}",
                self.p(1)
            ),
            params: vec![Param::Text(permit_id.into())],
            rows: RowShape::Count { keys: 1 },
        }
    }

    /// The attempt with this id.
    pub fn attempt(&self, id: &str) -> Statement {
        Statement {
            sql: format!(
                "SELECT {ATTEMPT_COLS} FROM attempts a WHERE a.id = {}",
                self.p(1)
            ),
            params: vec![Param::Text(id.into())],
            rows: RowShape::Attempt,
        }
    }

    /// The attempts the filter lets through, newest first (at most 1000 unless it says).
    pub fn attempts(&self, filter: &AttemptFilter) -> Statement {
        let (state, permit) = (
            (self.dialect.nullable_text)(1),
            (self.dialect.nullable_text)(2),
        );
        Statement {
            sql: format!(
                "SELECT {ATTEMPT_COLS} FROM attempts a WHERE ({state} IS NULL OR a.state = {state}) \
                 AND ({permit} IS NULL OR a.permit_id = {permit}) ORDER BY a.created_at DESC, a.id LIMIT {}",
                self.p(3)
            ),
            params: vec![
                Param::NullableText(filter.state.map(|s| s.as_str().to_string())),
                Param::NullableText(filter.permit_id.clone()),
                Param::Int(i64::from(filter.limit.unwrap_or(1000))),
            ],
            rows: RowShape::Attempt,
        }
    }

    /// Attempts per state, over all permits.
    pub fn state_counts(&self) -> Statement {
        Statement {
            sql: format!(
                "SELECT state, CAST(SUM(n) AS BIGINT) FROM {} GROUP BY state",
                self.dialect.state_counts
            ),
            params: Vec::new(),
            rows: RowShape::Count { keys: 1 },
        }
    }

    /// `uncertain` attempts, oldest first, at most `limit` (reads `attempts_uncertain`).
    pub fn uncertain(&self, limit: u32) -> Statement {
        Statement {
            sql: format!(
                "SELECT {ATTEMPT_COLS} FROM attempts a WHERE a.state = 'uncertain' \
                 ORDER BY a.updated_at, a.id LIMIT {}",
                self.p(1)
            ),
            params: vec![Param::Int(i64::from(limit))],
            rows: RowShape::Attempt,
        }
    }

    /// `uncertain` attempts after the one that turned so at `after.0` with id `after.1`, in
    /// the same order; at most `limit` (a page of the reconciler's walk).
    pub fn uncertain_after(&self, after: (Millis, &str), limit: u32) -> Statement {
        Statement {
            sql: format!(
                "SELECT {ATTEMPT_COLS} FROM attempts a WHERE a.state = 'uncertain' \
                 AND (a.updated_at > {p1} OR (a.updated_at = {p1} AND a.id > {})) \
                 ORDER BY a.updated_at, a.id LIMIT {}",
                self.p(2),
                self.p(3),
                p1 = self.p(1),
            ),
            params: vec![
                Param::Int(after.0),
                Param::Text(after.1.into()),
                Param::Int(i64::from(limit)),
            ],
            rows: RowShape::Attempt,
        }
    }

    /// `awaiting_input` attempts waiting since `since` or earlier, oldest first; at most
    /// `limit`. It reads `attempts_leased` (its literal state list, then narrowed).
    pub fn stuck(&self, since: Millis, limit: u32) -> Statement {
        Statement {
            sql: format!(
                "SELECT {ATTEMPT_COLS} FROM attempts a WHERE a.state IN {} \
                 AND a.state = 'awaiting_input' AND a.updated_at <= {} \
                 ORDER BY a.updated_at, a.id LIMIT {}",
                AttemptState::sql_list(AttemptState::leased),
                self.p(1),
                self.p(2)
            ),
            params: vec![Param::Int(since), Param::Int(i64::from(limit))],
            rows: RowShape::Attempt,
        }
    }

    /// Resolved attempts, the latest resolution first; at most `limit` (reads
    /// `attempts_resolved`).
    pub fn resolved(&self, limit: u32) -> Statement {
        Statement {
            sql: format!(
                "SELECT {ATTEMPT_COLS} FROM attempts a WHERE a.resolved_at IS NOT NULL \
                 ORDER BY a.resolved_at DESC, a.id LIMIT {}",
                self.p(1)
            ),
            params: vec![Param::Int(i64::from(limit))],
            rows: RowShape::Attempt,
        }
    }

    /// When the attempt uncertain the longest turned so (reads `attempts_uncertain`).
    pub fn oldest_uncertain(&self) -> Statement {
        Statement {
            sql: "SELECT MIN(updated_at) FROM attempts WHERE state = 'uncertain'".into(),
            params: Vec::new(),
            rows: RowShape::Numbers { columns: 1 },
        }
    }

    /// How many calls wait for approval, and when the one waiting the longest was asked for.
    /// It reads `attempts_leased` (its literal state list, then narrowed): the waiting calls
    /// are among the few attempts a lapse time holds, however long the history.
    pub fn awaiting_approval(&self) -> Statement {
        Statement {
            sql: format!(
                "SELECT COUNT(*), MIN(a.created_at) FROM attempts a WHERE a.state IN {} \
                 AND a.state = 'awaiting_approval'",
                AttemptState::sql_list(AttemptState::leased)
            ),
            params: Vec::new(),
            rows: RowShape::Numbers { columns: 2 },
        }
    }

    /// The active signing key, its private half included (at most one row: a unique index
    /// holds the active keys).
    pub fn active_signing_key(&self) -> Statement {
        Statement {
            sql: format!("SELECT {SIGNING_KEY_COLS} FROM signing_keys WHERE retired_at IS NULL"),
            params: Vec::new(),
            rows: RowShape::SigningKey,
        }
    }

    /// The signing keys published at `now`, without their private halves: the active one
    /// first, then each retired one whose publication has not ended, last retired first
    /// (keys made in the same millisecond still list in one order).
    pub fn published_signing_keys(&self, now: Millis) -> Statement {
        Statement {
            sql: format!(
                "SELECT {SIGNING_KEY_PUBLIC_COLS} FROM signing_keys \
                 WHERE retired_at IS NULL OR retired_at >= {} ORDER BY {KEY_ORDER}",
                self.p(1)
            ),
            params: vec![Param::Int(
                now.saturating_sub(PUBLISHED_AFTER_RETIREMENT_MS),
            )],
            rows: RowShape::SigningKey,
        }
    }

    /// Every signing key without their private halves, in [`Self::published_signing_keys`]'s order.
    pub fn signing_keys(&self) -> Statement {
        Statement {
            sql: format!("SELECT {SIGNING_KEY_PUBLIC_COLS} FROM signing_keys ORDER BY {KEY_ORDER}"),
            params: Vec::new(),
            rows: RowShape::SigningKey,
        }
    }

    /// The newest version of the named credential, its sealed secret included.
    pub fn credential(&self, name: &str) -> Statement {
        Statement {
            sql: format!(
                "SELECT {CREDENTIAL_COLS} FROM credentials WHERE name = {} \
                 ORDER BY version DESC LIMIT 1",
                self.p(1)
            ),
            params: vec![Param::Text(name.to_string())],
            rows: RowShape::Credential,
        }
    }

    /// The newest version of every credential, without their secrets, by name.
    pub fn credentials(&self) -> Statement {
        Statement {
            sql: format!(
                "SELECT {CREDENTIAL_PUBLIC_COLS} FROM credentials c \
                 WHERE version = (SELECT MAX(version) FROM credentials n WHERE n.name = c.name) \
                 ORDER BY name"
            ),
            params: Vec::new(),
            rows: RowShape::Credential,
        }
    }
}

/// Runs the statements of one read and answers their rows, one each.
async fn run<S: ReadQueries + ?Sized, const N: usize>(
    store: &S,
    statements: [Statement; N],
) -> Result<[Rows; N], LedgerError> {
    let rows = store.run(statements.into()).await?;
    let got = rows.len();
    rows.try_into().map_err(|_| {
        LedgerError::Invariant(format!(
            "the store answered {got} row sets for {N} statements"
        ))
    })
}

/// The first column of the first row of a one-column [`RowShape::Numbers`] statement; `None`
/// without a row or for NULL (an aggregate over no row).
async fn first_number<S: ReadQueries + ?Sized>(
    store: &S,
    statement: Statement,
) -> Result<Option<i64>, LedgerError> {
    let [rows] = run(store, [statement]).await?;
    Ok(rows
        .numbers()?
        .into_iter()
        .next()
        .and_then(|row| row.into_iter().next())
        .flatten())
}

/// The first row's columns of a [`RowShape::Numbers`] statement, 0 for NULL; `None` without
/// a row.
fn first_numbers<const N: usize>(rows: Rows) -> Result<Option<[i64; N]>, LedgerError> {
    let Some(row) = rows.numbers()?.into_iter().next() else {
        return Ok(None);
    };
    let got = row.len();
    let row: [Option<i64>; N] = row
        .try_into()
        .map_err(|_| LedgerError::Invariant(format!("a row of {got} numbers, not {N}")))?;
    Ok(Some(row.map(|n| n.unwrap_or(0))))
}

/// The key of a row counted by one key.
fn first_key(keys: Vec<String>) -> String {
    keys.into_iter().next().unwrap_or_default()
}

/// The reads that decide nothing.
#[async_trait]
pub trait Reads: Send + Sync {
    /// The permit with this id, `None` if unknown.
    async fn get_permit(&self, id: &str) -> Result<Option<Permit>, LedgerError>;

    /// The permit's O(1) counters as stored, `None` if unknown.
    async fn permit_counters(&self, id: &str) -> Result<Option<PermitCounters>, LedgerError>;

    /// Every permit, oldest first.
    async fn list_permits(&self) -> Result<Vec<Permit>, LedgerError>;

    /// A permit with its usage per tool, budget totals and attempt counts.
    async fn permit_detail(&self, id: &str) -> Result<Option<PermitDetail>, LedgerError>;

    /// The attempt with this id, `None` if unknown.
    async fn get_attempt(&self, id: &str) -> Result<Option<Attempt>, LedgerError>;

    async fn list_attempts(&self, filter: &AttemptFilter) -> Result<Vec<Attempt>, LedgerError>;

    /// Number of attempts per state, over all permits (every state present).
    async fn attempt_counts(&self) -> Result<BTreeMap<AttemptState, u64>, LedgerError>;

    /// What the reconciliation inbox lists: every `uncertain` attempt, and each
    /// `awaiting_input` one that has waited since `stuck_since` or earlier, oldest first by
    /// when it entered its state (`updated_at`, which nothing else moves in these states);
    /// at most `limit`.
    async fn open_attempts(
        &self,
        stuck_since: Millis,
        limit: u32,
    ) -> Result<Vec<Attempt>, LedgerError>;

    /// `uncertain` attempts in the inbox's order (when each turned so, then id) that come
    /// after `after` (that order's key of the last one read; `(Millis::MIN, "")` for the
    /// first); at most `limit`. The reconciler walks them page by page, so no number of
    /// older attempts hides a newer one from it.
    async fn uncertain_after(
        &self,
        after: (Millis, &str),
        limit: u32,
    ) -> Result<Vec<Attempt>, LedgerError>;

    /// Resolved attempts, the latest resolution first; at most `limit`.
    async fn resolved_attempts(&self, limit: u32) -> Result<Vec<Attempt>, LedgerError>;

    /// When the attempt that has been `uncertain` the longest turned so; `None` when none is.
    async fn oldest_uncertain(&self) -> Result<Option<Millis>, LedgerError>;

    /// How many calls wait for a person's approval, and when the one waiting the longest was
    /// asked for (`None` when none is waiting).
    async fn awaiting_approval(&self) -> Result<(u64, Option<Millis>), LedgerError>;

    /// The signing key that signs now, `None` when no key is active. A row that does not
    /// hold a usable key is [`LedgerError::Corrupt`].
    async fn active_signing_key(&self) -> Result<Option<SigningKey>, LedgerError>;

    /// The keys `GET /v1/keys` publishes at `now`, newest first: the active one, and every
    /// retired one until its publication ends ([`PublicSigningKey::published_until_ms`]).
    async fn published_signing_keys(
        &self,
        now: Millis,
    ) -> Result<Vec<PublicSigningKey>, LedgerError>;

    /// Every signing key ever made, newest first.
    async fn signing_keys(&self) -> Result<Vec<PublicSigningKey>, LedgerError>;

    /// The newest version of the named credential with its sealed secret, to answer a
    /// dispatch; `None` when no credential has that name.
    async fn credential(&self, name: &str) -> Result<Option<StoredCredential>, LedgerError>;

    /// The newest version of every credential, by name, without their secrets.
    async fn credentials(&self) -> Result<Vec<StoredCredential>, LedgerError>;
}

#[async_trait]
impl<S: ReadQueries + ?Sized> Reads for S {
    async fn get_permit(&self, id: &str) -> Result<Option<Permit>, LedgerError> {
        let [permit] = run(self, [ReadSql::new(self.dialect()).permit(id)]).await?;
        Ok(permit.permits()?.into_iter().next())
    }

    async fn permit_counters(&self, id: &str) -> Result<Option<PermitCounters>, LedgerError> {
        let sql = ReadSql::new(self.dialect());
        let [budget, slots] = run(self, [sql.budget_counters(id), sql.slot_counters(id)]).await?;
        let Some([reserved, spent]) = first_numbers(budget)? else {
            return Ok(None);
        };
        let slots_held = slots
            .counts()?
            .into_iter()
            .map(|(keys, n)| (first_key(keys), n))
            .collect();
        Ok(Some(PermitCounters {
            slots_held,
            reserved,
            spent,
        }))
    }

    async fn list_permits(&self) -> Result<Vec<Permit>, LedgerError> {
        let [permits] = run(self, [ReadSql::new(self.dialect()).permits()]).await?;
        permits.permits()
    }

    async fn permit_detail(&self, id: &str) -> Result<Option<PermitDetail>, LedgerError> {
        let sql = ReadSql::new(self.dialect());
        // One snapshot for the permit, its counts and its budget.
        let [permit, counts, budget] = run(
            self,
            [
                sql.permit(id),
                sql.tool_state_counts(id),
                sql.budget_recount(id),
            ],
        )
        .await?;
        let Some(permit) = permit.permits()?.into_iter().next() else {
            return Ok(None);
        };
        // Tools with a cap are listed even before their first call.
        let mut usage: BTreeMap<String, ToolUsage> = permit
            .policy
            .rules
            .max_calls
            .keys()
            .map(|t| (t.clone(), ToolUsage::default()))
            .collect();
        let mut attempts_by_state = BTreeMap::new();
        for (keys, n) in counts.counts()? {
            let [tool, state]: [String; 2] = keys.try_into().map_err(|k| {
                LedgerError::Invariant(format!("counted by {k:?}, not by tool and state"))
            })?;
            let state: AttemptState = state.parse().map_err(LedgerError::Corrupt)?;
            let n = to_u64(n);
            *attempts_by_state.entry(state).or_insert(0) += n;
            let u = usage.entry(tool).or_default();
            if state.holds_slot() {
                u.calls_made += n;
            }
        }
        let [reserved, spent] = first_numbers(budget)?.unwrap_or_default();
        Ok(Some(PermitDetail {
            permit,
            usage,
            budget: BudgetTotals {
                spent: to_u64(spent),
                reserved: to_u64(reserved),
            },
            attempts_by_state,
        }))
    }

    async fn get_attempt(&self, id: &str) -> Result<Option<Attempt>, LedgerError> {
        let [attempt] = run(self, [ReadSql::new(self.dialect()).attempt(id)]).await?;
        Ok(attempt.attempts()?.into_iter().next())
    }

    async fn list_attempts(&self, filter: &AttemptFilter) -> Result<Vec<Attempt>, LedgerError> {
        let [attempts] = run(self, [ReadSql::new(self.dialect()).attempts(filter)]).await?;
        attempts.attempts()
    }

    async fn attempt_counts(&self) -> Result<BTreeMap<AttemptState, u64>, LedgerError> {
        let [counts] = run(self, [ReadSql::new(self.dialect()).state_counts()]).await?;
        let mut out: BTreeMap<AttemptState, u64> =
            AttemptState::ALL.iter().map(|s| (*s, 0)).collect();
        for (keys, n) in counts.counts()? {
            let state: AttemptState = first_key(keys).parse().map_err(LedgerError::Corrupt)?;
            out.insert(state, to_u64(n));
        }
        Ok(out)
    }

    async fn open_attempts(
        &self,
        stuck_since: Millis,
        limit: u32,
    ) -> Result<Vec<Attempt>, LedgerError> {
        let sql = ReadSql::new(self.dialect());
        let [uncertain, stuck] =
            run(self, [sql.uncertain(limit), sql.stuck(stuck_since, limit)]).await?;
        let mut open = uncertain.attempts()?;
        open.extend(stuck.attempts()?);
        Ok(oldest_first(open, limit))
    }

    async fn uncertain_after(
        &self,
        after: (Millis, &str),
        limit: u32,
    ) -> Result<Vec<Attempt>, LedgerError> {
        let statement = ReadSql::new(self.dialect()).uncertain_after(after, limit);
        let [attempts] = run(self, [statement]).await?;
        attempts.attempts()
    }

    async fn resolved_attempts(&self, limit: u32) -> Result<Vec<Attempt>, LedgerError> {
        let [attempts] = run(self, [ReadSql::new(self.dialect()).resolved(limit)]).await?;
        attempts.attempts()
    }

    async fn oldest_uncertain(&self) -> Result<Option<Millis>, LedgerError> {
        first_number(self, ReadSql::new(self.dialect()).oldest_uncertain()).await
    }

    async fn awaiting_approval(&self) -> Result<(u64, Option<Millis>), LedgerError> {
        let [rows] = run(self, [ReadSql::new(self.dialect()).awaiting_approval()]).await?;
        let row = rows.numbers()?.into_iter().next().unwrap_or_default();
        let count = row
            .first()
            .copied()
            .flatten()
            .map_or(0, super::rows::to_u64);
        Ok((count, row.get(1).copied().flatten()))
    }

    async fn active_signing_key(&self) -> Result<Option<SigningKey>, LedgerError> {
        let [rows] = run(self, [ReadSql::new(self.dialect()).active_signing_key()]).await?;
        let mut active = rows.signing_keys()?;
        if active.len() > 1 {
            return Err(LedgerError::Invariant(format!(
                "{} signing keys are active",
                active.len()
            )));
        }
        active
            .pop()
            .map(|row| SigningKey::from_stored(&row))
            .transpose()
    }

    async fn published_signing_keys(
        &self,
        now: Millis,
    ) -> Result<Vec<PublicSigningKey>, LedgerError> {
        let statement = ReadSql::new(self.dialect()).published_signing_keys(now);
        let [rows] = run(self, [statement]).await?;
        Ok(rows
            .signing_keys()?
            .iter()
            .map(StoredSigningKey::public)
            .collect())
    }

    async fn signing_keys(&self) -> Result<Vec<PublicSigningKey>, LedgerError> {
        let [rows] = run(self, [ReadSql::new(self.dialect()).signing_keys()]).await?;
        Ok(rows
            .signing_keys()?
            .iter()
            .map(StoredSigningKey::public)
            .collect())
    }

    async fn credential(&self, name: &str) -> Result<Option<StoredCredential>, LedgerError> {
        let [rows] = run(self, [ReadSql::new(self.dialect()).credential(name)]).await?;
        Ok(rows.credentials()?.into_iter().next())
    }

    async fn credentials(&self) -> Result<Vec<StoredCredential>, LedgerError> {
        let [rows] = run(self, [ReadSql::new(self.dialect()).credentials()]).await?;
        rows.credentials()
    }
}

/// The inbox's one list from its two reads (`uncertain` ones, stuck `awaiting_input` ones):
/// oldest first by when each entered its state, ties by id, at most `limit`.
fn oldest_first(mut attempts: Vec<Attempt>, limit: u32) -> Vec<Attempt> {
    attempts.sort_by(|a, b| (a.updated_at_ms, &a.id).cmp(&(b.updated_at_ms, &b.id)));
    attempts.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
    attempts
}
