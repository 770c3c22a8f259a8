//! Batched completion reports (`completion_reports: "batched"`): the bookkeeping of the
//! root context, in plain Rust.
//!
//! A dispatched call whose answer was found holds the response (its last chunk, or the SSE
//! chunk carrying the answer) until the ledger has its `completed` report. Instead of one
//! callout per call, the HTTP context hands `(context id, report)` to this list, shared by
//! the VM's root and HTTP contexts (one VM is single-threaded), and rings the root's
//! doorbell. The root sends everything waiting (at most [`MAX_BATCH`]) in one
//! `POST /v1/outcomes`, with at most one batch out per VM: under load many calls share a
//! callout, a lone call still goes out at once. When the batch is answered every held
//! response is resumed; reports of a batch that failed go to the after-the-fact
//! [`crate::report::outcome_queue::ReportQueue`] (as a failed per-call report does) and their responses
//! are resumed too.
//!
//! With `answer_release: at_once` a report joins the same list with no context: its answer
//! went on when it was found, so nothing is resumed for it and no context waits on it; it is
//! sent, or requeued when its batch fails, like any other.

use crate::ledger_client::CalloutError;
use atmost_protocol::{OutcomeAck, OutcomeReport, OutcomesRequest, MAX_BATCH_RECEIPT_BYTES};
use std::collections::{HashSet, VecDeque};

/// Reports sent in one batch at most.
pub const MAX_BATCH: usize = 100;

/// What to do once a batch is answered (or failed).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Finished {
    /// HTTP contexts whose held response must be resumed, in batch order.
    pub resume: Vec<u32>,
    /// Reports not delivered: hand them to the after-the-fact queue.
    pub requeue: Vec<OutcomeReport>,
    /// Delivered reports the ledger did not apply (conflict, unknown attempt), by attempt id.
    pub not_applied: Vec<(String, OutcomeAck)>,
    /// Why the batch failed, if it did.
    pub failure: Option<CalloutError>,
}

/// The VM's list of completion reports waiting for the ledger.
#[derive(Debug, Default)]
pub struct Completions {
    /// Each report with the context whose response it holds (`None`: nothing is held).
    pending: VecDeque<(Option<u32>, OutcomeReport)>,
    in_flight: Vec<(Option<u32>, OutcomeReport)>,
    /// Contexts with a report pending or in flight.
    waiting: HashSet<u32>,
    /// A doorbell message is on its way to the root and not yet handled.
    rung: bool,
}

impl Completions {
    pub fn new() -> Completions {
        Completions::default()
    }

    /// Adds a report, with the context whose response waits for it (`None` when none
    /// does). Returns whether the root must be woken (no batch out and no doorbell already
    /// on its way).
    pub fn push(&mut self, held: Option<u32>, report: OutcomeReport) -> bool {
        self.pending.push_back((held, report));
        self.waiting.extend(held);
        if self.busy() || self.rung {
            false
        } else {
            self.rung = true;
            true
        }
    }

    /// Adds a report no context waits for, from the root, which sends the next batch itself
    /// right after: no doorbell to ring.
    pub fn add_sent_now(&mut self, report: OutcomeReport) {
        self.pending.push_back((None, report));
    }

    /// The root handled the doorbell (or ringing it failed).
    pub fn answered_doorbell(&mut self) {
        self.rung = false;
    }

    /// Whether the report of `context_id` is still pending or in flight.
    pub fn is_waiting(&self, context_id: u32) -> bool {
        self.waiting.contains(&context_id)
    }

    /// Whether a batch is out.
    pub fn busy(&self) -> bool {
        !self.in_flight.is_empty()
    }

    /// Reports pending (not yet sent).
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Number of reports in the batch that is out.
    pub fn in_flight_len(&self) -> usize {
        self.in_flight.len()
    }

    /// The next batch to send, if none is out and some reports wait.
    pub fn next_batch(&mut self) -> Option<OutcomesRequest> {
        if self.busy() || self.pending.is_empty() {
            return None;
        }
        let n = super::batch_len(
            self.pending.iter().map(|(_, r)| r),
            MAX_BATCH,
            MAX_BATCH_RECEIPT_BYTES,
        );
        self.in_flight = self.pending.drain(..n).collect();
        Some(OutcomesRequest {
            reports: self.in_flight.iter().map(|(_, r)| r.clone()).collect(),
        })
    }

    /// The ledger's answer for the batch that is out (`Err` = not delivered: zero headers,
    /// non-200, unreadable or incomplete answer, or the callout could not be dispatched).
    pub fn finish_batch(&mut self, acks: Result<Vec<OutcomeAck>, CalloutError>) -> Finished {
        let batch = std::mem::take(&mut self.in_flight);
        let mut done = Finished {
            resume: Vec::with_capacity(batch.len()),
            ..Finished::default()
        };
        for ctx in batch.iter().filter_map(|(ctx, _)| *ctx) {
            self.waiting.remove(&ctx);
            done.resume.push(ctx);
        }
        match acks {
            Ok(acks) => {
                done.not_applied = super::not_applied(batch.iter().map(|(_, r)| r), acks);
            }
            Err(e) => {
                done.requeue = batch.into_iter().map(|(_, r)| r).collect();
                done.failure = Some(e);
            }
        }
        done
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use atmost_protocol::Outcome;

    /// A `completed` report of attempt `a{i}` (the riders' tests use it too).
    pub(crate) fn report(i: u32) -> OutcomeReport {
        OutcomeReport {
            attempt_id: format!("a{i}"),
            round: 1,
            capability: format!("cap-{i}"),
            outcome: Outcome::Completed {
                receipt: format!(r#"{{"jsonrpc":"2.0","id":{i},"result":{{}}}}"#),
            },
        }
    }

    fn ids(b: &OutcomesRequest) -> Vec<String> {
        b.reports.iter().map(|r| r.attempt_id.clone()).collect()
    }

    #[test]
    fn lone_call_rings_and_goes_out_at_once() {
        let mut c = Completions::new();
        assert!(c.next_batch().is_none());
        assert!(c.push(Some(7), report(1)), "first report wakes the root");
        assert!(c.is_waiting(7));
        c.answered_doorbell();
        let b = c.next_batch().map(|b| ids(&b));
        assert_eq!(b, Some(vec!["a1".to_string()]));
        assert!(c.busy());
        let done = c.finish_batch(Ok(vec![OutcomeAck::Applied]));
        assert_eq!(done.resume, vec![7]);
        assert!(done.requeue.is_empty() && done.not_applied.is_empty() && done.failure.is_none());
        assert!(!c.is_waiting(7));
        assert!(!c.busy());
    }

    #[test]
    fn one_doorbell_until_answered_none_while_busy() {
        let mut c = Completions::new();
        assert!(c.push(Some(1), report(1)));
        assert!(!c.push(Some(2), report(2)), "doorbell already on its way");
        c.answered_doorbell();
        assert_eq!(c.next_batch().map(|b| b.reports.len()), Some(2));
        // While a batch is out, reports wait without ringing; the answer sends them.
        assert!(!c.push(Some(3), report(3)));
        assert!(!c.push(Some(4), report(4)));
        assert!(c.next_batch().is_none(), "one batch out at a time");
        assert!(c.is_waiting(3) && c.is_waiting(1));
        let done = c.finish_batch(Ok(vec![OutcomeAck::Applied, OutcomeAck::AlreadyRecorded]));
        assert_eq!(done.resume, vec![1, 2]);
        assert!(!c.is_waiting(1) && !c.is_waiting(2));
        assert!(c.is_waiting(3) && c.is_waiting(4));
        assert_eq!(c.pending_len(), 2);
        let b = c.next_batch().map(|b| ids(&b));
        assert_eq!(b, Some(vec!["a3".to_string(), "a4".to_string()]));
        assert_eq!(c.in_flight_len(), 2);
        // Idle again: the next report rings.
        c.finish_batch(Ok(vec![OutcomeAck::Applied; 2]));
        assert!(c.push(Some(5), report(5)));
    }

    #[test]
    fn batches_hold_at_most_max_batch() {
        let mut c = Completions::new();
        for i in 0..250 {
            c.push(Some(i), report(i));
        }
        assert_eq!(c.next_batch().map(|b| b.reports.len()), Some(MAX_BATCH));
        let done = c.finish_batch(Ok(vec![OutcomeAck::Applied; MAX_BATCH]));
        assert_eq!(done.resume, (0..100).collect::<Vec<u32>>());
        assert_eq!(
            c.next_batch().map(|b| b.reports[0].attempt_id.clone()),
            Some("a100".into())
        );
        c.finish_batch(Ok(vec![OutcomeAck::Applied; MAX_BATCH]));
        assert_eq!(c.next_batch().map(|b| b.reports.len()), Some(50));
    }

    #[test]
    fn failed_batch_resumes_and_requeues_everything() {
        let mut c = Completions::new();
        c.push(Some(1), report(1));
        c.push(Some(2), report(2));
        c.next_batch();
        let done = c.finish_batch(Err(CalloutError::Unreachable));
        assert_eq!(done.resume, vec![1, 2]);
        assert_eq!(
            done.requeue
                .iter()
                .map(|r| r.attempt_id.as_str())
                .collect::<Vec<_>>(),
            vec!["a1", "a2"]
        );
        assert_eq!(done.failure, Some(CalloutError::Unreachable));
        assert!(!c.is_waiting(1) && !c.is_waiting(2));
        assert!(c.next_batch().is_none(), "requeued reports leave this list");
    }

    #[test]
    fn not_applied_are_named_and_still_resumed() {
        let mut c = Completions::new();
        for i in 0..3 {
            c.push(Some(i), report(i));
        }
        c.next_batch();
        let done = c.finish_batch(Ok(vec![
            OutcomeAck::Applied,
            OutcomeAck::Conflict,
            OutcomeAck::UnknownAttempt,
        ]));
        assert_eq!(done.resume, vec![0, 1, 2]);
        assert_eq!(
            done.not_applied,
            vec![
                ("a1".to_string(), OutcomeAck::Conflict),
                ("a2".to_string(), OutcomeAck::UnknownAttempt)
            ]
        );
        assert!(done.requeue.is_empty());
    }

    #[test]
    fn unheld_reports_are_sent_and_requeued_but_never_resumed_nor_waited_on() {
        let mut c = Completions::new();
        assert!(
            c.push(None, report(1)),
            "an unheld report wakes the root too"
        );
        assert!(!c.push(Some(2), report(2)));
        assert!(!c.is_waiting(1), "no context waits on the unheld report");
        c.answered_doorbell();
        let b = c.next_batch().map(|b| ids(&b));
        assert_eq!(b, Some(vec!["a1".to_string(), "a2".to_string()]));
        let done = c.finish_batch(Err(CalloutError::Unreachable));
        assert_eq!(done.resume, vec![2], "only the held response is resumed");
        let requeued: Vec<&str> = done.requeue.iter().map(|r| r.attempt_id.as_str()).collect();
        assert_eq!(
            requeued,
            vec!["a1", "a2"],
            "a failed unheld report is retried"
        );
    }

    #[test]
    fn finishing_with_nothing_out_is_harmless() {
        let mut c = Completions::new();
        c.push(Some(9), report(9));
        let done = c.finish_batch(Err(CalloutError::NoAnswer));
        assert!(done.resume.is_empty() && done.requeue.is_empty());
        assert!(c.is_waiting(9), "pending report untouched");
        assert_eq!(c.pending_len(), 1);
    }
}
