//! One HTTP request: reads what Envoy offers, feeds [`Call`], carries out its effects.
//! What the headers mean, and whether a resume ticket is this request's, is decided in
//! plain Rust ([`RequestHead::from_headers`], [`RequestHead::admit_resume`],
//! [`ResponseHead::from_content_type`]).

use super::host;
use super::shared::Shared;
use crate::call::effects::{self, EditRefused};
use crate::call::reply::LocalReply;
use crate::call::{BodyStep, Call, Effect, Flow, Level, LogProps, RequestHead, ResponseHead, Step};
use crate::ledger_client::{self, Callout, Endpoint};
use crate::report;
use atmost_protocol::tool_refusal;
use atmost_protocol::OutcomeReport;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};
use std::cell::RefCell;
use std::rc::Rc;
use std::rc::Weak;

pub struct Http {
    shared: Shared,
    /// In an `Rc` so that, while the call is held for approval, the root can reach it
    /// (weakly, through [`Shared::holds`]) to hand it the ledger's answers to its re-asks
    /// ([`crate::held_calls`]).
    call: Rc<RefCell<Call>>,
    context_id: u32,
}

impl Http {
    pub fn new(shared: Shared, context_id: u32) -> Http {
        let mut call = Call::new(shared.config.clone()).with_clock(host::now_ms);
        if let Some(cache) = &shared.credentials {
            call = call.with_session_credentials(Rc::clone(cache), host::now_ms());
        }
        Http {
            shared,
            call: Rc::new(RefCell::new(call)),
            context_id,
        }
    }

    /// Lets the machine ask the root whether the batch carrying this context's report is
    /// done (the root resumed the response; a failed report is in the root's queue).
    fn sync_batch(&mut self) {
        let reporter = &self.shared.reporter;
        let context_id = self.context_id;
        self.call
            .borrow_mut()
            .check_completion_batch(|| reporter.borrow().is_waiting(context_id));
    }

    fn apply(&mut self, step: Step) -> Action {
        match carry_out(&self.shared, self.context_id, &self.call, step) {
            Flow::Continue => Action::Continue,
            Flow::Pause => Action::Pause,
        }
    }

    fn request_head(&self, end_of_stream: bool) -> RequestHead {
        let mut head = RequestHead::from_headers(
            host::headers(MapType::HttpRequestHeaders),
            &self.shared.config.permit_header,
            end_of_stream,
        );
        if let Some(key) = head.resume_key() {
            head.resume = host::take_shared(&key, |stored| head.admit_resume(stored));
        }
        // Decided by its route: a request that asks to upgrade, and one under a permit,
        // whose credential belongs to one route (crate::call::credential).
        if head.upgrade.is_some() || !head.permit.is_empty() {
            head.route = host::route_name();
        }
        head
    }
}

/// Carries out `step` of the machine `call` of HTTP context `context_id`, which must be the
/// effective context: from its own callbacks, or from the root's once it switched to it.
pub(super) fn carry_out(
    shared: &Shared,
    context_id: u32,
    call: &Rc<RefCell<Call>>,
    step: Step,
) -> Flow {
    let mut exec = Exec {
        shared,
        context_id,
        call: Rc::downgrade(call),
    };
    effects::apply(&mut call.borrow_mut(), step, &mut exec)
}

/// What carries out the machine's effects for one HTTP context.
struct Exec<'a> {
    shared: &'a Shared,
    context_id: u32,
    call: Weak<RefCell<Call>>,
}

impl Exec<'_> {
    /// Hands a completion report to the root's batch and rings its doorbell.
    fn complete(&self, held: Option<u32>, completed: OutcomeReport) {
        let doorbell = self.shared.doorbell;
        report::complete(&self.shared.reporter, held, completed, || ring(doorbell));
    }
}

/// Rings the root's doorbell (the queue `doorbell`); whether it rang.
fn ring(doorbell: Option<u32>) -> bool {
    doorbell.is_some_and(|q| hostcalls::enqueue_shared_queue(q, Some(b"!".as_slice())).is_ok())
}

/// What became of the reports that rode on the authorize of `context_id` (`landed`: the
/// answer that came; `None`: none will come): effects to the root, and the doorbell rung
/// for those that join a batch.
fn settle_riders(shared: &Shared, context_id: u32, landed: Option<&ledger_client::LedgerReply>) {
    if !shared.reporter.borrow().is_aboard(context_id) {
        return;
    }
    let (effects, must_ring) = match landed {
        Some(reply) => shared
            .reporter
            .borrow_mut()
            .landed(context_id, reply.report_acks()),
        None => shared.reporter.borrow_mut().stranded(context_id),
    };
    for effect in effects {
        shared.root_effect(effect);
    }
    if must_ring && !ring(shared.doorbell) {
        shared.reporter.borrow_mut().doorbell_failed();
    }
}

impl effects::Host for Exec<'_> {
    fn effect(&mut self, effect: Effect) -> Result<(), EditRefused> {
        match effect {
            Effect::RemoveRequestHeader(name) => {
                return host::remove_header(MapType::HttpRequestHeaders, &name).ok_or(EditRefused)
            }
            Effect::SetRequestHeader(name, value) => {
                return host::set_header(MapType::HttpRequestHeaders, &name, &value)
                    .ok_or(EditRefused)
            }
            Effect::SetRequestSecret(name, value) => {
                return host::set_header(MapType::HttpRequestHeaders, &name, value.expose())
                    .ok_or(EditRefused)
            }
            Effect::ReplaceRequestBody { original_len, body } => {
                if hostcalls::set_buffer(BufferType::HttpRequestBody, 0, original_len, &body)
                    .is_err()
                {
                    host::log(Level::Error, "atmost: could not rewrite the request body");
                    return Err(EditRefused);
                }
            }
            Effect::SetResponseHeader(name, value) => {
                return host::set_header(MapType::HttpResponseHeaders, &name, &value)
                    .ok_or(EditRefused)
            }
            Effect::RemoveResponseHeader(name) => {
                return host::remove_header(MapType::HttpResponseHeaders, &name).ok_or(EditRefused)
            }
            Effect::ReplaceResponseBody { original_len, body } => {
                if hostcalls::set_buffer(BufferType::HttpResponseBody, 0, original_len, &body)
                    .is_err()
                {
                    host::log(Level::Error, "atmost: could not rewrite the response body");
                    return Err(EditRefused);
                }
            }
            Effect::LocalReply(reply) => host::send_local_reply(&reply),
            Effect::ResumeRequest => {
                if hostcalls::resume_http_request().is_err() {
                    host::log(Level::Error, "atmost: could not resume the request");
                }
            }
            Effect::ResumeResponse => {
                if hostcalls::resume_http_response().is_err() {
                    host::log(Level::Error, "atmost: could not resume the response");
                }
            }
            Effect::Enqueue(report) => {
                let effects = self.shared.reporter.borrow_mut().enqueue(report);
                for effect in effects {
                    self.shared.root_effect(effect);
                }
            }
            Effect::Complete(completed) => self.complete(Some(self.context_id), completed),
            Effect::CompleteUnwaited(completed) => {
                let doorbell = self.shared.doorbell;
                report::release(&self.shared.reporter, host::now_ms(), completed, || {
                    ring(doorbell)
                });
            }
            Effect::HoldForApproval { wait_ms } => {
                let due_ms = host::now_ms().saturating_add(wait_ms);
                let call = self.call.clone();
                self.shared
                    .holds
                    .borrow_mut()
                    .wait(self.context_id, due_ms, call);
            }
            Effect::SaveResume(key, ticket) => host::set_shared(&key, &ticket.to_bytes()),
            Effect::Count(stat) => self.shared.metrics.inc(stat),
            Effect::Log(level, message) => host::log(level, &message),
        }
        Ok(())
    }

    fn dispatch(&mut self, callout: &Callout) -> bool {
        let cfg = &self.shared.config.ledger;
        let headers = ledger_client::headers(cfg, callout.endpoint);
        // Released calls' reports waiting for a call ride on this one's authorize.
        let riders = match callout.endpoint {
            Endpoint::Authorize => self.shared.reporter.borrow_mut().board(self.context_id),
            _ => Vec::new(),
        };
        let with_riders = callout.with_riders(&riders);
        let body = with_riders.as_deref().unwrap_or(&callout.body);
        let sent = host::dispatch(&cfg.cluster, &headers, body, cfg.timeout_ms).is_some();
        if !sent || with_riders.is_none() {
            // Not sent, or the reports could not be added: they go in a batch.
            settle_riders(self.shared, self.context_id, None);
        }
        sent
    }
}

impl Context for Http {
    fn on_http_call_response(
        &mut self,
        _token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let reply = host::callout_reply(num_headers, body_size);
        settle_riders(&self.shared, self.context_id, Some(&reply));
        let step = self.call.borrow_mut().on_ledger_reply(&reply);
        // Returned flow is meaningless in a callout callback; resumes are explicit effects.
        let _ = self.apply(step);
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let head = self.request_head(end_of_stream);
        let step = self.call.borrow_mut().on_request_headers(head);
        self.apply(step)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let body_step = self
            .call
            .borrow_mut()
            .on_request_body(body_size, end_of_stream);
        match body_step {
            BodyStep::Done(step) => self.apply(step),
            BodyStep::Read { len } => {
                let body = host::buffer(BufferType::HttpRequestBody, len);
                let step = self.call.borrow_mut().on_request_body_data(&body);
                self.apply(step)
            }
        }
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        let step = self.call.borrow_mut().on_request_trailers();
        self.apply(step)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        // Only a dispatched call watches its response; other traffic costs no lookup.
        if !self.call.borrow().watches_response_headers() {
            return Action::Continue;
        }
        // One lookup, not the whole map: this runs for every dispatched call.
        let content_type = host::header(MapType::HttpResponseHeaders, "content-type");
        let mut head = ResponseHead::from_content_type(content_type.as_deref(), end_of_stream);
        head.tool_refusal = host::header(MapType::HttpResponseHeaders, tool_refusal::HEADER)
            .map(|v| String::from_utf8_lossy(&v).into_owned());
        let step = self.call.borrow_mut().on_response_headers(head);
        self.apply(step)
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.sync_batch();
        let body_step = self
            .call
            .borrow_mut()
            .on_response_body(body_size, end_of_stream);
        match body_step {
            BodyStep::Done(step) => self.apply(step),
            BodyStep::Read { len } => {
                let bytes = host::buffer(BufferType::HttpResponseBody, len);
                let step = self
                    .call
                    .borrow_mut()
                    .on_response_body_data(&bytes, end_of_stream);
                self.apply(step)
            }
        }
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        self.sync_batch();
        let body_step = self.call.borrow_mut().on_response_trailers();
        match body_step {
            BodyStep::Done(step) => self.apply(step),
            BodyStep::Read { len } => {
                let bytes = host::buffer(BufferType::HttpResponseBody, len);
                let step = self.call.borrow_mut().on_response_body_data(&bytes, true);
                self.apply(step)
            }
        }
    }

    fn on_log(&mut self) {
        self.sync_batch();
        // An authorize still out when the request ends is never answered (Envoy cancels it).
        settle_riders(&self.shared, self.context_id, None);
        // Envoy's properties only matter for a dispatched call not settled yet.
        if self.call.borrow().is_held() {
            // The root asks no more for it; an answer still out is dropped.
            self.shared.holds.borrow_mut().forget(self.context_id);
        }
        let props = if self.call.borrow().needs_log_props() {
            LogProps {
                attempts: host::property_int(&["upstream", "request_attempt_count"]),
                flags: host::property_int(&["response", "flags"]),
            }
        } else {
            LogProps::default()
        };
        let step = self.call.borrow_mut().on_log(props);
        let _ = self.apply(step);
    }
}

/// The HTTP context used when the plugin has no valid configuration: every request is
/// refused ([`LocalReply::not_configured`]).
pub struct Refuse;

impl Context for Refuse {}

impl HttpContext for Refuse {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        host::send_local_reply(&LocalReply::not_configured());
        Action::Pause
    }
}
