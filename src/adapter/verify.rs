//! `role: "verify"`: the root context's part (the key set's fetches, finishing the calls
//! that waited for one) and the HTTP context, over [`crate::verify`]. No decisions here.
//!
//! A call naming an unknown `keyid` pauses and rings the root's doorbell (the shared queue
//! the gateway uses for its completion batches); the root fetches the JWKS with a callout of
//! its own, which no HTTP context's end can cancel, and finishes every waiting call in that
//! call's context ([`hostcalls::set_effective_context`]).

use super::host::{self, Metrics};
use crate::call::{BodyStep, Effect, Flow, Level, RequestHead, Step};
use crate::verify::check::SignedHead;
use crate::verify::keys;
use crate::verify::replay::{SharedSlots, SlotValue};
use crate::verify::{Verdict, Verifier, VerifyCall};
use atmost_config::VerifyConfig;
use atmost_protocol::tool_refusal::HEADER;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

/// The root's tick in this role: how soon a fetch is started when the doorbell could not
/// ring, and the resolution of `verify.jwks.refresh_ms`.
const TICK_MS: u64 = 1000;

/// Envoy's shared data, as the replay cache's slots.
struct HostSlots;

impl SharedSlots for HostSlots {
    fn get(&mut self, key: &str) -> Option<SlotValue> {
        match hostcalls::get_shared_data(key) {
            // An existing key always has a version; an empty value may come without bytes.
            Ok((bytes, Some(version))) => Some(SlotValue {
                bytes: bytes.unwrap_or_default(),
                version,
            }),
            _ => None,
        }
    }

    fn set(&mut self, key: &str, value: &[u8], version: u32) -> bool {
        hostcalls::set_shared_data(key, Some(value), Some(version)).is_ok()
    }

    fn create(&mut self, key: &str) {
        host::set_shared(key, &[]);
    }
}

/// Carries out a verifier's step in the current context; returns its flow.
fn apply(metrics: &Metrics, step: Step) -> Flow {
    for effect in step.effects {
        match effect {
            Effect::LocalReply(reply) => host::send_local_reply(&reply),
            Effect::Count(stat) => metrics.inc(stat),
            Effect::Log(level, message) => host::log(level, &message),
            // The verifier edits nothing of a request it lets through.
            other => host::log(
                Level::Error,
                &format!("atmost: the verifier cannot carry out {other:?}"),
            ),
        }
    }
    step.flow
}

/// What the root shares with its HTTP contexts in this role.
#[derive(Clone)]
pub struct VerifyShared {
    pub config: Rc<VerifyConfig>,
    pub verifier: Rc<RefCell<Verifier>>,
    pub metrics: Rc<Metrics>,
    pub doorbell: Option<u32>,
}

/// The root context's part.
pub struct VerifyRoot {
    pub shared: VerifyShared,
    root_id: u32,
    /// The fetch under way.
    token: Option<u32>,
}

impl VerifyRoot {
    /// Sets the verifier up: the replay cache's slots created where missing, the tick, and
    /// the first fetch of the key set.
    pub fn configure(
        config: VerifyConfig,
        metrics: Rc<Metrics>,
        doorbell: Option<u32>,
        root_id: u32,
    ) -> Option<VerifyRoot> {
        let config = Rc::new(config);
        let verifier = Verifier::new(Rc::clone(&config));
        verifier.cache().create_slots(&mut HostSlots);
        if let Some(jwks) = &verifier.config().jwks {
            let tick = jwks.refresh_ms.min(TICK_MS);
            if hostcalls::set_tick_period(Duration::from_millis(tick)).is_err() {
                host::log(Level::Error, "atmost: could not set the tick period");
                return None;
            }
        }
        let mut root = VerifyRoot {
            shared: VerifyShared {
                config,
                verifier: Rc::new(RefCell::new(verifier)),
                metrics,
                doorbell,
            },
            root_id,
            token: None,
        };
        root.fetch_if_due();
        Some(root)
    }

    /// Starts a fetch of the key set if one is asked for or due.
    pub fn fetch_if_due(&mut self) {
        let now = host::now_ms();
        let source = {
            let Ok(mut verifier) = self.shared.verifier.try_borrow_mut() else {
                return;
            };
            if !verifier.begin_refresh(now) {
                return;
            }
            verifier.config().jwks.clone()
        };
        let Some(source) = source else { return };
        let headers = keys::jwks_request_headers(&source);
        let hs: Vec<(&str, &str)> = headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        match hostcalls::dispatch_http_call(
            &source.cluster,
            hs,
            None,
            Vec::new(),
            Duration::from_millis(source.timeout_ms),
        ) {
            Ok(token) => self.token = Some(token),
            Err(status) => {
                host::log(
                    Level::Warn,
                    &format!(
                        "atmost: could not fetch the key set from cluster `{}`: {status:?}",
                        source.cluster
                    ),
                );
                self.fetched(None);
            }
        }
    }

    /// A callout answered; `true` when it was this role's fetch.
    pub fn on_callout(&mut self, token: u32, num_headers: usize, body_size: usize) -> bool {
        if self.token != Some(token) {
            return false;
        }
        self.token = None;
        let reply = host::callout_reply(num_headers, body_size);
        let body = (reply.status == Some(200)).then_some(reply.body);
        if body.is_none() {
            host::log(
                Level::Warn,
                &format!(
                    "atmost: the key set fetch failed (status {:?}); the last keys stay",
                    reply.status
                ),
            );
        }
        self.fetched(body.as_deref());
        true
    }

    /// The fetch ended: counts it and finishes every call that waited for it, each in its
    /// own context.
    fn fetched(&mut self, body: Option<&[u8]>) {
        let (stat, finished) = {
            let Ok(mut verifier) = self.shared.verifier.try_borrow_mut() else {
                return;
            };
            verifier.on_keys(body, host::now_ms(), &mut HostSlots)
        };
        self.shared.metrics.inc(stat);
        for (context_id, step) in finished {
            if hostcalls::set_effective_context(context_id).is_err() {
                continue;
            }
            if apply(&self.shared.metrics, step) == Flow::Continue
                && hostcalls::resume_http_request().is_err()
            {
                host::log(Level::Error, "atmost: could not resume a verified request");
            }
        }
        let _ = hostcalls::set_effective_context(self.root_id);
    }
}

/// One request in front of the tool.
pub struct VerifyHttp {
    shared: VerifyShared,
    call: VerifyCall,
    context_id: u32,
    /// This context sent a local reply of its own (a refusal).
    replied: bool,
}

impl VerifyHttp {
    pub fn new(shared: VerifyShared, context_id: u32) -> VerifyHttp {
        VerifyHttp {
            call: VerifyCall::new(Rc::clone(&shared.config)),
            shared,
            context_id,
            replied: false,
        }
    }

    fn apply(&mut self, step: Step) -> Action {
        self.replied |= step
            .effects
            .iter()
            .any(|e| matches!(e, Effect::LocalReply(_)));
        match apply(&self.shared.metrics, step) {
            Flow::Continue => Action::Continue,
            Flow::Pause => Action::Pause,
        }
    }
}

impl Context for VerifyHttp {}

impl HttpContext for VerifyHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let headers = host::headers(MapType::HttpRequestHeaders);
        let signed = SignedHead::from_headers(headers.iter().map(|(k, v)| (k.as_str(), v)));
        // The verifier has no permit header: no name is read as one.
        let mut head = RequestHead::from_headers(headers, "", end_of_stream);
        // Only a request that asks to upgrade is decided by its route.
        if head.upgrade.is_some() {
            head.route = host::route_name();
        }
        let step = self.call.on_request_headers(head, signed);
        self.apply(step)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let len = match self.call.on_request_body(body_size, end_of_stream) {
            BodyStep::Done(step) => return self.apply(step),
            BodyStep::Read { len } => len,
        };
        let body = host::buffer(BufferType::HttpRequestBody, len);
        let verdict = {
            let Ok(mut verifier) = self.shared.verifier.try_borrow_mut() else {
                return Action::Pause;
            };
            self.call.on_request_body_data(
                &body,
                &mut verifier,
                self.context_id,
                host::now_ms(),
                &mut HostSlots,
            )
        };
        match verdict {
            Verdict::Now(step) => self.apply(step),
            Verdict::Wait { ring } => {
                // Without the doorbell, the root starts the fetch on its next tick.
                if ring {
                    if let Some(queue) = self.shared.doorbell {
                        let _ = hostcalls::enqueue_shared_queue(queue, Some(b"k".as_slice()));
                    }
                }
                Action::Pause
            }
        }
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        let step = self.call.on_request_trailers();
        self.apply(step)
    }

    /// A response from the server never carries a refusal header through: only this verifier
    /// writes one, on its own refusals, so a server cannot pass off an answer as a refusal
    /// the ledger would take for proof (docs/signatures.md, "A refusal at the tool").
    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let ours = self.replied
            || self
                .shared
                .verifier
                .try_borrow()
                .is_ok_and(|v| v.refused_after_wait(self.context_id));
        if !ours {
            let _ = host::remove_header(MapType::HttpResponseHeaders, HEADER);
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        if let Ok(mut verifier) = self.shared.verifier.try_borrow_mut() {
            verifier.forget(self.context_id);
        }
    }
}
