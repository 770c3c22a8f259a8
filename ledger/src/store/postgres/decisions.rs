//! The decision worker: queued authorize calls decided in groups, one transaction each.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use atmost_protocol::AuthorizeRequest;
use deadpool_postgres::{GenericClient, Pool};
use tokio_postgres::types::ToSql;

use super::column_err;
use super::group_queue::GroupQueue;
use super::group_tx::{within, GroupTx};
use super::one_statement::{try_decide, LastSeen, LoneCall, Tried};
use super::rows::{attempts_by_keys_sql, prepared, read_attempt, read_permit};
use super::writes::{
    insert_attempts, prepare_writes, storable, update_attempts, write_counters, SlotCounter,
};
use super::{answer_group, pg_err, StateSets};
use crate::clock::{Deadline, Millis};
use crate::decide::{self, DecideParams, Decision, Mutation};
use crate::error::LedgerError;
use crate::model::{Attempt, Permit};
use crate::store::counters::CounterMoves;
use crate::store::rows::{ATTEMPT_COLS, PERMIT_COLS};
use crate::store::snapshot::{self, DuplicateLookup, PermitRead, SnapshotReads};
use crate::token;

pub(super) struct AuthJob {
    pub(super) req: AuthorizeRequest,
    pub(super) params: DecideParams,
    pub(super) now: Millis,
    /// When the caller stops waiting: nothing of this job is committed after it.
    pub(super) deadline: Deadline,
    pub(super) reply: tokio::sync::oneshot::Sender<Result<Decision, LedgerError>>,
}

/// Queued decisions.
pub(super) type DecisionQueue = Arc<GroupQueue<AuthJob>>;

/// Takes the queued decisions, of every permit, in groups until none is left. A group is one
/// transaction (see [`GroupTx`]): it locks the rows of the permits its calls name, in id
/// order (as the outcome transactions do, so no two transactions wait on each other in a
/// cycle), decides them all and commits once. Many agents, one permit each, then share one
/// commit per group instead of paying one per permit. `BEGIN`, the locks and the first
/// batch's reads go out in one flight; its writes and `COMMIT` in the next.
pub(super) async fn decision_worker(
    pool: Pool,
    states: StateSets,
    op_timeout: Duration,
    queue: DecisionQueue,
    last_seen: Option<Arc<LastSeen>>,
) {
    while let Some(queued) = queue.next_group() {
        // A job whose caller gave up while it waited is answered without being decided.
        let (jobs, late): (Vec<AuthJob>, Vec<AuthJob>) =
            queued.into_iter().partition(|j| !j.deadline.passed());
        for job in late {
            let _ = job.reply.send(Err(LedgerError::deadline_passed(
                "it was decided",
                job.deadline,
            )));
        }
        // The group's deadline is its oldest member's.
        let Some(deadline) = jobs.iter().map(|j| j.deadline).min() else {
            continue;
        };
        let limit = op_timeout.min(deadline.remaining());
        // A lone call first tries the one statement (`one_statement`): most are a new key
        // under a permit this replica has just seen.
        let jobs = match (&last_seen, <[AuthJob; 1]>::try_from(jobs)) {
            (Some(last_seen), Ok([job])) => {
                let call = LoneCall {
                    req: &job.req,
                    params: &job.params,
                    now: job.now,
                    deadline: job.deadline,
                };
                match try_decide(&pool, last_seen, &states, call, limit).await {
                    Tried::Decided(decision) => {
                        let _ = job.reply.send(Ok(*decision));
                        continue;
                    }
                    Tried::Missed => vec![job],
                }
            }
            (_, Ok(one)) => Vec::from(one),
            (_, Err(jobs)) => jobs,
        };
        // What is left of it after a statement that did not apply.
        let limit = op_timeout.min(deadline.remaining());
        let outcome = within(&pool, limit, async |tx: &GroupTx| {
            let c = tx.client()?;
            let mut ids: Vec<&str> = jobs
                .iter()
                .filter_map(|j| token::permit_id_of(&j.req.permit_token))
                .collect();
            ids.sort_unstable();
            ids.dedup();
            // The locks every decision on these permits serializes on (module docs). The
            // budget totals come with them: nothing else writes them while the locks are held.
            let lock = prepared(c, lock_permits_sql()).await?;
            let statements = ReadStatements::prepare(c).await?;
            prepare_writes(c).await?;
            let key_hashes: Vec<Option<String>> =
                jobs.iter().map(|j| decide::key_hash(&j.req)).collect();
            let ends = batch_ends(&jobs);
            let first_end = ends.first().copied().unwrap_or(jobs.len());
            let first = ReadArgs::of(&jobs[..first_end], &key_hashes[..first_end]);
            let lock_args: [&(dyn ToSql + Sync); 1] = [&ids];
            let (begun, locked, first_reads) = tokio::join!(
                biased;
                tx.begin(),
                c.query(&lock, &lock_args),
                read_batch(c, &statements, &states, &first)
            );
            begun?;
            let locked = locked.map_err(pg_err)?;
            let first_reads = first_reads?;
            let mut permits = std::collections::HashMap::new();
            for row in locked {
                let p = read_permit(&row)?;
                let budget: (i64, i64) = (
                    row.try_get("reserved").map_err(column_err)?,
                    row.try_get("spent").map_err(column_err)?,
                );
                permits.insert(p.id.clone(), (p, budget));
            }
            let group = Group {
                tx,
                statements: &statements,
                states: &states,
                permits: &permits,
                jobs: &jobs,
                key_hashes: &key_hashes,
                deadline,
            };
            let mut moves = CounterMoves::default();
            // No answer leaves before the commit did: a group that cannot commit is an error.
            let decided = group.decide(&ends, first_reads, &mut moves).await?;
            tx.committed();
            if let Some(last_seen) = &last_seen {
                let locked = permits.values().map(|(p, budget)| (p, *budget));
                last_seen.remember_group(locked, &moves, &decided.read, &decided.written);
                last_seen.remember_attempts(decided.attempts);
            }
            Ok(decided.decisions)
        })
        .await;
        if let Some(last_seen) = &last_seen {
            last_seen.after_group(&outcome);
        }
        let cut_off = if limit < op_timeout {
            LedgerError::deadline_passed("its group could commit", deadline)
        } else {
            LedgerError::Unavailable(format!(
                "postgres did not answer within {} ms",
                op_timeout.as_millis()
            ))
        };
        answer_group(jobs.into_iter().map(|j| j.reply), outcome, cut_off);
    }
}

/// One index lookup per job, numbered by its position in the arrays. The window is the
/// permit's retention back from the job's `now` (as `DuplicateLookup::of` computes it;
/// `permits.retention_ms` is the policy's, written with the permit).
static DUPLICATES_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {ATTEMPT_COLS}, j.i AS job_number \
         FROM unnest($1::TEXT[], $2::TEXT[], $3::TEXT[], $4::BIGINT[]) \
         WITH ORDINALITY AS j(p, fp, kh, now, i) \
         CROSS JOIN LATERAL (SELECT retention_ms FROM permits r WHERE r.id = j.p LIMIT 1) r \
         CROSS JOIN LATERAL (SELECT * FROM attempts d WHERE d.permit_id = j.p \
         AND d.fingerprint = j.fp AND NOT (d.state = ANY($5)) AND d.created_at >= j.now - r.retention_ms \
         AND (j.kh IS NULL OR d.key_hash IS NULL OR d.key_hash <> j.kh) \
         ORDER BY d.created_at DESC LIMIT 1) a"
    )
});

/// Locks the permits `$1` in id order and reads them with their budget totals.
fn lock_permits_sql() -> &'static str {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        format!(
            "SELECT {PERMIT_COLS}, reserved, spent FROM permits WHERE id = ANY($1) ORDER BY id FOR UPDATE"
        )
    });
    &SQL
}

/// The locked permits of a group, by id, with their stored budget totals (reserved, spent).
pub(super) type LockedPermits = std::collections::HashMap<String, (Permit, (i64, i64))>;

/// The permit a job names, if it is locked (it exists), and whether the job's token
/// authenticates for it.
pub(super) fn permit_of<'a>(permits: &'a LockedPermits, job: &AuthJob) -> PermitRead<'a> {
    let permit = token::permit_id_of(&job.req.permit_token)
        .and_then(|id| permits.get(id))
        .map(|(p, _)| p);
    PermitRead::check(&job.req.permit_token, permit)
}

/// What one batch of a group read: the attempts its keys name, the slots of its tools and
/// each job's duplicate candidate.
#[derive(Default)]
pub(super) struct BatchReads {
    /// (permit, key hash) → the attempt.
    by_key: std::collections::HashMap<(String, String), Attempt>,
    /// (permit, tool) → (slots held, the counter's version).
    slots: std::collections::HashMap<(String, String), (i64, i64)>,
    /// Index of the job in its batch → the newest attempt its duplicate guard would match.
    duplicates: std::collections::HashMap<usize, Attempt>,
}

/// One job's snapshot reads, looked up among what its batch read and the locked permits.
struct BatchLookups<'a> {
    reads: &'a BatchReads,
    permits: &'a LockedPermits,
    /// The job's index in its batch.
    job: usize,
}

impl SnapshotReads for BatchLookups<'_> {
    fn key_attempt(
        &mut self,
        permit: &Permit,
        key_hash: &str,
    ) -> Result<Option<Attempt>, LedgerError> {
        Ok(self
            .reads
            .by_key
            .get(&(permit.id.clone(), key_hash.to_string()))
            .cloned())
    }

    fn slots_held(&mut self, permit: &Permit, tool: &str) -> Result<i64, LedgerError> {
        Ok(self
            .reads
            .slots
            .get(&(permit.id.clone(), tool.to_string()))
            .map_or(0, |(slots, _)| *slots))
    }

    fn budget(&mut self, permit: &Permit) -> Result<(i64, i64), LedgerError> {
        Ok(self
            .permits
            .get(&permit.id)
            .map(|(_, b)| *b)
            .unwrap_or_default())
    }

    fn recent_duplicate(
        &mut self,
        _: &DuplicateLookup<'_>,
    ) -> Result<Option<Attempt>, LedgerError> {
        // The batch read it by the job's index (see `read_batch`).
        Ok(self.reads.duplicates.get(&self.job).cloned())
    }
}

/// Splits a group into batches in which no job's reads can be changed by an earlier job of
/// the same batch: a job whose key or fingerprint an earlier job of the batch already has
/// under the same permit starts a new batch (that earlier job may write the very attempt it
/// would read). Counters are the exception, handled by [`CounterMoves`]. Returns the
/// batches' end indexes.
pub(super) fn batch_ends(jobs: &[AuthJob]) -> Vec<usize> {
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

/// What a batch reads, taken from its requests alone: the first batch's reads leave in the
/// flight that takes the locks, before the permits (their policies, whether the tokens
/// authenticate) are known. So every job that names a permit has its slots and its duplicate
/// candidate read, needed or not (one index probe each); the decisions ask only for what
/// they need, and nothing read for a token that does not authenticate is used.
#[derive(Default)]
pub(super) struct ReadArgs<'a> {
    key_permits: Vec<&'a str>,
    key_hashes: Vec<&'a str>,
    tool_permits: Vec<&'a str>,
    tool_names: Vec<&'a str>,
    dup_permits: Vec<&'a str>,
    dup_prints: Vec<&'a str>,
    dup_keys: Vec<Option<&'a str>>,
    dup_nows: Vec<Millis>,
    /// The batch index of each duplicate lookup's job.
    dup_jobs: Vec<usize>,
}

impl<'a> ReadArgs<'a> {
    /// `key_hashes[i]` is the hash of `jobs[i]`'s idempotency key.
    pub(super) fn of(jobs: &'a [AuthJob], key_hashes: &'a [Option<String>]) -> Self {
        let mut args = ReadArgs::default();
        let mut tools: Vec<(&str, &str)> = Vec::new();
        for (i, (job, key_hash)) in jobs.iter().zip(key_hashes).enumerate() {
            let Some(permit) = token::permit_id_of(&job.req.permit_token) else {
                continue;
            };
            if let Some(kh) = key_hash.as_deref() {
                args.key_permits.push(permit);
                args.key_hashes.push(kh);
            }
            tools.push((permit, job.req.tool.as_str()));
            args.dup_permits.push(permit);
            args.dup_prints.push(job.req.fingerprint.as_str());
            args.dup_keys.push(key_hash.as_deref());
            args.dup_nows.push(job.now);
            args.dup_jobs.push(i);
        }
        tools.sort_unstable();
        tools.dedup();
        (args.tool_permits, args.tool_names) = tools.into_iter().unzip();
        args
    }
}

/// The statements of a batch's reads, prepared once per connection.
pub(super) struct ReadStatements {
    keys: tokio_postgres::Statement,
    slots: tokio_postgres::Statement,
    duplicates: tokio_postgres::Statement,
}

impl ReadStatements {
    pub(super) async fn prepare<C: GenericClient>(c: &C) -> Result<Self, LedgerError> {
        Ok(ReadStatements {
            keys: prepared(c, attempts_by_keys_sql()).await?,
            slots: prepared(
                c,
                "SELECT u.p, u.t, s.slots_held, s.version FROM unnest($1::TEXT[], $2::TEXT[]) AS u(p, t) CROSS JOIN LATERAL \
                 (SELECT slots_held, version FROM permit_tool_usage x WHERE x.permit_id = u.p AND x.tool = u.t LIMIT 1) s",
            )
            .await?,
            duplicates: prepared(c, &DUPLICATES_SQL).await?,
        })
    }
}

/// Reads everything a batch's decisions need, whatever their permits: the three statements
/// are sent together (pipelined), so polled with the group's locks they share their flight.
pub(super) async fn read_batch<C: GenericClient>(
    c: &C,
    statements: &ReadStatements,
    states: &StateSets,
    args: &ReadArgs<'_>,
) -> Result<BatchReads, LedgerError> {
    let (keys, slots, dups) = tokio::join!(
        biased;
        async {
            if args.key_hashes.is_empty() {
                return Ok(Vec::new());
            }
            c.query(&statements.keys, &[&args.key_permits, &args.key_hashes])
                .await
        },
        async {
            if args.tool_permits.is_empty() {
                return Ok(Vec::new());
            }
            c.query(&statements.slots, &[&args.tool_permits, &args.tool_names])
                .await
        },
        async {
            if args.dup_prints.is_empty() {
                return Ok(Vec::new());
            }
            c.query(
                &statements.duplicates,
                &[
                    &args.dup_permits,
                    &args.dup_prints,
                    &args.dup_keys,
                    &args.dup_nows,
                    &states.gave_back,
                ],
            )
            .await
        }
    );
    let mut reads = BatchReads::default();
    for row in keys.map_err(pg_err)? {
        let (permit, kh): (String, String) = (
            row.try_get("asked_permit").map_err(column_err)?,
            row.try_get("asked_key").map_err(column_err)?,
        );
        reads.by_key.insert((permit, kh), read_attempt(&row)?);
    }
    for row in slots.map_err(pg_err)? {
        reads.slots.insert(
            (
                row.try_get(0).map_err(column_err)?,
                row.try_get(1).map_err(column_err)?,
            ),
            (
                row.try_get(2).map_err(column_err)?,
                row.try_get(3).map_err(column_err)?,
            ),
        );
    }
    for row in dups.map_err(pg_err)? {
        let i: i64 = row.try_get("job_number").map_err(column_err)?;
        // ORDINALITY counts from 1.
        let job = usize::try_from(i)
            .ok()
            .and_then(|i| i.checked_sub(1))
            .and_then(|i| args.dup_jobs.get(i).copied());
        if let Some(job) = job {
            reads.duplicates.insert(job, read_attempt(&row)?);
        }
    }
    Ok(reads)
}

/// What a group decided, and the slot counters it saw: those it read (as stored) and those it
/// wrote (as the write left them), for [`LastSeen::remember_group`].
#[derive(Default)]
pub(super) struct GroupDecided {
    pub(super) decisions: Vec<Result<Decision, LedgerError>>,
    /// (permit, tool) → (slots held, version), as read.
    pub(super) read: std::collections::HashMap<(String, String), (i64, i64)>,
    pub(super) written: Vec<SlotCounter>,
    /// The attempts it wrote, as written.
    pub(super) attempts: Vec<Attempt>,
}

/// A group inside its transaction, which holds its permits' row locks.
pub(super) struct Group<'a> {
    pub(super) tx: &'a GroupTx,
    pub(super) statements: &'a ReadStatements,
    pub(super) states: &'a StateSets,
    pub(super) permits: &'a LockedPermits,
    pub(super) jobs: &'a [AuthJob],
    /// The hash of each job's idempotency key.
    pub(super) key_hashes: &'a [Option<String>],
    /// The oldest job's deadline: the group commits before it or not at all.
    pub(super) deadline: Deadline,
}

impl Group<'_> {
    /// Decides the group's jobs in order and commits. Each batch (see [`batch_ends`]) is
    /// decided in memory on its reads (counters as stored plus the group's moves so far) and
    /// written in one round trip; the first batch's reads came with the locks (`first_reads`),
    /// a later batch's take one more round trip; the last batch's writes go with the group's
    /// counters and `COMMIT`. An `Invalid` error is one job's, raised before its writes were
    /// sent (its moves are not counted); any other error fails the group, uncommitted.
    pub(super) async fn decide(
        &self,
        ends: &[usize],
        first_reads: BatchReads,
        moves: &mut CounterMoves,
    ) -> Result<GroupDecided, LedgerError> {
        let c = self.tx.client()?;
        let mut decisions = Vec::with_capacity(self.jobs.len());
        let mut seen = GroupDecided::default();
        let mut first_reads = Some(first_reads);
        let mut start = 0;
        for &end in ends {
            let (batch, key_hashes) = (&self.jobs[start..end], &self.key_hashes[start..end]);
            start = end;
            let reads = match first_reads.take() {
                Some(reads) => reads,
                None => {
                    let args = ReadArgs::of(batch, key_hashes);
                    read_batch(c, self.statements, self.states, &args).await?
                }
            };
            // Counters are written at the end: every batch reads them as they were stored.
            seen.read
                .extend(reads.slots.iter().map(|(k, v)| (k.clone(), *v)));
            let mut inserts: Vec<Attempt> = Vec::new();
            let mut updates: Vec<Attempt> = Vec::new();
            for (i, (job, key_hash)) in batch.iter().zip(key_hashes).enumerate() {
                let mut lookups = BatchLookups {
                    reads: &reads,
                    permits: self.permits,
                    job: i,
                };
                // The group's earlier decisions' counter moves are not written yet.
                let snap = snapshot::assemble(
                    &job.req,
                    permit_of(self.permits, job),
                    key_hash.as_deref(),
                    job.now,
                    &mut lookups,
                    &*moves,
                )?;
                let decision = decide::decide(&job.req, &snap, &job.params);
                let write = match &decision.mutation {
                    Mutation::None => Ok(None),
                    Mutation::Reserve(a) => storable(a).map(|()| Some((None, a))),
                    Mutation::Update(a) => match snap.existing.as_ref().filter(|e| e.id == a.id) {
                        Some(old) => storable(a).map(|()| Some((Some(old), a))),
                        None => {
                            return Err(LedgerError::Invariant(
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
            // The last batch's writes go out with the group's counters and COMMIT, unless the
            // deadline passed already; the COMMIT carries what is left of it.
            let last = end == self.jobs.len();
            let budget = self.deadline.remaining();
            if last && budget.is_zero() {
                return Err(LedgerError::deadline_passed("the commit", self.deadline));
            }
            let (inserted, updated, counters, committed) = tokio::join!(
                biased;
                insert_attempts(c, &inserts),
                update_attempts(c, &updates),
                async {
                    if last {
                        write_counters(c, moves).await
                    } else {
                        Ok(Vec::new())
                    }
                },
                async {
                    if last {
                        self.tx.commit(Some(budget)).await
                    } else {
                        Ok(())
                    }
                }
            );
            inserted?;
            updated?;
            seen.attempts.extend(inserts.into_iter().chain(updates));
            seen.written.extend(counters?);
            committed?;
        }
        seen.decisions = decisions;
        Ok(seen)
    }
}
