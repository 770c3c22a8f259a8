//! The decision worker: queued authorize calls decided in groups, one transaction each.

use std::sync::Arc;
use std::time::Duration;

use atmost_protocol::AuthorizeRequest;
use deadpool_postgres::{GenericClient, Pool};

use super::column_err;
use super::group_queue::GroupQueue;
use super::rows::{attempts_by_keys_sql, prepared, query, read_attempt, read_permit, PERMIT_COLS};
use super::writes::{insert_attempts, storable, update_attempts, write_counters};
use super::{answer_group, pg_err, pool_err, StateSets};
use crate::clock::Millis;
use crate::decide::{self, DecideParams, Decision, Mutation};
use crate::error::LedgerError;
use crate::model::{Attempt, GuardMode, Permit};
use crate::store::counters::CounterMoves;
use crate::store::rows::{ATTEMPT_COLS, ATTEMPT_NCOLS};
use crate::store::snapshot::{self, DuplicateLookup, PermitRead, SnapshotReads};
use crate::token;

pub(super) struct AuthJob {
    pub(super) req: AuthorizeRequest,
    pub(super) params: DecideParams,
    pub(super) now: Millis,
    pub(super) reply: tokio::sync::oneshot::Sender<Result<Decision, LedgerError>>,
}

/// Queued decisions.
pub(super) type DecisionQueue = Arc<GroupQueue<AuthJob>>;

/// Takes the queued decisions, of every permit, in groups until none is left. A group is one
/// transaction: it locks the rows of the permits its calls name, in id order (as the outcome
/// transactions do, so no two transactions wait on each other in a cycle), decides them all
/// and commits once. Many agents, one permit each, then share one commit per group instead
/// of paying one per permit.
pub(super) async fn decision_worker(
    pool: Pool,
    states: StateSets,
    op_timeout: Duration,
    queue: DecisionQueue,
) {
    while let Some(jobs) = queue.next_group() {
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
                    row.try_get(7).map_err(column_err)?,
                    row.try_get(8).map_err(column_err)?,
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
    /// (permit, tool) → slots held.
    slots: std::collections::HashMap<(String, String), i64>,
    /// Index of the job among the batch's authenticated jobs → the newest attempt its
    /// duplicate guard would match.
    duplicates: std::collections::HashMap<usize, Attempt>,
}

/// One job's snapshot reads, looked up among what its batch read and the locked permits.
struct BatchLookups<'a> {
    reads: &'a BatchReads,
    permits: &'a LockedPermits,
    /// The job's position among the batch's authenticated jobs.
    pos: Option<usize>,
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
            .copied()
            .unwrap_or(0))
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
        // The batch read it by the job's position (see `read_batch`).
        Ok(self
            .pos
            .and_then(|pos| self.reads.duplicates.get(&pos))
            .cloned())
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

/// One authenticated job of a batch, with its permit and key hash.
pub(super) struct Authed<'a> {
    job: &'a AuthJob,
    permit: &'a Permit,
    key_hash: Option<String>,
}

/// Reads everything a batch's decisions need, whatever their permits, in one round trip: the
/// three statements are sent together (pipelined), after the permits' locks are held.
pub(super) async fn read_batch<C: GenericClient>(
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
            let lookup =
                DuplicateLookup::of(&a.job.req, a.permit, a.key_hash.as_deref(), a.job.now);
            dup_permits.push(lookup.permit_id);
            fps.push(lookup.fingerprint);
            kh_of.push(lookup.key_hash);
            since.push(lookup.since);
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
            row.try_get(ATTEMPT_NCOLS).map_err(column_err)?,
            row.try_get(ATTEMPT_NCOLS + 1).map_err(column_err)?,
        );
        reads.by_key.insert((permit, kh), read_attempt(&row)?);
    }
    for row in slots.map_err(pg_err)? {
        reads.slots.insert(
            (
                row.try_get(0).map_err(column_err)?,
                row.try_get(1).map_err(column_err)?,
            ),
            row.try_get(2).map_err(column_err)?,
        );
    }
    for row in dups.map_err(pg_err)? {
        let i: i64 = row.try_get(ATTEMPT_NCOLS).map_err(column_err)?;
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
pub(super) async fn decide_group<C: GenericClient>(
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
        let mut checked: Vec<(PermitRead<'_>, Option<usize>)> = Vec::with_capacity(batch.len());
        for job in batch {
            let read = permit_of(permits, job);
            let pos = read.authenticated().map(|permit| {
                authed.push(Authed {
                    job,
                    permit,
                    key_hash: decide::key_hash(&job.req),
                });
                authed.len() - 1
            });
            checked.push((read, pos));
        }
        let reads = if authed.is_empty() {
            BatchReads::default()
        } else {
            read_batch(tx, states, &authed).await?
        };
        let mut inserts: Vec<Attempt> = Vec::new();
        let mut updates: Vec<Attempt> = Vec::new();
        for (job, (read, pos)) in batch.iter().zip(checked) {
            let key_hash = pos
                .and_then(|i| authed.get(i))
                .and_then(|a| a.key_hash.as_deref());
            let mut lookups = BatchLookups {
                reads: &reads,
                permits,
                pos,
            };
            // The group's earlier decisions' counter moves are not written yet.
            let snap =
                snapshot::assemble(&job.req, read, key_hash, job.now, &mut lookups, &*moves)?;
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
