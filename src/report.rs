//! The root context's reporting, in plain Rust: the VM's after-the-fact outcome report
//! queue ([`outcome_queue`], sent on every tick) and, with `completion_reports: batched`,
//! its batch of completion reports whose responses are held ([`completion_batch`], sent when an HTTP context rings the
//! doorbell, and again as soon as the previous batch is answered), which with
//! `answer_release: at_once` also carries reports whose answers already went on. At most one callout
//! of each kind is out; one whose answer never comes is given up on after a number of
//! ticks, so a lost callback cannot stall either list.
//!
//! Like [`crate::call::Call`], the [`Reporter`] never touches Envoy: events go in, a
//! [`Tasks`] comes out (callouts to dispatch, responses to resume, counters, logs), and
//! [`apply`] carries it out against a [`RootHost`].

pub mod completion_batch;
pub mod outcome_queue;
pub mod riders;

use crate::call::Level;
use crate::ledger_client::{Callout, CalloutError, LedgerReply};
use crate::stats::Stat;
use atmost_protocol::{OutcomeAck, OutcomeReport};
use completion_batch::{Completions, Finished};
use outcome_queue::{BatchResult, ReportQueue};
use riders::{Landed, Riders};
use std::cell::RefCell;
use std::collections::VecDeque;

/// How many of `reports`, from the first, go in one callout: at most `max_reports`, and at
/// most `max_bytes` of receipts together, but always the first one (one too large for any
/// batch goes alone).
pub fn batch_len<'a>(
    reports: impl Iterator<Item = &'a OutcomeReport>,
    max_reports: usize,
    max_bytes: usize,
) -> usize {
    let mut bytes = 0;
    reports
        .take(max_reports)
        .enumerate()
        .take_while(|(i, r)| {
            bytes += receipt_len(r);
            *i == 0 || bytes <= max_bytes
        })
        .count()
}

/// The delivered reports the ledger did not apply (conflict, unknown attempt), by attempt id,
/// from `reports` and their `acks` in order.
pub fn not_applied<'a>(
    reports: impl Iterator<Item = &'a OutcomeReport>,
    acks: Vec<OutcomeAck>,
) -> Vec<(String, OutcomeAck)> {
    reports
        .zip(acks)
        .filter(|(_, a)| matches!(a, OutcomeAck::Conflict | OutcomeAck::UnknownAttempt))
        .map(|(r, a)| (r.attempt_id.clone(), a))
        .collect()
}

/// The bytes of the receipt a report carries (0 when it carries none).
pub fn receipt_len(report: &OutcomeReport) -> usize {
    report.outcome.receipt().map_or(0, str::len)
}

/// Which of the two lists a callout carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Batch {
    /// The after-the-fact report queue.
    Reports,
    /// The completion reports whose responses are held.
    Completions,
}

/// One side effect of the root.
#[derive(Debug, Clone, PartialEq)]
pub enum RootEffect {
    /// Resume the held response of this HTTP context. A context that is gone (client hung
    /// up) refuses, which is harmless: its `on_log` already queued its report, and a
    /// repeat is acknowledged `already_recorded`.
    Resume(u32),
    Count(Stat),
    Log(Level, String),
}

/// The machine's answer to one event: effects in order, then callouts to dispatch.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Tasks {
    pub effects: Vec<RootEffect>,
    /// Each dispatched with [`Reporter::on_dispatched`] or [`Reporter::on_dispatch_failed`]
    /// told the outcome.
    pub sends: Vec<(Batch, Callout)>,
}

impl Tasks {
    fn effect(&mut self, effect: RootEffect) {
        self.effects.push(effect);
    }

    fn log(&mut self, level: Level, message: String) {
        self.effects.push(RootEffect::Log(level, message));
    }

    fn append(&mut self, mut other: Tasks) {
        self.effects.append(&mut other.effects);
        self.sends.append(&mut other.sends);
    }
}

/// A callout that is out: its token once dispatched, and ticks since.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Out {
    token: Option<u32>,
    ticks: u64,
}

/// Headroom over the callout timeout before a batch counts as lost: Envoy answers a
/// timed-out callout itself, so only a callback that never comes waits this long.
const LOST_AFTER_MS: u64 = 5_000;

/// The root's reporting state; one per VM, shared with its HTTP contexts.
#[derive(Debug, Default)]
pub struct Reporter {
    queue: ReportQueue,
    completions: Completions,
    /// Released calls' reports waiting for the next authorize (`report_ride_ms`).
    riders: Riders,
    reports_out: Option<Out>,
    completions_out: Option<Out>,
    /// Ticks after which a callout with no answer is given up on; `None` until configured
    /// (nothing is sent before).
    lost_after_ticks: Option<u64>,
}

impl Reporter {
    pub fn new() -> Reporter {
        Reporter::with_queue(ReportQueue::new())
    }

    pub fn with_queue(queue: ReportQueue) -> Reporter {
        Reporter {
            queue,
            ..Reporter::default()
        }
    }

    /// (Re)configured: the callout timeout and the tick period set when a batch is lost;
    /// `report_ride_ms` how long a released call's report waits for the next authorize (0:
    /// it does not). Reports already waiting keep waiting under the new figure.
    pub fn configure(&mut self, ledger_timeout_ms: u64, report_interval_ms: u64, ride_ms: u64) {
        self.lost_after_ticks =
            Some((ledger_timeout_ms + LOST_AFTER_MS) / report_interval_ms.max(1) + 1);
        self.riders.set_ride_ms(ride_ms);
    }

    /// Queues an after-the-fact report (an HTTP context's `on_log`); the effects (counts
    /// and logs only) say whether the queue was full and dropped its oldest.
    pub fn enqueue(&mut self, report: OutcomeReport) -> Vec<RootEffect> {
        let mut tasks = Tasks::default();
        self.push_report(report, &mut tasks);
        tasks.effects
    }

    /// Adds a completion report to the batch, with the context whose response it holds
    /// (`None` with `answer_release: at_once`: nothing waits for it). Returns whether the
    /// root must be woken (ring the doorbell); if ringing fails, call
    /// [`Reporter::doorbell_failed`] and the next tick sends it instead.
    pub fn complete(&mut self, held: Option<u32>, report: OutcomeReport) -> bool {
        self.completions.push(held, report)
    }

    /// A released call's report (`answer_release: at_once`), released at `now_ms`: it waits
    /// for the next authorize when reports ride and its receipt is not too large for that
    /// ([`Riders::takes`]), else joins the batch as
    /// [`Reporter::complete`] with no context. Returns whether the root must be woken.
    pub fn release(&mut self, now_ms: u64, report: OutcomeReport) -> bool {
        if self.riders.takes(&report) {
            self.riders.wait(now_ms, report);
            return false;
        }
        self.completions.push(None, report)
    }

    /// The reports the authorize callout of `context_id` takes along (none when none wait).
    pub fn board(&mut self, context_id: u32) -> Vec<OutcomeReport> {
        self.riders.board(context_id)
    }

    /// Whether reports ride on the authorize callout of `context_id`.
    pub fn is_aboard(&self, context_id: u32) -> bool {
        self.riders.is_aboard(context_id)
    }

    /// The authorize callout of `context_id` was answered; `acks` as its answer gave them.
    /// Riders not known to be delivered join the batch; the effects count and log what
    /// became of them, and `true` says the root must be woken.
    pub fn landed(
        &mut self,
        context_id: u32,
        acks: Result<Vec<OutcomeAck>, CalloutError>,
    ) -> (Vec<RootEffect>, bool) {
        let landed = self.riders.landed(context_id, acks);
        let mut tasks = Tasks::default();
        let ring = self.took_riders(landed, &mut tasks);
        (tasks.effects, ring)
    }

    /// The authorize callout of `context_id` will not be answered (not dispatched, or its
    /// request ended first): its riders join the batch. `true`: the root must be woken.
    pub fn stranded(&mut self, context_id: u32) -> (Vec<RootEffect>, bool) {
        let landed = Landed {
            stranded: self.riders.stranded(context_id),
            failure: Some(CalloutError::NoAnswer),
            ..Landed::default()
        };
        let mut tasks = Tasks::default();
        let ring = self.took_riders(landed, &mut tasks);
        (tasks.effects, ring)
    }

    fn took_riders(&mut self, landed: Landed, tasks: &mut Tasks) -> bool {
        for _ in 0..landed.delivered {
            tasks.effect(RootEffect::Count(Stat::ReportRode));
        }
        log_completed_not_applied(&landed.not_applied, tasks);
        if let Some(why) = &landed.failure {
            if !landed.stranded.is_empty() {
                tasks.log(
                    Level::Warn,
                    format!(
                        "atmost: {} reports riding on an authorize were not taken ({why}); sent in a batch",
                        landed.stranded.len()
                    ),
                );
            }
        }
        let mut ring = false;
        for report in landed.stranded {
            tasks.effect(RootEffect::Count(Stat::ReportRideMissed));
            ring |= self.completions.push(None, report);
        }
        ring
    }

    pub fn doorbell_failed(&mut self) {
        self.completions.answered_doorbell();
    }

    /// Whether the completion report of `context_id` is still pending or in flight.
    pub fn is_waiting(&self, context_id: u32) -> bool {
        self.completions.is_waiting(context_id)
    }

    /// Reports in the after-the-fact queue (pending and in flight).
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// The doorbell rang: send the waiting completion reports.
    pub fn on_doorbell(&mut self) -> Tasks {
        self.completions.answered_doorbell();
        self.send_completions()
    }

    /// A callout of `batch` went out as `token`.
    pub fn on_dispatched(&mut self, batch: Batch, token: u32) {
        let out = match batch {
            Batch::Reports => &mut self.reports_out,
            Batch::Completions => &mut self.completions_out,
        };
        if let Some(out) = out {
            out.token = Some(token);
        }
    }

    /// The host would not dispatch the callout of `batch`: its reports are not delivered.
    /// A failed completion batch is finished at once and the next one tried, so the held
    /// responses go on; a failed report batch waits for the next tick.
    pub fn on_dispatch_failed(&mut self, batch: Batch) -> Tasks {
        match batch {
            Batch::Reports => {
                self.reports_out = None;
                let mut tasks = Tasks::default();
                self.queue.finish_batch(Err(CalloutError::NotDispatched));
                tasks.effect(RootEffect::Count(Stat::ReportBatchFailed));
                tasks
            }
            Batch::Completions => {
                self.completions_out = None;
                let done = self
                    .completions
                    .finish_batch(Err(CalloutError::NotDispatched));
                let mut tasks = self.finish_completions(done);
                tasks.append(self.send_completions());
                tasks
            }
        }
    }

    /// The answer to callout `token` (an unknown token is not ours: ignored).
    pub fn on_callout_reply(&mut self, token: u32, reply: &LedgerReply) -> Tasks {
        if self.completions_out.is_some_and(|o| o.token == Some(token)) {
            self.completions_out = None;
            let sent = self.completions.in_flight_len();
            let done = self.completions.finish_batch(reply.outcomes(sent));
            let mut tasks = self.finish_completions(done);
            tasks.append(self.send_completions());
            return tasks;
        }
        if self.reports_out.is_none_or(|o| o.token != Some(token)) {
            return Tasks::default();
        }
        self.reports_out = None;
        let sent = self.queue.in_flight_len();
        let mut tasks = Tasks::default();
        match self.queue.finish_batch(reply.outcomes(sent)) {
            BatchResult::Delivered { not_applied } => {
                tasks.effect(RootEffect::Count(Stat::ReportBatchSent));
                for (attempt, ack) in not_applied {
                    tasks.log(
                        Level::Warn,
                        format!("atmost: ledger did not apply the report for attempt {attempt}: {ack:?}"),
                    );
                }
            }
            BatchResult::Requeued { count } => {
                tasks.effect(RootEffect::Count(Stat::ReportBatchFailed));
                tasks.log(
                    Level::Warn,
                    format!("atmost: sending {count} outcome reports failed; they stay queued"),
                );
            }
        }
        tasks
    }

    /// The root's tick at `now_ms`: gives up on callouts out too long, sends completion
    /// reports a doorbell could not announce and riders that waited long enough, and sends
    /// the next batch of the report queue.
    pub fn on_tick(&mut self, now_ms: u64) -> Tasks {
        let Some(limit) = self.lost_after_ticks else {
            return Tasks::default();
        };
        let mut tasks = Tasks::default();
        for report in self.riders.due(now_ms) {
            self.completions.add_sent_now(report);
        }
        if let Some(out) = &mut self.completions_out {
            out.ticks += 1;
            if out.ticks > limit {
                self.completions_out = None;
                let done = self.completions.finish_batch(Err(CalloutError::NoAnswer));
                tasks.append(self.finish_completions(done));
            }
        }
        tasks.append(self.send_completions());
        if let Some(out) = &mut self.reports_out {
            out.ticks += 1;
            if out.ticks <= limit {
                return tasks;
            }
            self.reports_out = None;
            self.queue.finish_batch(Err(CalloutError::NoAnswer));
            tasks.log(
                Level::Warn,
                "atmost: a batch of outcome reports got no answer; requeued".into(),
            );
        }
        if let Some(batch) = self.queue.next_batch() {
            self.reports_out = Some(Out {
                token: None,
                ticks: 0,
            });
            tasks
                .sends
                .push((Batch::Reports, Callout::outcomes(&batch)));
        }
        tasks
    }

    /// The waiting completion reports as one batch, unless one is out or none wait.
    fn send_completions(&mut self) -> Tasks {
        let mut tasks = Tasks::default();
        if self.lost_after_ticks.is_none() || self.completions_out.is_some() {
            return tasks;
        }
        if self.completions.pending_len() > 0 {
            // A batch leaves anyway: the riders go with it.
            for report in self.riders.all_waiting() {
                self.completions.add_sent_now(report);
            }
        }
        if let Some(batch) = self.completions.next_batch() {
            self.completions_out = Some(Out {
                token: None,
                ticks: 0,
            });
            tasks
                .sends
                .push((Batch::Completions, Callout::outcomes(&batch)));
        }
        tasks
    }

    /// A finished completion batch: failed reports to the after-the-fact queue, then
    /// every held response resumed.
    fn finish_completions(&mut self, done: Finished) -> Tasks {
        let mut tasks = Tasks::default();
        match &done.failure {
            None => tasks.effect(RootEffect::Count(Stat::ReportBatchSent)),
            Some(why) => {
                tasks.effect(RootEffect::Count(Stat::ReportBatchFailed));
                tasks.log(
                    Level::Warn,
                    format!(
                        "atmost: batch of {} completed reports failed ({why}); queued for retry",
                        done.requeue.len()
                    ),
                );
            }
        }
        log_completed_not_applied(&done.not_applied, &mut tasks);
        for report in done.requeue {
            tasks.effect(RootEffect::Count(Stat::ReportDeferred));
            self.push_report(report, &mut tasks);
        }
        tasks
            .effects
            .extend(done.resume.into_iter().map(RootEffect::Resume));
        tasks
    }

    fn push_report(&mut self, report: OutcomeReport, tasks: &mut Tasks) {
        if let Some(old) = self.queue.push(report) {
            tasks.effect(RootEffect::Count(Stat::ReportDropped));
            tasks.log(
                Level::Error,
                format!(
                    "atmost: report queue full; dropped the report of attempt {} (the ledger's lease sweeper will mark it uncertain)",
                    old.attempt_id
                ),
            );
        }
    }
}

/// Logs each completed (or accepted) report the ledger did not apply.
fn log_completed_not_applied(not_applied: &[(String, OutcomeAck)], tasks: &mut Tasks) {
    for (attempt, ack) in not_applied {
        tasks.log(
            Level::Warn,
            format!(
                "atmost: ledger did not apply the completed report of attempt {attempt}: {ack:?}"
            ),
        );
    }
}

/// Hands a completion report to the batch (with the context whose response it holds, if
/// any) and, when the root must be woken for it, rings the doorbell with `ring` (answering
/// whether it rang). A doorbell that did not ring leaves the report to the next tick. The
/// reporter is not borrowed while `ring` runs.
pub fn complete(
    reporter: &RefCell<Reporter>,
    held: Option<u32>,
    report: OutcomeReport,
    ring: impl FnOnce() -> bool,
) {
    let must_ring = reporter.borrow_mut().complete(held, report);
    if must_ring && !ring() {
        reporter.borrow_mut().doorbell_failed();
    }
}

/// Hands a released call's report (released at `now_ms`) to the reporter
/// ([`Reporter::release`]) and rings the doorbell with `ring` when the root must be woken,
/// as [`complete`] does.
pub fn release(
    reporter: &RefCell<Reporter>,
    now_ms: u64,
    report: OutcomeReport,
    ring: impl FnOnce() -> bool,
) {
    let must_ring = reporter.borrow_mut().release(now_ms, report);
    if must_ring && !ring() {
        reporter.borrow_mut().doorbell_failed();
    }
}

/// The name of a VM's doorbell queue: shared queues are shared by the VMs of every worker,
/// so the name carries 128 random bits no other VM's name has.
pub fn doorbell_queue_name(random: [u8; 16]) -> String {
    let hex: String = random.iter().map(|b| format!("{b:02x}")).collect();
    format!("atmost.completions.{hex}")
}

/// What carries out the root's tasks: the adapter with proxy-wasm hostcalls, tests with
/// a recorder.
pub trait RootHost {
    fn effect(&mut self, effect: RootEffect);
    /// Dispatches a ledger callout; its token, or `None` when the host would not.
    fn dispatch(&mut self, callout: &Callout) -> Option<u32>;
}

/// Carries out `tasks` and whatever the reporter answers to a callout that could not be
/// dispatched. The reporter is borrowed only between host calls: resuming a response
/// may run that HTTP context's callbacks, which consult the reporter themselves. Ends:
/// every failed dispatch takes its batch out of the list it came from.
pub fn apply(reporter: &RefCell<Reporter>, tasks: Tasks, host: &mut impl RootHost) {
    let mut work = VecDeque::from([tasks]);
    while let Some(tasks) = work.pop_front() {
        for effect in tasks.effects {
            host.effect(effect);
        }
        for (batch, callout) in tasks.sends {
            match host.dispatch(&callout) {
                Some(token) => reporter.borrow_mut().on_dispatched(batch, token),
                None => work.push_back(reporter.borrow_mut().on_dispatch_failed(batch)),
            }
        }
    }
}

#[cfg(test)]
mod tests;
