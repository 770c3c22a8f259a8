//! One statement per decision: a new call decided on what this replica last saw of its permit,
//! written with one statement that applies only where what it saw still holds
//! (docs/postgresql.md, "One statement per decision").
//!
//! The locked path (`decisions`) locks a group's permits, reads what `decide` looks at and
//! writes the effects, statement by statement, in one transaction: about a dozen statements
//! for a lone call. Most calls are a new key under a permit this replica decided for a moment
//! ago, so this path keeps, per permit, what the locked path (or this path) last left: the
//! permit, its budget totals and each tool's slot counter with its version. It runs the same
//! `decide` on that, and when the answer is a reservation it sends one statement (prepared once
//! per connection, committed on its own) that
//!
//! 1. locks the permit's row where it is not revoked, its budget totals are no higher than
//!    those decided on, the key names no attempt yet and the duplicate guard finds none;
//! 2. locks the tool's slot counter where its version is the one decided on;
//! 3. only then inserts the attempt and its key and adds to the counters.
//!
//! The version of a slot counter moves with every raise of it, whoever writes it (schema 13: a
//! trigger), and nothing else raises what a decision admits on: a completion or a release only
//! lowers slots and budget. So a decision on a stale copy that the statement lets through
//! admitted on counts at least as high as the true ones: a stale copy can deny too much, never
//! admit too much. A denial, and anything the copy cannot answer (a permit or tool not seen
//! yet, a token it does not authenticate, a key already used, a version moved by another
//! replica or writer), goes to the locked path, which decides it on what it reads under its
//! locks and refreshes the copy.
//!
//! Rows are locked in the locked path's order (the permit, then its counters), so the two
//! never wait on each other in a cycle. PostgreSQL checks a locked row's conditions again on
//! its newest version when another transaction changed it meanwhile (EvalPlanQual), so a
//! version moved by a commit that came after the statement's snapshot still stops it; the key
//! and the duplicate guard are read in the snapshot, and whatever a concurrent reservation
//! added there moved the version of the counter of its tool (the fingerprint names the tool),
//! while a key taken concurrently under another tool meets the unique index and fails the
//! statement whole. The model check's `VERSIONED_WRITE` variant is this protocol.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use deadpool_postgres::{Object, Pool};
use tokio_postgres::types::ToSql;

use super::rows::prepared;
use super::writes::{arrays_of, storable, SlotCounter};
use super::{column_err, StateSets};
use atmost_protocol::AuthorizeRequest;

use crate::clock::{Deadline, Millis};
use crate::decide::{self, DecideParams, Decision, Mutation};
use crate::error::LedgerError;
use crate::model::{Attempt, AttemptState, Permit};
use crate::store::counters::CounterMoves;
use crate::store::record::{inserted, pg_insert, Written};
use crate::store::rows::{AttemptRow, ATTEMPT_TABLE};
use crate::store::snapshot::{self, DuplicateLookup, PermitRead, SnapshotReads};
use crate::store::{Applied, OneStatementCounts};
use crate::token;

/// Permits kept at most; past it the copies start over (the locked path fills them again).
const CAPACITY: usize = 10_000;

/// Attempts in flight kept at most (those a report may move), past which they start over: at
/// a pod's rates a few hundred are in flight at any moment, and one may carry an earlier
/// round's interim receipt.
const ATTEMPTS_IN_FLIGHT: usize = 4_096;

/// Least time left before a call's deadline for this path: its statement checks the deadline
/// from when it reached the server, so the time it spent on the way is not counted; a call
/// closer to its deadline goes to the locked path, whose guard counts it.
const LEAST_TIME_LEFT: Duration = Duration::from_millis(50);

/// A tool's slot counter as last seen: slots held and the counter's version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SeenCounter {
    slots: i64,
    version: i64,
}

/// What this replica last saw of a permit.
#[derive(Debug, Clone)]
struct SeenPermit {
    permit: Permit,
    /// Budget totals (reserved, spent), never below the stored ones when seen.
    budget: (i64, i64),
    tools: HashMap<String, SeenCounter>,
}

/// What this replica last saw of each permit it decided for, and of each attempt it wrote
/// (for its report: `one_statement_outcome`).
#[derive(Debug, Default)]
pub(super) struct LastSeen {
    permits: Mutex<HashMap<String, SeenPermit>>,
    attempts: Mutex<HashMap<String, Attempt>>,
    pub(super) decisions: Tally,
    pub(super) reports: Tally,
}

/// One-statement writes sent, and how many of them did not apply.
#[derive(Debug, Default)]
pub(super) struct Tally {
    sent: AtomicU64,
    not_applied: AtomicU64,
}

impl Tally {
    pub(super) fn sent(&self) {
        self.sent.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn not_applied(&self) {
        self.not_applied.fetch_add(1, Ordering::Relaxed);
    }

    fn counts(&self) -> Applied {
        let sent = self.sent.load(Ordering::Relaxed);
        let not_applied = self.not_applied.load(Ordering::Relaxed);
        Applied {
            applied: sent.saturating_sub(not_applied),
            not_applied,
        }
    }
}

/// A lock whose holder panicked still guards a usable map: the copies are advice, checked by
/// every statement, so they are used as they are.
fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl LastSeen {
    /// The attempt as this replica last wrote it.
    pub(super) fn attempt(&self, id: &str) -> Option<Attempt> {
        locked(&self.attempts).get(id).cloned()
    }

    /// Keeps attempts as just written (committed) while they are in flight, the one state a
    /// report moves an attempt from; forgets the others.
    pub(super) fn remember_attempts(&self, written: impl IntoIterator<Item = Attempt>) {
        let mut attempts = locked(&self.attempts);
        for a in written {
            if a.state != AttemptState::InFlight {
                attempts.remove(&a.id);
                continue;
            }
            if attempts.len() >= ATTEMPTS_IN_FLIGHT {
                attempts.clear();
            }
            attempts.insert(a.id.clone(), a);
        }
    }

    pub(super) fn forget_attempt(&self, id: &str) {
        locked(&self.attempts).remove(id);
    }

    pub(super) fn counts(&self) -> OneStatementCounts {
        OneStatementCounts {
            decisions: self.decisions.counts(),
            reports: self.reports.counts(),
        }
    }

    fn permits(&self) -> std::sync::MutexGuard<'_, HashMap<String, SeenPermit>> {
        locked(&self.permits)
    }

    /// Keeps what a locked group left, after it committed: each locked permit, its budget
    /// totals as read plus the group's moves, and the slot counters it read (as stored, when
    /// the group did not move them) or wrote (as the write returned them).
    pub(super) fn remember_group<'a>(
        &self,
        permits: impl ExactSizeIterator<Item = (&'a Permit, (i64, i64))>,
        moves: &CounterMoves,
        read: &HashMap<(String, String), (i64, i64)>,
        written: &[SlotCounter],
    ) {
        let mut copies = self.permits();
        if copies.len() + permits.len() > CAPACITY {
            copies.clear();
        }
        for (permit, (reserved, spent)) in permits {
            let (moved_reserved, moved_spent) = moves.budget(&permit.id);
            let tools = copies
                .remove(&permit.id)
                .map(|seen| seen.tools)
                .unwrap_or_default();
            let seen = SeenPermit {
                permit: permit.clone(),
                budget: (
                    reserved.saturating_add(moved_reserved),
                    spent.saturating_add(moved_spent),
                ),
                tools,
            };
            copies.insert(permit.id.clone(), seen);
        }
        // Read as stored where the group did not move them; as written where it did.
        let unmoved = read
            .iter()
            .filter(|((p, t), _)| moves.slots(p, t) == 0)
            .map(|((p, t), (slots, version))| (p, t, *slots, *version));
        let written = written.iter().map(|(p, t, s, v)| (p, t, *s, *v));
        for (permit_id, tool, slots, version) in unmoved.chain(written) {
            if let Some(p) = copies.get_mut(permit_id) {
                p.tools.insert(tool.clone(), SeenCounter { slots, version });
            }
        }
    }

    /// What a lone call is decided on: its permit as seen, the permit's budget totals and the
    /// counter of the call's tool; `None` unless all were seen.
    fn seen_for(&self, permit_id: &str, tool: &str) -> Option<(Permit, (i64, i64), SeenCounter)> {
        let copies = self.permits();
        let seen = copies.get(permit_id)?;
        Some((seen.permit.clone(), seen.budget, *seen.tools.get(tool)?))
    }

    fn forget(&self, permit_id: &str) {
        self.permits().remove(permit_id);
    }

    /// Forgets every copy after an error that may mean another server now answers (a lost
    /// connection, a failover): a standby promoted without the last commits could come to the
    /// same counter version as a copy by other raises, so no copy outlives such an error. The
    /// locked path fills them again from the database that answers now.
    pub(super) fn forget_after(&self, error: &LedgerError) {
        if matches!(error, LedgerError::Unavailable(_)) {
            self.forget_all();
        }
    }

    /// Forgets every copy (see [`LastSeen::forget_after`]): also when a group's time ran out.
    fn forget_all(&self) {
        self.permits().clear();
        locked(&self.attempts).clear();
    }

    /// Keeps what a one-statement decision left: the budget it added to, and its tool's counter
    /// as the statement returned it.
    fn remember_decided(
        &self,
        permit_id: &str,
        tool: &str,
        (reserved, spent): (i64, i64),
        counter: SeenCounter,
    ) {
        if let Some(seen) = self.permits().get_mut(permit_id) {
            seen.budget = (
                seen.budget.0.saturating_add(reserved),
                seen.budget.1.saturating_add(spent),
            );
            seen.tools.insert(tool.to_string(), counter);
        }
    }

    /// After a locked group: nothing when it committed; otherwise every copy is forgotten when
    /// its time ran out, and on an error as [`LastSeen::forget_after`] says.
    pub(super) fn after_group<T>(&self, outcome: &Option<Result<T, LedgerError>>) {
        match outcome {
            None => self.forget_all(),
            Some(Err(e)) => self.forget_after(e),
            Some(Ok(_)) => {}
        }
    }
}

/// The reads of a lone call's decision on a seen permit: its tool's counter and the budget
/// totals as seen; the key's attempt and the duplicate guard's candidate are taken to be none,
/// and what was asked is kept for the statement to check.
struct SeenReads {
    /// The counter of the call's tool, the one tool a call's decision reads.
    counter: SeenCounter,
    budget: (i64, i64),
    /// The key hash whose attempt was asked for.
    asked_key: Option<String>,
    /// The duplicate guard's lookup, when asked: (fingerprint, since, the call's key hash).
    asked_duplicate: Option<(String, i64, Option<String>)>,
}

impl SnapshotReads for SeenReads {
    fn key_attempt(&mut self, _: &Permit, key_hash: &str) -> Result<Option<Attempt>, LedgerError> {
        self.asked_key = Some(key_hash.to_string());
        Ok(None)
    }

    fn slots_held(&mut self, _: &Permit, _: &str) -> Result<i64, LedgerError> {
        Ok(self.counter.slots)
    }

    fn budget(&mut self, _: &Permit) -> Result<(i64, i64), LedgerError> {
        Ok(self.budget)
    }

    fn recent_duplicate(
        &mut self,
        lookup: &DuplicateLookup<'_>,
    ) -> Result<Option<Attempt>, LedgerError> {
        self.asked_duplicate = Some((
            lookup.fingerprint.to_string(),
            lookup.since,
            lookup.key_hash.map(str::to_string),
        ));
        Ok(None)
    }
}

/// The statement: the attempt's inserted columns are `$1…$n`, one single-element array each
/// (the locked path's insert, [`pg_insert`]); the checks and the counters' moves follow. The
/// deadline is checked once both locks are held (`ok`, evaluated on `lt`'s row, after any
/// wait for a lock): a statement that waited past its caller's deadline writes nothing.
static DECIDE_SQL: LazyLock<String> = LazyLock::new(|| {
    let n = inserted(ATTEMPT_TABLE).count();
    let p = |i: usize| format!("${}", n + i);
    let (permit, tool, version, budget_total, key, fingerprint, since, dup_key, gave_back) =
        (p(1), p(2), p(3), p(4), p(5), p(6), p(7), p(8), p(9));
    let (time_left, slots, reserved, spent, state) = (p(10), p(11), p(12), p(13), p(14));
    format!(
        "WITH lp AS (SELECT 1 FROM permits p WHERE p.id = {permit} AND p.revoked_at IS NULL \
           AND p.reserved + p.spent <= {budget_total} \
           AND ({key}::TEXT IS NULL OR NOT EXISTS (SELECT 1 FROM idempotency_keys k \
                WHERE k.permit_id = {permit} AND k.key_hash = {key})) \
           AND ({fingerprint}::TEXT IS NULL OR NOT EXISTS (SELECT 1 FROM attempts d \
                WHERE d.permit_id = {permit} AND d.fingerprint = {fingerprint} \
                AND NOT (d.state = ANY({gave_back}::TEXT[])) AND d.created_at >= {since} \
                AND ({dup_key}::TEXT IS NULL OR d.key_hash IS NULL OR d.key_hash <> {dup_key}))) \
           FOR UPDATE), \
         lt AS (SELECT 1 FROM permit_tool_usage t WHERE t.permit_id = {permit} AND t.tool = {tool} \
           AND t.version = {version} AND EXISTS (SELECT 1 FROM lp) FOR UPDATE), \
         ok AS (SELECT 1 FROM lt \
           WHERE clock_timestamp() < statement_timestamp() + {time_left}::FLOAT8 * INTERVAL '1 millisecond'), \
         a AS ({insert} WHERE EXISTS (SELECT 1 FROM ok) RETURNING id, permit_id, key_hash), \
         k AS (INSERT INTO idempotency_keys (permit_id, key_hash, attempt_id) \
           SELECT permit_id, key_hash, id FROM a WHERE key_hash IS NOT NULL), \
         b AS (UPDATE permits p SET reserved = p.reserved + {reserved}, spent = p.spent + {spent} \
           WHERE p.id = {permit} AND ({reserved}::BIGINT <> 0 OR {spent}::BIGINT <> 0) \
           AND EXISTS (SELECT 1 FROM a)), \
         c AS (INSERT INTO permit_state_counts (permit_id, state, n) SELECT {permit}, {state}, 1 FROM a \
           ON CONFLICT (permit_id, state) DO UPDATE SET n = permit_state_counts.n + 1), \
         u AS (UPDATE permit_tool_usage t SET slots_held = t.slots_held + {slots} \
           WHERE t.permit_id = {permit} AND t.tool = {tool} AND EXISTS (SELECT 1 FROM a) \
           RETURNING t.slots_held, t.version) \
         SELECT slots_held, version FROM u",
        insert = pg_insert("attempts", ATTEMPT_TABLE),
    )
});

/// What came of trying a call on this path.
pub(super) enum Tried {
    /// Decided and committed.
    Decided(Box<Decision>),
    /// Not taken, or taken and not applied: the locked path decides it.
    Missed,
}

/// A lone call as the decision worker took it.
pub(super) struct LoneCall<'a> {
    pub(super) req: &'a AuthorizeRequest,
    pub(super) params: &'a DecideParams,
    pub(super) now: Millis,
    pub(super) deadline: Deadline,
}

/// Decides a lone call on what this replica last saw of its permit, when it can (module
/// docs). Nothing is written unless the answer is a reservation that the statement applied.
pub(super) async fn try_decide(
    pool: &Pool,
    last_seen: &LastSeen,
    states: &StateSets,
    job: LoneCall<'_>,
    limit: Duration,
) -> Tried {
    if job.deadline.remaining() < LEAST_TIME_LEFT {
        return Tried::Missed;
    }
    let Some(permit_id) = token::permit_id_of(&job.req.permit_token) else {
        return Tried::Missed;
    };
    let Some((permit, budget, counter)) = last_seen.seen_for(permit_id, &job.req.tool) else {
        return Tried::Missed;
    };
    let read = PermitRead::check(&job.req.permit_token, Some(&permit));
    if read.authenticated().is_none() {
        return Tried::Missed;
    }
    let key_hash = decide::key_hash(job.req);
    let mut reads = SeenReads {
        counter,
        budget,
        asked_key: None,
        asked_duplicate: None,
    };
    let Ok(snap) = snapshot::assemble(
        job.req,
        read,
        key_hash.as_deref(),
        job.now,
        &mut reads,
        &CounterMoves::default(),
    ) else {
        return Tried::Missed;
    };
    let decision = decide::decide(job.req, &snap, job.params);
    let Mutation::Reserve(attempt) = &decision.mutation else {
        return Tried::Missed;
    };
    if attempt.tool != job.req.tool || storable(attempt).is_err() {
        return Tried::Missed;
    }
    let mut moves = CounterMoves::default();
    moves.record(None, attempt);
    let (reserved, spent) = moves.budget(permit_id);
    let check = Checks {
        permit_id,
        tool: &job.req.tool,
        version: counter.version,
        budget_total: budget.0.saturating_add(budget.1),
        key: reads.asked_key,
        duplicate: reads.asked_duplicate,
        gave_back: &states.gave_back,
        deadline: job.deadline,
        slots: moves.slots(permit_id, &job.req.tool),
        reserved,
        spent,
        state: attempt.state.as_str(),
    };
    last_seen.decisions.sent();
    let sent = send(pool, attempt, &check, limit).await;
    if let Ok(Some((slots, version))) = sent {
        let counter = SeenCounter { slots, version };
        last_seen.remember_decided(permit_id, &job.req.tool, (reserved, spent), counter);
        last_seen.remember_attempts([attempt.clone()]);
        return Tried::Decided(Box::new(decision));
    }
    last_seen.decisions.not_applied();
    if let Err(e) = &sent {
        last_seen.forget_after(e);
    }
    // Whatever moved, the locked path reads it again.
    last_seen.forget(permit_id);
    Tried::Missed
}

/// What the statement checks and moves besides the attempt.
struct Checks<'a> {
    permit_id: &'a str,
    tool: &'a str,
    version: i64,
    budget_total: i64,
    key: Option<String>,
    duplicate: Option<(String, i64, Option<String>)>,
    gave_back: &'a [String],
    deadline: Deadline,
    slots: i64,
    reserved: i64,
    spent: i64,
    state: &'a str,
}

/// Sends the statement within `limit`: the slot counter as it left it when it applied, `None`
/// when it did not.
async fn send(
    pool: &Pool,
    attempt: &Attempt,
    check: &Checks<'_>,
    limit: Duration,
) -> Result<Option<(i64, i64)>, LedgerError> {
    let row = AttemptRow::of(attempt)?;
    let arrays = AttemptRow::pg_arrays(std::slice::from_ref(&row));
    let (fingerprint, since, dup_key) = match &check.duplicate {
        Some((f, s, k)) => (Some(f.as_str()), *s, k.as_deref()),
        None => (None, 0, None),
    };
    let time_left = check.deadline.remaining().as_secs_f64() * 1000.0;
    let mut params = arrays_of(&arrays, Written::on_insert);
    params.extend([
        &check.permit_id as &(dyn ToSql + Sync),
        &check.tool,
        &check.version,
        &check.budget_total,
        &check.key,
        &fingerprint,
        &since,
        &dup_key,
        &check.gave_back,
        &time_left,
        &check.slots,
        &check.reserved,
        &check.spent,
        &check.state,
    ]);
    let rows = on_pooled(pool, limit, &DECIDE_SQL, &params).await?;
    match rows.first() {
        Some(r) => Ok(Some((
            r.try_get(0).map_err(column_err)?,
            r.try_get(1).map_err(column_err)?,
        ))),
        None => Ok(None),
    }
}

/// Runs `sql` (prepared once per connection) on a pooled connection, all within `limit`. A
/// connection cut off mid-statement is closed, not pooled (as the locked path's, see
/// `group_tx::within`): its statement may still be on its way.
pub(super) async fn on_pooled(
    pool: &Pool,
    limit: Duration,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<tokio_postgres::Row>, LedgerError> {
    let cut_off = || LedgerError::Unavailable("postgres did not answer in time".into());
    let started = std::time::Instant::now();
    let conn: Object = match tokio::time::timeout(limit, pool.get()).await {
        Ok(conn) => conn.map_err(super::pool_err)?,
        Err(_) => return Err(cut_off()),
    };
    let work = async {
        let statement = prepared(&conn, sql).await?;
        conn.query(&statement, params).await.map_err(super::pg_err)
    };
    match tokio::time::timeout(limit.saturating_sub(started.elapsed()), work).await {
        Ok(rows) => rows,
        Err(_) => {
            drop(Object::take(conn));
            Err(cut_off())
        }
    }
}
