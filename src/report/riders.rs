//! Reports riding on the next authorize (`report_ride_ms`): the bookkeeping of the root
//! context, in plain Rust.
//!
//! With `answer_release: at_once` a released call's report need not leave at once: the answer
//! went on, and the worker's next call asks the ledger anyway. Its report waits here, and the
//! next authorize callout of any HTTP context of the VM takes it along (at most
//! [`MAX_RIDING_REPORTS`], with at most [`MAX_RIDING_RECEIPT_BYTES`] of receipts), so at a
//! steady rate a call costs one callout, not two. What
//! becomes of each:
//!
//! - its authorize answered with one ack per rider: delivered;
//! - answered without them, not answered, not dispatched, or its request ended before the
//!   answer came: stranded, and sent again in a batch of their own (applying a report twice
//!   is acknowledged `already_recorded`);
//! - still waiting [`Riders::due`] after `report_ride_ms`: sent in a batch of their own on
//!   the root's next tick, as is every rider when a batch leaves anyway.

use crate::ledger_client::CalloutError;
use atmost_protocol::{OutcomeAck, OutcomeReport, MAX_RIDING_RECEIPT_BYTES, MAX_RIDING_REPORTS};
use std::collections::VecDeque;

/// What became of the riders of one authorize.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Landed {
    /// Delivered, and how many.
    pub delivered: usize,
    /// Delivered reports the ledger did not apply (conflict, unknown attempt), by attempt id.
    pub not_applied: Vec<(String, OutcomeAck)>,
    /// Not known to be delivered: send them in a batch.
    pub stranded: Vec<OutcomeReport>,
    /// Why they are stranded, if they are.
    pub failure: Option<CalloutError>,
}

/// The VM's reports waiting for an authorize to ride on, and those on one.
#[derive(Debug, Default)]
pub struct Riders {
    /// How long a report may wait (ms); 0: reports do not ride.
    ride_ms: u64,
    /// Each report with when it was released (ms), oldest first.
    waiting: VecDeque<(u64, OutcomeReport)>,
    /// The reports on an authorize that is out, by the HTTP context that sent it.
    aboard: Vec<(u32, Vec<OutcomeReport>)>,
}

impl Riders {
    pub fn new(ride_ms: u64) -> Riders {
        Riders {
            ride_ms,
            ..Riders::default()
        }
    }

    /// Sets how long a report may wait (0: reports do not ride, and those waiting are due).
    pub fn set_ride_ms(&mut self, ride_ms: u64) {
        self.ride_ms = ride_ms;
    }

    /// Whether reports ride at all.
    pub fn on(&self) -> bool {
        self.ride_ms > 0
    }

    /// Whether `report` may ride: reports ride at all, and its receipt alone is not larger
    /// than the receipts of one authorize may be together.
    pub fn takes(&self, report: &OutcomeReport) -> bool {
        self.on() && super::receipt_len(report) <= MAX_RIDING_RECEIPT_BYTES
    }

    /// A released call's report, released at `now_ms`, waits for the next authorize.
    pub fn wait(&mut self, now_ms: u64, report: OutcomeReport) {
        self.waiting.push_back((now_ms, report));
    }

    /// The reports the authorize of `context_id` takes along, oldest first, at most
    /// [`MAX_RIDING_REPORTS`] and [`MAX_RIDING_RECEIPT_BYTES`] of receipts; they stay aboard
    /// until [`Riders::landed`] or [`Riders::stranded`] says what became of them.
    pub fn board(&mut self, context_id: u32) -> Vec<OutcomeReport> {
        let n = super::batch_len(
            self.waiting.iter().map(|(_, r)| r),
            MAX_RIDING_REPORTS,
            MAX_RIDING_RECEIPT_BYTES,
        );
        if n == 0 {
            return Vec::new();
        }
        let reports: Vec<OutcomeReport> = self.waiting.drain(..n).map(|(_, r)| r).collect();
        self.aboard.push((context_id, reports.clone()));
        reports
    }

    /// Whether reports ride on the authorize of `context_id`.
    pub fn is_aboard(&self, context_id: u32) -> bool {
        self.aboard.iter().any(|(c, _)| *c == context_id)
    }

    /// The authorize of `context_id` was answered: `acks` as read from its answer (`Err`
    /// when it failed or carried no acks for them).
    pub fn landed(
        &mut self,
        context_id: u32,
        acks: Result<Vec<OutcomeAck>, CalloutError>,
    ) -> Landed {
        let reports = self.take_aboard(context_id);
        if reports.is_empty() {
            return Landed::default();
        }
        match acks {
            Ok(acks) if acks.len() == reports.len() => Landed {
                delivered: reports.len(),
                not_applied: super::not_applied(reports.iter(), acks),
                ..Landed::default()
            },
            Ok(acks) => Landed {
                failure: Some(CalloutError::AckCount {
                    acked: acks.len(),
                    sent: reports.len(),
                }),
                stranded: reports,
                ..Landed::default()
            },
            Err(why) => Landed {
                failure: Some(why),
                stranded: reports,
                ..Landed::default()
            },
        }
    }

    /// The reports aboard the authorize of `context_id`, which will not be answered (not
    /// dispatched, or its request ended first): to be sent in a batch.
    pub fn stranded(&mut self, context_id: u32) -> Vec<OutcomeReport> {
        self.take_aboard(context_id)
    }

    /// The waiting reports released at least `report_ride_ms` before `now_ms`.
    pub fn due(&mut self, now_ms: u64) -> Vec<OutcomeReport> {
        let ride_ms = self.ride_ms;
        let n = self
            .waiting
            .iter()
            .take_while(|(at, _)| now_ms.saturating_sub(*at) >= ride_ms)
            .count();
        self.waiting.drain(..n).map(|(_, r)| r).collect()
    }

    /// Every waiting report (a batch leaves anyway: they go with it).
    pub fn all_waiting(&mut self) -> Vec<OutcomeReport> {
        self.waiting.drain(..).map(|(_, r)| r).collect()
    }

    /// Reports waiting (not aboard).
    pub fn waiting_len(&self) -> usize {
        self.waiting.len()
    }

    fn take_aboard(&mut self, context_id: u32) -> Vec<OutcomeReport> {
        match self.aboard.iter().position(|(c, _)| *c == context_id) {
            Some(i) => self.aboard.swap_remove(i).1,
            None => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::completion_batch::tests::report;

    fn ids(reports: &[OutcomeReport]) -> Vec<String> {
        reports.iter().map(|r| r.attempt_id.clone()).collect()
    }

    #[test]
    fn the_next_authorize_takes_the_waiting_reports_at_most_sixteen_oldest_first() {
        let mut r = Riders::new(500);
        assert!(r.board(1).is_empty());
        assert!(!r.is_aboard(1));
        for i in 0..20 {
            r.wait(1_000 + u64::from(i), report(i));
        }
        let first = r.board(7);
        assert_eq!(ids(&first), ids(&(0..16).map(report).collect::<Vec<_>>()));
        assert!(r.is_aboard(7));
        assert_eq!(r.waiting_len(), 4);
        let second = r.board(8);
        assert_eq!(ids(&second), ["a16", "a17", "a18", "a19"]);
        assert_eq!(r.waiting_len(), 0);
    }

    #[test]
    fn the_receipts_of_one_authorizes_riders_stay_within_their_bytes() {
        let sized = |i: u32, bytes: usize| OutcomeReport {
            outcome: atmost_protocol::Outcome::Completed {
                receipt: "x".repeat(bytes),
            },
            ..report(i)
        };
        let mut r = Riders::new(500);
        let third = MAX_RIDING_RECEIPT_BYTES / 3;
        assert!(r.takes(&sized(0, MAX_RIDING_RECEIPT_BYTES)));
        assert!(
            !r.takes(&sized(0, MAX_RIDING_RECEIPT_BYTES + 1)),
            "too large alone"
        );
        assert!(!Riders::new(0).takes(&report(0)), "riding off");
        for i in 1..=4 {
            r.wait(0, sized(i, third));
        }
        assert_eq!(ids(&r.board(1)), ["a1", "a2", "a3"]);
        assert_eq!(ids(&r.board(2)), ["a4"]);
    }

    #[test]
    fn acked_riders_are_delivered_and_those_not_applied_named() {
        let mut r = Riders::new(500);
        r.wait(0, report(1));
        r.wait(0, report(2));
        r.board(3);
        let landed = r.landed(3, Ok(vec![OutcomeAck::Applied, OutcomeAck::Conflict]));
        assert_eq!(landed.delivered, 2);
        assert!(landed.stranded.is_empty() && landed.failure.is_none());
        assert_eq!(
            landed.not_applied,
            [("a2".to_string(), OutcomeAck::Conflict)]
        );
        assert!(!r.is_aboard(3));
        // Another context's answer, or a second answer, lands nothing.
        assert_eq!(r.landed(3, Ok(vec![])), Landed::default());
    }

    #[test]
    fn riders_without_their_acks_or_whose_request_ended_are_stranded() {
        let mut r = Riders::new(500);
        r.wait(0, report(1));
        r.board(1);
        let failed = r.landed(1, Err(CalloutError::Unreachable));
        assert_eq!(ids(&failed.stranded), ["a1"]);
        assert_eq!(failed.failure, Some(CalloutError::Unreachable));
        r.wait(0, report(2));
        r.board(2);
        let short = r.landed(2, Ok(vec![]));
        assert_eq!(ids(&short.stranded), ["a2"]);
        assert_eq!(
            short.failure,
            Some(CalloutError::AckCount { acked: 0, sent: 1 })
        );
        r.wait(0, report(3));
        r.board(3);
        assert_eq!(ids(&r.stranded(3)), ["a3"]);
        assert!(r.stranded(3).is_empty());
    }

    #[test]
    fn a_report_is_due_once_it_waited_report_ride_ms() {
        let mut r = Riders::new(500);
        r.wait(1_000, report(1));
        r.wait(1_300, report(2));
        assert!(r.due(1_499).is_empty());
        assert_eq!(ids(&r.due(1_500)), ["a1"]);
        assert_eq!(ids(&r.due(1_800)), ["a2"]);
        r.wait(2_000, report(3));
        r.wait(2_001, report(4));
        assert_eq!(ids(&r.all_waiting()), ["a3", "a4"]);
        assert!(!Riders::new(0).on() && r.on());
    }
}
