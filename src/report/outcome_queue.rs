//! The VM's queue of outcome reports, sent by the root context on its tick.
//!
//! Reports made when a request ends (`on_log`) cannot be sent from the request's own
//! context: callouts still pending when that context is destroyed are cancelled. So they
//! are queued here (one queue per VM, shared by the root and the HTTP contexts; a VM is
//! single-threaded) and the root context sends them in batches. A failed batch stays
//! queued and is retried on a later tick. Past [`MAX_QUEUED`] the oldest report is dropped
//! (logged and counted); the ledger's lease sweeper then turns that attempt `uncertain`,
//! never `released`.

use crate::ledger_client::CalloutError;
use atmost_protocol::{OutcomeAck, OutcomeReport, OutcomesRequest, MAX_BATCH_RECEIPT_BYTES};
use std::collections::VecDeque;

/// Reports kept at most.
pub const MAX_QUEUED: usize = 10_000;
/// Reports sent in one `POST /v1/outcomes` at most.
pub const MAX_BATCH: usize = 100;

/// What happened to a batch, for logs and counters.
#[derive(Debug, Clone, PartialEq)]
pub enum BatchResult {
    /// Delivered; reports the ledger did not apply (conflict, unknown attempt), by attempt id.
    Delivered {
        not_applied: Vec<(String, OutcomeAck)>,
    },
    /// Not delivered; the reports are queued again.
    Requeued { count: usize },
}

/// The queue. Modelled in `ledger/model/atmost.pml` (`pend`: reports delayed, repeated or
/// lost).
#[derive(Debug, Default)]
pub struct ReportQueue {
    pending: VecDeque<OutcomeReport>,
    in_flight: Vec<OutcomeReport>,
    max_queued: usize,
}

impl ReportQueue {
    pub fn new() -> ReportQueue {
        ReportQueue::with_limit(MAX_QUEUED)
    }

    pub fn with_limit(max_queued: usize) -> ReportQueue {
        ReportQueue {
            pending: VecDeque::new(),
            in_flight: Vec::new(),
            max_queued: max_queued.max(1),
        }
    }

    /// Queues a report; returns the report dropped to make room, if any.
    pub fn push(&mut self, report: OutcomeReport) -> Option<OutcomeReport> {
        self.pending.push_back(report);
        if self.pending.len() + self.in_flight.len() > self.max_queued {
            self.pending.pop_front()
        } else {
            None
        }
    }

    pub fn len(&self) -> usize {
        self.pending.len() + self.in_flight.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether a batch is out.
    pub fn busy(&self) -> bool {
        !self.in_flight.is_empty()
    }

    /// The next batch to send, if none is out and some are queued.
    pub fn next_batch(&mut self) -> Option<OutcomesRequest> {
        if self.busy() || self.pending.is_empty() {
            return None;
        }
        let n = super::batch_len(self.pending.iter(), MAX_BATCH, MAX_BATCH_RECEIPT_BYTES);
        self.in_flight = self.pending.drain(..n).collect();
        Some(OutcomesRequest {
            reports: self.in_flight.clone(),
        })
    }

    /// Number of reports in the batch that is out.
    pub fn in_flight_len(&self) -> usize {
        self.in_flight.len()
    }

    /// The ledger's answer for the batch that is out (`Err` = not delivered).
    pub fn finish_batch(&mut self, acks: Result<Vec<OutcomeAck>, CalloutError>) -> BatchResult {
        let batch = std::mem::take(&mut self.in_flight);
        match acks {
            Ok(acks) => BatchResult::Delivered {
                not_applied: super::not_applied(batch.iter(), acks),
            },
            Err(_) => {
                let count = batch.len();
                for r in batch.into_iter().rev() {
                    self.pending.push_front(r);
                }
                while self.pending.len() > self.max_queued {
                    self.pending.pop_front();
                }
                BatchResult::Requeued { count }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use atmost_protocol::Outcome;

    fn report(i: usize) -> OutcomeReport {
        OutcomeReport {
            attempt_id: format!("a{i}"),
            round: 1,
            capability: format!("cap-{i}"),
            outcome: Outcome::Uncertain { reason: "x".into() },
        }
    }

    #[test]
    fn batches_and_retries() {
        let mut q = ReportQueue::new();
        assert!(q.next_batch().is_none());
        for i in 0..150 {
            assert!(q.push(report(i)).is_none());
        }
        let b = q.next_batch().map(|b| b.reports.len());
        assert_eq!(b, Some(100));
        assert!(q.next_batch().is_none(), "one batch out at a time");
        assert_eq!(
            q.finish_batch(Err(CalloutError::Unreachable)),
            BatchResult::Requeued { count: 100 }
        );
        // Order is kept after a failure.
        let b = q.next_batch().map(|b| b.reports);
        assert_eq!(
            b.as_ref().map(|r| r[0].attempt_id.clone()),
            Some("a0".to_string())
        );
        let mut acks = vec![OutcomeAck::Applied; 100];
        acks[3] = OutcomeAck::Conflict;
        assert_eq!(
            q.finish_batch(Ok(acks)),
            BatchResult::Delivered {
                not_applied: vec![("a3".into(), OutcomeAck::Conflict)]
            }
        );
        assert_eq!(q.len(), 50);
        assert_eq!(
            q.next_batch().map(|b| b.reports[0].attempt_id.clone()),
            Some("a100".into())
        );
    }

    #[test]
    fn bounded_drops_oldest() {
        let mut q = ReportQueue::with_limit(3);
        for i in 0..3 {
            assert!(q.push(report(i)).is_none());
        }
        assert_eq!(q.push(report(3)).map(|r| r.attempt_id), Some("a0".into()));
        assert_eq!(q.len(), 3);
    }
}
