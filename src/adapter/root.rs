//! The root context: reads the configuration, owns the VM's report queue and sends it
//! to the ledger on every tick.

use super::host::{self, Metrics};
use super::http::{Http, Refuse};
use crate::call::Level;
use crate::config::Config;
use crate::ledger::{self, Callout, Endpoint};
use crate::reports::{BatchResult, ReportQueue};
use crate::stats::Stat;
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
    pub metrics: Rc<Metrics>,
}

pub struct Root {
    shared: Option<Shared>,
    queue: Rc<RefCell<ReportQueue>>,
    batch_token: Option<u32>,
    /// Ticks since the batch went out; a batch with no answer after many is given up on
    /// (requeued), so one lost callback cannot stall the queue.
    batch_ticks: u64,
}

impl Root {
    pub fn new() -> Root {
        Root {
            shared: None,
            queue: Rc::new(RefCell::new(ReportQueue::new())),
            batch_token: None,
            batch_ticks: 0,
        }
    }

    fn send_batch(&mut self) {
        let Some(shared) = &self.shared else { return };
        let Some(batch) = self.queue.borrow_mut().next_batch() else {
            return;
        };
        let callout = Callout::outcomes(&batch);
        let cfg = &shared.config.ledger;
        match host::dispatch(
            &cfg.cluster,
            &ledger::headers(cfg, Endpoint::Outcomes),
            &callout.body,
            cfg.timeout_ms,
        ) {
            Some(token) => {
                self.batch_token = Some(token);
                self.batch_ticks = 0;
            }
            None => {
                self.queue
                    .borrow_mut()
                    .finish_batch(Err("dispatch failed".into()));
                shared.metrics.inc(Stat::ReportBatchFailed);
            }
        }
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
        self.shared = Some(Shared {
            config: Rc::new(config),
            queue: Rc::clone(&self.queue),
            metrics,
        });
        true
    }

    fn on_tick(&mut self) {
        if self.batch_token.is_some() {
            self.batch_ticks += 1;
            let limit = self.shared.as_ref().map_or(u64::MAX, |s| {
                (s.config.ledger.timeout_ms + 5_000) / s.config.report_interval_ms.max(1) + 1
            });
            if self.batch_ticks <= limit {
                return;
            }
            self.batch_token = None;
            self.queue
                .borrow_mut()
                .finish_batch(Err("no answer".into()));
            host::log(
                Level::Warn,
                "atmost: a batch of outcome reports got no answer; requeued",
            );
        }
        self.send_batch();
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Returning None would panic in the SDK: without a configuration every request is
        // refused instead.
        Some(match &self.shared {
            Some(shared) => Box::new(Http::new(shared.clone())),
            None => Box::new(Refuse),
        })
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
