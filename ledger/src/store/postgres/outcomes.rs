//! The outcome worker: queued outcome reports applied in groups, one transaction each.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use atmost_protocol::OutcomeReport;
use deadpool_postgres::{GenericClient, Pool};

use super::group_queue::GroupQueue;
use super::rows::lock_then_load;
use super::writes::{storable, update_attempts, write_counters};
use super::{answer_group, pg_err, pool_err};
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
/// that locks the permits of its attempts in id order (so it never waits in a cycle with
/// another transaction: every other one locks a single permit), applies the reports in order
/// and commits once.
pub(super) async fn outcome_worker(pool: Pool, op_timeout: Duration, queue: OutcomeQueue) {
    while let Some(jobs) = queue.next_group() {
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
