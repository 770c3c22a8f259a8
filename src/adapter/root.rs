//! The root context: reads the configuration, owns the VM's report queue (sent to the
//! ledger on every tick) and, with `completion_reports: batched`, the VM's batch of
//! completion reports (sent when an HTTP context rings the doorbell queue, and again as
//! soon as the previous batch is answered).

use super::host::{self, Metrics};
use super::http::{Http, Refuse};
use crate::call::Level;
use crate::completions::{Completions, Finished};
use crate::ledger::{self, Callout, Endpoint};
use crate::reports::{BatchResult, ReportQueue};
use crate::stats::Stat;
use atmost_config::{Config, LedgerConfig};
use atmost_protocol::OutcomesRequest;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

/// What the HTTP contexts share with the root.
#[derive(Clone)]
pub struct Shared {
    pub config: Rc<Config>,
    pub queue: Rc<RefCell<ReportQueue>>,
    pub completions: Rc<RefCell<Completions>>,
    /// The root's doorbell: a shared queue registered under a name unique to this VM.
    pub doorbell: Option<u32>,
    pub metrics: Rc<Metrics>,
}

/// Dequeues at most this many doorbell messages per wake-up.
const MAX_DOORBELL_DRAIN: usize = 10_000;

pub struct Root {
    context_id: u32,
    shared: Option<Shared>,
    queue: Rc<RefCell<ReportQueue>>,
    completions: Rc<RefCell<Completions>>,
    doorbell: Option<u32>,
    batch_token: Option<u32>,
    /// Ticks since the batch went out; a batch with no answer after many is given up on
    /// (requeued), so one lost callback cannot stall the queue.
    batch_ticks: u64,
    /// The batch of completion reports that is out, and ticks since it went out.
    completion_token: Option<u32>,
    completion_ticks: u64,
}

/// `POST /v1/outcomes` with `batch` to the ledger; the callout's token, or `None` if it could
/// not be dispatched.
fn dispatch_outcomes(cfg: &LedgerConfig, batch: &OutcomesRequest) -> Option<u32> {
    let callout = Callout::outcomes(batch);
    host::dispatch(
        &cfg.cluster,
        &ledger::headers(cfg, Endpoint::Outcomes),
        &callout.body,
        cfg.timeout_ms,
    )
}

/// A queue name no other VM of this vm_id uses (shared queues are shared by the VMs of
/// every worker): 128 random bits from WASI `random_get`.
fn doorbell_name() -> Option<String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).ok()?;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    Some(format!("atmost.completions.{hex}"))
}

impl Root {
    pub fn new(context_id: u32) -> Root {
        Root {
            context_id,
            shared: None,
            queue: Rc::new(RefCell::new(ReportQueue::new())),
            completions: Rc::new(RefCell::new(Completions::new())),
            doorbell: None,
            batch_token: None,
            batch_ticks: 0,
            completion_token: None,
            completion_ticks: 0,
        }
    }

    fn timeout_ticks(&self) -> u64 {
        self.shared.as_ref().map_or(u64::MAX, |s| {
            (s.config.ledger.timeout_ms + 5_000) / s.config.report_interval_ms.max(1) + 1
        })
    }

    fn send_batch(&mut self) {
        let Some(shared) = &self.shared else { return };
        let Some(batch) = self.queue.borrow_mut().next_batch() else {
            return;
        };
        match dispatch_outcomes(&shared.config.ledger, &batch) {
            Some(token) => {
                self.batch_token = Some(token);
                self.batch_ticks = 0;
            }
            None => {
                self.queue
                    .borrow_mut()
                    .finish_batch(Err(ledger::LedgerError::NotDispatched));
                shared.metrics.inc(Stat::ReportBatchFailed);
            }
        }
    }

    /// Sends the waiting completion reports as one batch, unless one is out.
    fn send_completions(&mut self) {
        // A batch that cannot even be dispatched is finished at once (its responses are
        // resumed, its reports queued); bounded so a dead cluster cannot loop forever.
        for _ in 0..1_000 {
            if self.completion_token.is_some() {
                return;
            }
            let Some(shared) = self.shared.clone() else {
                return;
            };
            let Some(batch) = self.completions.borrow_mut().next_batch() else {
                return;
            };
            // Resuming HTTP contexts switched the effective context: the callout must
            // belong to the root (an HTTP context's callouts die with it).
            let _ = hostcalls::set_effective_context(self.context_id);
            match dispatch_outcomes(&shared.config.ledger, &batch) {
                Some(token) => {
                    self.completion_token = Some(token);
                    self.completion_ticks = 0;
                    return;
                }
                None => {
                    let done = self
                        .completions
                        .borrow_mut()
                        .finish_batch(Err(ledger::LedgerError::NotDispatched));
                    self.finish_completions(&shared, done);
                }
            }
        }
    }

    /// Carries out a finished completion batch: failed reports to the after-the-fact
    /// queue, then every held response resumed.
    fn finish_completions(&self, shared: &Shared, done: Finished) {
        match &done.failure {
            None => shared.metrics.inc(Stat::ReportBatchSent),
            Some(why) => {
                shared.metrics.inc(Stat::ReportBatchFailed);
                host::log(
                    Level::Warn,
                    &format!(
                        "atmost: batch of {} completed reports failed ({why}); queued for retry",
                        done.requeue.len()
                    ),
                );
            }
        }
        for (attempt, ack) in &done.not_applied {
            host::log(
                Level::Warn,
                &format!(
                    "atmost: ledger did not apply the completed report of attempt {attempt}: {ack:?}"
                ),
            );
        }
        for report in done.requeue {
            shared.metrics.inc(Stat::ReportDeferred);
            let dropped = self.queue.borrow_mut().push(report);
            if let Some(old) = dropped {
                shared.metrics.inc(Stat::ReportDropped);
                host::log(
                    Level::Error,
                    &format!(
                        "atmost: report queue full; dropped the report of attempt {} (the ledger's lease sweeper will mark it uncertain)",
                        old.attempt_id
                    ),
                );
            }
        }
        for context_id in done.resume {
            // A context that is gone (client hung up) refuses: its on_log already queued
            // its report, and a repeat is acknowledged `already_recorded`.
            if hostcalls::set_effective_context(context_id).is_ok() {
                let _ = hostcalls::resume_http_response();
            }
        }
        let _ = hostcalls::set_effective_context(self.context_id);
    }
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        if self.completion_token == Some(token_id) {
            self.completion_token = None;
            let reply = host::callout_reply(num_headers, body_size);
            let sent = self.completions.borrow().in_flight_len();
            let done = self
                .completions
                .borrow_mut()
                .finish_batch(reply.outcomes(sent));
            if let Some(shared) = self.shared.clone() {
                self.finish_completions(&shared, done);
            }
            self.send_completions();
            return;
        }
        if self.batch_token != Some(token_id) {
            return;
        }
        self.batch_token = None;
        let reply = host::callout_reply(num_headers, body_size);
        let sent = self.queue.borrow().in_flight_len();
        let result = self.queue.borrow_mut().finish_batch(reply.outcomes(sent));
        let Some(shared) = &self.shared else { return };
        match result {
            BatchResult::Delivered { not_applied } => {
                shared.metrics.inc(Stat::ReportBatchSent);
                for (attempt, ack) in not_applied {
                    host::log(
                        Level::Warn,
                        &format!("atmost: ledger did not apply the report for attempt {attempt}: {ack:?}"),
                    );
                }
            }
            BatchResult::Requeued { count } => {
                shared.metrics.inc(Stat::ReportBatchFailed);
                host::log(
                    Level::Warn,
                    &format!("atmost: sending {count} outcome reports failed; they stay queued"),
                );
            }
        }
    }
}

impl RootContext for Root {
    fn on_vm_start(&mut self, _vm_configuration_size: usize) -> bool {
        true
    }

    fn on_configure(&mut self, plugin_configuration_size: usize) -> bool {
        let bytes = host::buffer(BufferType::PluginConfiguration, plugin_configuration_size);
        let config = match Config::parse(&bytes) {
            Ok(c) => c,
            Err(e) => {
                host::log(Level::Error, &e.to_string());
                return false;
            }
        };
        let metrics = match &self.shared {
            Some(s) => Rc::clone(&s.metrics),
            None => Rc::new(Metrics::define()),
        };
        if hostcalls::set_tick_period(Duration::from_millis(config.report_interval_ms)).is_err() {
            host::log(Level::Error, "atmost: could not set the tick period");
            return false;
        }
        if self.doorbell.is_none() {
            // Without a doorbell, waiting completion reports go out on the next tick.
            self.doorbell = match doorbell_name() {
                Some(name) => match hostcalls::register_shared_queue(&name) {
                    Ok(id) => Some(id),
                    Err(status) => {
                        host::log(
                            Level::Warn,
                            &format!("atmost: could not register the completion doorbell queue ({status:?}); completion reports wait for the tick"),
                        );
                        None
                    }
                },
                None => {
                    host::log(
                        Level::Warn,
                        "atmost: no random bytes for the completion doorbell queue; completion reports wait for the tick",
                    );
                    None
                }
            };
        }
        self.shared = Some(Shared {
            config: Rc::new(config),
            queue: Rc::clone(&self.queue),
            completions: Rc::clone(&self.completions),
            doorbell: self.doorbell,
            metrics,
        });
        true
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        if self.doorbell != Some(queue_id) {
            return;
        }
        for _ in 0..MAX_DOORBELL_DRAIN {
            match hostcalls::dequeue_shared_queue(queue_id) {
                Ok(Some(_)) => {}
                _ => break,
            }
        }
        self.completions.borrow_mut().answered_doorbell();
        self.send_completions();
    }

    fn on_tick(&mut self) {
        let limit = self.timeout_ticks();
        if self.completion_token.is_some() {
            self.completion_ticks += 1;
            if self.completion_ticks > limit {
                self.completion_token = None;
                let done = self
                    .completions
                    .borrow_mut()
                    .finish_batch(Err(ledger::LedgerError::NoAnswer));
                if let Some(shared) = self.shared.clone() {
                    self.finish_completions(&shared, done);
                }
            }
        }
        // Safety net for a doorbell that could not ring.
        self.send_completions();
        if self.batch_token.is_some() {
            self.batch_ticks += 1;
            if self.batch_ticks <= limit {
                return;
            }
            self.batch_token = None;
            self.queue
                .borrow_mut()
                .finish_batch(Err(ledger::LedgerError::NoAnswer));
            host::log(
                Level::Warn,
                "atmost: a batch of outcome reports got no answer; requeued",
            );
        }
        self.send_batch();
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Returning None would panic in the SDK: without a configuration every request is
        // refused instead.
        Some(match &self.shared {
            Some(shared) => Box::new(Http::new(shared.clone(), context_id)),
            None => Box::new(Refuse),
        })
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
