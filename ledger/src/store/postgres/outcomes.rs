//! The outcome worker: queued outcome reports applied in groups, one transaction each.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use atmost_protocol::OutcomeReport;
use deadpool_postgres::{GenericClient, Pool};
use tokio_postgres::types::ToSql;

use super::group_queue::GroupQueue;
use super::group_tx::{within, GroupTx};
use super::one_statement::LastSeen;
use super::one_statement_outcome::try_report;
use super::rows::{load_attempts_sql, prepared, read_attempt, LOCK_PERMITS_OF_ATTEMPTS};
use super::writes::{prepare_writes, storable, update_attempts, write_counters};
use super::{answer_group, pg_err};
use crate::clock::Millis;
use crate::decide;
use crate::error::LedgerError;
use crate::model::Attempt;
use crate::store::counters::CounterMoves;
use crate::store::OutcomeResult;

/// One queued outcome report.
pub(super) struct OutcomeJob {
    pub(super) report: OutcomeReport,
    pub(super) now: Millis,
    pub(super) reply: tokio::sync::oneshot::Sender<Result<OutcomeResult, LedgerError>>,
}

/// Queued outcome reports; `Some` while a worker runs.
pub(super) type OutcomeQueue = Arc<GroupQueue<OutcomeJob>>;

/// Applies queued outcome reports in groups until none is left: each group is one transaction
/// (see [`GroupTx`]) that locks the permits of its attempts in id order (so it never waits in
/// a cycle with another transaction: every other one locks a single permit), applies the
/// reports in order and commits once. `BEGIN`, the locks and the attempts' reads go out in
/// one flight; the writes and `COMMIT` in the next.
pub(super) async fn outcome_worker(
    pool: Pool,
    op_timeout: Duration,
    queue: OutcomeQueue,
    last_seen: Option<Arc<LastSeen>>,
) {
    while let Some(jobs) = queue.next_group() {
        // A lone report first tries the one statement (`one_statement_outcome`): most come to
        // the replica that wrote their attempt.
        let jobs = match (&last_seen, <[OutcomeJob; 1]>::try_from(jobs)) {
            (Some(seen), Ok([job])) => {
                match try_report(&pool, seen, &job.report, job.now, op_timeout).await {
                    Some(result) => {
                        let _ = job.reply.send(Ok(result));
                        continue;
                    }
                    None => vec![job],
                }
            }
            (_, Ok(one)) => Vec::from(one),
            (_, Err(jobs)) => jobs,
        };
        let outcome = within(&pool, op_timeout, async |tx: &GroupTx| {
            let c = tx.client()?;
            let ids: Vec<&str> = jobs.iter().map(|j| j.report.attempt_id.as_str()).collect();
            let lock = prepared(c, LOCK_PERMITS_OF_ATTEMPTS).await?;
            let load = prepared(c, load_attempts_sql()).await?;
            prepare_writes(c).await?;
            let args: [&(dyn ToSql + Sync); 1] = [&ids];
            // The server runs the read after the locks are held, with a fresh snapshot.
            let (begun, locked, loaded) = tokio::join!(
                biased;
                tx.begin_outcomes(),
                c.query(&lock, &args),
                c.query(&load, &args)
            );
            begun?;
            locked.map_err(pg_err)?;
            let mut current: BTreeMap<String, Attempt> = loaded
                .map_err(pg_err)?
                .iter()
                .map(|row| read_attempt(row).map(|a| (a.id.clone(), a)))
                .collect::<Result<_, _>>()?;
            let mut out: Vec<Result<OutcomeResult, LedgerError>> = Vec::with_capacity(jobs.len());
            let mut moves = CounterMoves::default();
            // Reports are applied in order in memory; each attempt's last version is written
            // once, all in one statement sent with the counters and COMMIT: one round trip.
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
            // A failed write turns COMMIT into a rollback: every result is checked.
            let (rows, counters, committed) = tokio::join!(
                biased;
                update_attempts(c, &written),
                write_counters(c, &moves),
                tx.commit(None)
            );
            rows?;
            counters?;
            committed?;
            tx.committed();
            if let Some(seen) = &last_seen {
                seen.remember_attempts(written);
            }
            Ok(out)
        })
        .await;
        if let Some(seen) = &last_seen {
            seen.after_group(&outcome);
        }
        let cut_off = LedgerError::Unavailable(format!(
            "postgres did not answer within {} ms",
            op_timeout.as_millis()
        ));
        answer_group(jobs.into_iter().map(|j| j.reply), outcome, cut_off);
    }
}
