//! One HTTP request: reads what Envoy offers, feeds [`Call`], carries out its effects.
//! What the headers mean, and whether a resume ticket is this request's, is decided in
//! plain Rust ([`RequestHead::from_headers`], [`RequestHead::admit_resume`],
//! [`ResponseHead::from_content_type`]).

use super::host;
use super::shared::Shared;
use crate::call::effects::{self, Refused};
use crate::call::reply::LocalReply;
use crate::call::{BodyStep, Call, Effect, Flow, Level, LogProps, RequestHead, ResponseHead, Step};
use crate::ledger_client::{self, Callout};
use crate::report;
use atmost_protocol::tool_refusal;
use atmost_protocol::OutcomeReport;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};
use std::rc::Rc;

pub struct Http {
    shared: Shared,
    call: Call,
    context_id: u32,
}

impl Http {
    pub fn new(shared: Shared, context_id: u32) -> Http {
        let mut call = Call::new(shared.config.clone());
        if let Some(cache) = &shared.credentials {
            call = call.with_session_credentials(Rc::clone(cache), host::now_ms());
        }
        Http {
            shared,
            call,
            context_id,
        }
    }

    /// Lets the machine ask the root whether the batch carrying this context's report is
    /// done (the root resumed the response; a failed report is in the root's queue).
    fn sync_batch(&mut self) {
        let reporter = &self.shared.reporter;
        let context_id = self.context_id;
        self.call
            .check_completion_batch(|| reporter.borrow().is_waiting(context_id));
    }

    fn apply(&mut self, step: Step) -> Action {
        let mut exec = Exec {
            shared: &self.shared,
            context_id: self.context_id,
        };
        match effects::apply(&mut self.call, step, &mut exec) {
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

/// What carries out the machine's effects for one HTTP context.
struct Exec<'a> {
    shared: &'a Shared,
    context_id: u32,
}

impl Exec<'_> {
    /// Hands a completion report to the root's batch and rings its doorbell.
    fn complete(&self, held: Option<u32>, completed: OutcomeReport) {
        let doorbell = self.shared.doorbell;
        report::complete(&self.shared.reporter, held, completed, || {
            doorbell
                .is_some_and(|q| hostcalls::enqueue_shared_queue(q, Some(b"!".as_slice())).is_ok())
        });
    }
}

impl effects::Host for Exec<'_> {
    fn effect(&mut self, effect: Effect) -> Result<(), Refused> {
        match effect {
            Effect::RemoveRequestHeader(name) => {
                return host::remove_header(MapType::HttpRequestHeaders, &name).ok_or(Refused)
            }
            Effect::SetRequestHeader(name, value) => {
                return host::set_header(MapType::HttpRequestHeaders, &name, &value).ok_or(Refused)
            }
            Effect::SetRequestSecret(name, value) => {
                return host::set_header(MapType::HttpRequestHeaders, &name, value.expose())
                    .ok_or(Refused)
            }
            Effect::ReplaceRequestBody { original_len, body } => {
                if hostcalls::set_buffer(BufferType::HttpRequestBody, 0, original_len, &body)
                    .is_err()
                {
                    host::log(Level::Error, "atmost: could not rewrite the request body");
                    return Err(Refused);
                }
            }
            Effect::SetResponseHeader(name, value) => {
                return host::set_header(MapType::HttpResponseHeaders, &name, &value).ok_or(Refused)
            }
            Effect::RemoveResponseHeader(name) => {
                return host::remove_header(MapType::HttpResponseHeaders, &name).ok_or(Refused)
            }
            Effect::ReplaceResponseBody { original_len, body } => {
                if hostcalls::set_buffer(BufferType::HttpResponseBody, 0, original_len, &body)
                    .is_err()
                {
                    host::log(Level::Error, "atmost: could not rewrite the response body");
                    return Err(Refused);
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
            Effect::CompleteUnwaited(completed) => self.complete(None, completed),
            Effect::SaveResume(key, ticket) => host::set_shared(&key, &ticket.to_bytes()),
            Effect::Count(stat) => self.shared.metrics.inc(stat),
            Effect::Log(level, message) => host::log(level, &message),
        }
        Ok(())
    }

    fn dispatch(&mut self, callout: &Callout) -> bool {
        let cfg = &self.shared.config.ledger;
        let headers = ledger_client::headers(cfg, callout.endpoint);
        host::dispatch(&cfg.cluster, &headers, &callout.body, cfg.timeout_ms).is_some()
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
        let step = self.call.on_ledger_reply(&reply);
        // Returned flow is meaningless in a callout callback; resumes are explicit effects.
        let _ = self.apply(step);
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let head = self.request_head(end_of_stream);
        let step = self.call.on_request_headers(head);
        self.apply(step)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        match self.call.on_request_body(body_size, end_of_stream) {
            BodyStep::Done(step) => self.apply(step),
            BodyStep::Read { len } => {
                let body = host::buffer(BufferType::HttpRequestBody, len);
                let step = self.call.on_request_body_data(&body);
                self.apply(step)
            }
        }
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        let step = self.call.on_request_trailers();
        self.apply(step)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        // Only a dispatched call watches its response; other traffic costs no lookup.
        if !self.call.watches_response_headers() {
            return Action::Continue;
        }
        // One lookup, not the whole map: this runs for every dispatched call.
        let content_type = host::header(MapType::HttpResponseHeaders, "content-type");
        let mut head = ResponseHead::from_content_type(content_type.as_deref(), end_of_stream);
        head.tool_refusal = host::header(MapType::HttpResponseHeaders, tool_refusal::HEADER)
            .map(|v| String::from_utf8_lossy(&v).into_owned());
        let step = self.call.on_response_headers(head);
        self.apply(step)
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.sync_batch();
        match self.call.on_response_body(body_size, end_of_stream) {
            BodyStep::Done(step) => self.apply(step),
            BodyStep::Read { len } => {
                let bytes = host::buffer(BufferType::HttpResponseBody, len);
                let step = self.call.on_response_body_data(&bytes, end_of_stream);
                self.apply(step)
            }
        }
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        self.sync_batch();
        match self.call.on_response_trailers() {
            BodyStep::Done(step) => self.apply(step),
            BodyStep::Read { len } => {
                let bytes = host::buffer(BufferType::HttpResponseBody, len);
                let step = self.call.on_response_body_data(&bytes, true);
                self.apply(step)
            }
        }
    }

    fn on_log(&mut self) {
        self.sync_batch();
        // Envoy's properties only matter for a dispatched call not settled yet.
        let props = if self.call.needs_log_props() {
            LogProps {
                attempts: host::property_int(&["upstream", "request_attempt_count"]),
                flags: host::property_int(&["response", "flags"]),
            }
        } else {
            LogProps::default()
        };
        let step = self.call.on_log(props);
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
