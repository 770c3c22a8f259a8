//! The root context: reads the configuration and carries out the [`Reporter`]'s tasks
//! (report queue on every tick, completion batches on the doorbell) with hostcalls.

use super::host;
use super::http::{self, Http, Refuse};
use super::shared::{Holds, Shared};
use super::verify::{VerifyHttp, VerifyRoot};
use crate::call::credential::CredentialCache;
use crate::call::{Call, Level, Step};
use crate::ledger_client::{self, Callout};
use crate::report::{self, Reporter, RootEffect, RootHost, Tasks};
use atmost_config::{Config, PluginConfig};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

/// Dequeues at most this many doorbell messages per wake-up.
const MAX_DOORBELL_DRAIN: usize = 10_000;

pub struct Root {
    context_id: u32,
    shared: Option<Shared>,
    reporter: Rc<RefCell<Reporter>>,
    /// The calls held for approval, kept across reconfigurations as the reporter is.
    holds: Holds,
    doorbell: Option<u32>,
    /// `role: "verify"`: the verifier, in place of the gateway's `shared`.
    verify: Option<VerifyRoot>,
}

/// A queue name no other VM of this vm_id uses ([`report::doorbell_queue_name`]), from WASI
/// `random_get`.
fn doorbell_name() -> Option<String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).ok()?;
    Some(report::doorbell_queue_name(bytes))
}

/// Carries out the reporter's tasks from the root context.
struct Exec<'a> {
    shared: &'a Shared,
    root_id: u32,
    /// A resume switched the effective context away from the root.
    switched: bool,
}

impl Exec<'_> {
    fn back_to_root(&mut self) {
        if self.switched {
            self.switched = false;
            let _ = hostcalls::set_effective_context(self.root_id);
        }
    }
}

impl RootHost for Exec<'_> {
    fn effect(&mut self, effect: RootEffect) {
        self.switched |= matches!(effect, RootEffect::Resume(_));
        self.shared.root_effect(effect);
    }

    fn dispatch(&mut self, callout: &Callout) -> Option<u32> {
        // An HTTP context's callouts die with it: this one must belong to the root.
        self.back_to_root();
        let cfg = &self.shared.config.ledger;
        host::dispatch(
            &cfg.cluster,
            &ledger_client::headers(cfg, callout.endpoint),
            &callout.body,
            cfg.timeout_ms,
        )
    }
}

impl Root {
    pub fn new(context_id: u32) -> Root {
        Root {
            context_id,
            shared: None,
            reporter: Rc::new(RefCell::new(Reporter::new())),
            holds: Holds::default(),
            doorbell: None,
            verify: None,
        }
    }

    fn run(&self, tasks: Tasks) {
        let Some(shared) = &self.shared else { return };
        let mut exec = Exec {
            shared,
            root_id: self.context_id,
            switched: false,
        };
        report::apply(&self.reporter, tasks, &mut exec);
        exec.back_to_root();
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
        if let Some(verify) = &mut self.verify {
            verify.on_callout(token_id, num_headers, body_size);
            return;
        }
        let reply = host::callout_reply(num_headers, body_size);
        let held = self.holds.borrow_mut().answered(token_id);
        if let Some((context_id, call)) = held {
            if let Some(call) = call.upgrade() {
                self.in_context(context_id, &call, |c| c.on_ledger_reply(&reply));
            }
            return;
        }
        let tasks = self
            .reporter
            .borrow_mut()
            .on_callout_reply(token_id, &reply);
        self.run(tasks);
    }
}

impl RootContext for Root {
    fn on_vm_start(&mut self, _vm_configuration_size: usize) -> bool {
        true
    }

    fn on_configure(&mut self, plugin_configuration_size: usize) -> bool {
        let bytes = host::buffer(BufferType::PluginConfiguration, plugin_configuration_size);
        let config = match PluginConfig::parse(&bytes) {
            Ok(PluginConfig::Gateway(c)) => c,
            Ok(PluginConfig::Verify(c)) => {
                // The verifier starts none of the gateway's machinery: no ledger reports.
                let metrics = self.metrics();
                self.ensure_doorbell();
                self.shared = None;
                self.verify = VerifyRoot::configure(c, metrics, self.doorbell, self.context_id);
                return self.verify.is_some();
            }
            Err(e) => {
                host::log(Level::Error, &e.to_string());
                return false;
            }
        };
        let metrics = self.metrics();
        self.verify = None;
        if hostcalls::set_tick_period(Duration::from_millis(config.report_interval_ms)).is_err() {
            host::log(Level::Error, "atmost: could not set the tick period");
            return false;
        }
        self.ensure_doorbell();
        self.configure_gateway(config, metrics)
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
        if let Some(verify) = &mut self.verify {
            verify.fetch_if_due();
            return;
        }
        let tasks = self.reporter.borrow_mut().on_doorbell();
        self.run(tasks);
    }

    fn on_tick(&mut self) {
        if let Some(verify) = &mut self.verify {
            verify.fetch_if_due();
            return;
        }
        let tasks = self.reporter.borrow_mut().on_tick(host::now_ms());
        self.run(tasks);
        self.reask_held();
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Returning None would panic in the SDK: without a configuration every request is
        // refused instead.
        if let Some(verify) = &self.verify {
            return Some(Box::new(VerifyHttp::new(verify.shared.clone(), context_id)));
        }
        Some(match &self.shared {
            Some(shared) => Box::new(Http::new(shared.clone(), context_id)),
            None => Box::new(Refuse),
        })
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

impl Root {
    /// Asks the ledger again about each held call whose wait is over, as the root's own
    /// callout ([`crate::held_calls`] says why the root).
    fn reask_held(&self) {
        let Some(shared) = &self.shared else { return };
        if shared.holds.borrow().is_empty() {
            return;
        }
        let due = shared.holds.borrow_mut().due(host::now_ms());
        for (context_id, call) in due {
            let call = call.upgrade();
            let callout = call.as_ref().and_then(|c| c.borrow().reask());
            let (Some(call), Some(callout)) = (call, callout) else {
                shared.holds.borrow_mut().forget(context_id);
                continue;
            };
            let cfg = &shared.config.ledger;
            let headers = ledger_client::headers(cfg, callout.endpoint);
            match host::dispatch(&cfg.cluster, &headers, &callout.body, cfg.timeout_ms) {
                Some(token) => shared.holds.borrow_mut().sent(context_id, token),
                None => {
                    shared.holds.borrow_mut().forget(context_id);
                    self.in_context(context_id, &call, Call::on_callout_failed);
                }
            }
        }
    }

    /// Hands `event` to the machine of HTTP context `context_id` and carries out its step
    /// there, as that context's own callback would; then back to the root. Envoy defers a
    /// resume or a local reply made here until the root's callback returns, so no callback
    /// of that context runs (and borrows its machine) meanwhile; it defers a callout's
    /// answer likewise, so a re-ask's token is in the table before its answer can come.
    fn in_context(
        &self,
        context_id: u32,
        call: &Rc<RefCell<Call>>,
        event: impl FnOnce(&mut Call) -> Step,
    ) {
        let Some(shared) = &self.shared else { return };
        if hostcalls::set_effective_context(context_id).is_err() {
            // The request is gone: nothing to answer.
            return;
        }
        let step = event(&mut call.borrow_mut());
        let _ = http::carry_out(shared, context_id, call, step);
        let _ = hostcalls::set_effective_context(self.context_id);
    }

    /// The counters, defined once per VM.
    fn metrics(&self) -> Rc<host::Metrics> {
        match (&self.shared, &self.verify) {
            (Some(s), _) => Rc::clone(&s.metrics),
            (None, Some(v)) => Rc::clone(&v.shared.metrics),
            (None, None) => Rc::new(host::Metrics::define()),
        }
    }

    /// Registers this VM's doorbell queue once: the root is rung by it (completion batches,
    /// or fetches of the key set a verifier's call waits for).
    fn ensure_doorbell(&mut self) {
        if self.doorbell.is_none() {
            // Without a doorbell, whatever waits for the root waits for the next tick.
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
    }

    fn configure_gateway(&mut self, config: Config, metrics: Rc<host::Metrics>) -> bool {
        self.reporter.borrow_mut().configure(
            config.ledger.timeout_ms,
            config.report_interval_ms,
            config.report_ride_ms,
        );
        let credentials = (config.credential_cache_ms > 0).then(|| {
            Rc::new(RefCell::new(CredentialCache::new(
                config.credential_cache_ms,
            )))
        });
        self.shared = Some(Shared {
            config: Rc::new(config),
            reporter: Rc::clone(&self.reporter),
            doorbell: self.doorbell,
            metrics,
            credentials,
            holds: Rc::clone(&self.holds),
        });
        true
    }
}
