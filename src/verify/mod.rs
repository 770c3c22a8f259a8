//! The verifier at the tool (`role: "verify"`): the same module in front of an MCP server,
//! letting a governed `tools/call` through only with a valid, fresh, unseen dispatch
//! signature by one of the ledger's keys (docs/signatures.md, "The verifier at the tool").
//!
//! The body is read as the gateway reads it ([`crate::parse::mcp`], the same refusals);
//! traffic that is not a governed `tools/call` passes untouched. For a governed call:
//! [`check::read`] checks the signature's form, window and digest, the key set
//! ([`keys`]) names the key, [`check::Presented::verify`] checks the signature, and the
//! replay cache ([`replay`]) records its nonce. A refusal is HTTP 4xx (503 when the replay
//! cache cannot record) with the JSON-RPC body of `denial_format`; nothing reaches the
//! server.
//!
//! [`Verifier`] is one VM's state, shared by its root context (which fetches the key set)
//! and its HTTP contexts; [`VerifyCall`] is one request's machine. Neither touches Envoy:
//! the adapter feeds them and carries out the [`Step`]s they answer.

pub mod check;
pub mod keys;
pub mod replay;

#[cfg(test)]
mod tests;

use crate::call::denial;
use crate::call::upgrade;
use crate::call::{
    alias_refused, bad_request, too_large, trailers_refused, unreadable_body, BodyStep, Effect,
    Level, RequestHead, Step,
};
use crate::parse::mcp::{self, Message};
use crate::stats::Stat;
use atmost_config::{RequestHold, VerifyConfig};
use atmost_protocol::tool_refusal::{self, Proof, ToolRefusal};
use atmost_protocol::{Denial, DenialCode};
use check::{Presented, Received, SignedHead};
use keys::{KeySet, OnUnknown, Refresh};
use replay::{Record, ReplayCache, SharedSlots};
use serde_json::Value;
use std::rc::Rc;

/// Most calls of one VM waiting for the key set at once; past it an unknown `keyid` is
/// refused at once.
pub const MAX_WAITING: usize = 1024;

/// The HTTP status of a refusal with `code`.
pub fn http_status(code: DenialCode) -> u32 {
    match code {
        DenialCode::SignatureMalformed | DenialCode::ContentDigestMismatch => 400,
        DenialCode::SignatureReplayed => 409,
        DenialCode::ReplayCacheUnavailable => 503,
        _ => 403,
    }
}

/// The `atmost-tool-refusal` header of a refusal with `code`: proven by an HMAC over the
/// code and the signature's nonce when the nonce was read and `verify.refusal_key` is set
/// (docs/signatures.md, "A refusal at the tool").
pub fn refusal_header(config: &VerifyConfig, code: DenialCode, nonce: Option<&str>) -> String {
    let proof = match (&config.refusal_key, nonce) {
        (Some(key), Some(nonce)) => Some(Proof {
            nonce: nonce.to_string(),
            mac: tool_refusal::hex(&key.mac(&[&tool_refusal::mac_input(code, nonce)])),
        }),
        _ => None,
    };
    ToolRefusal { code, proof }.header_value()
}

fn refuse(
    config: &VerifyConfig,
    denial: &Denial,
    id: &Value,
    tool: &str,
    nonce: Option<&str>,
) -> Step {
    let mut reply = denial::render(denial, id, config.denial_format).with_header(
        tool_refusal::HEADER,
        &refusal_header(config, denial.code, nonce),
    );
    reply.status = http_status(denial.code);
    Step::pause()
        .with(Effect::LocalReply(reply))
        .with(Effect::Count(Stat::Denied))
        .with(Effect::Count(Stat::DeniedCode(denial.code)))
        .with(Effect::Log(
            Level::Info,
            format!(
                "atmost: refused tools/call of `{tool}`: {}: {}",
                denial.code, denial.message
            ),
        ))
}

/// What a call's body leads to.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Carry out this step now.
    Now(Step),
    /// The call waits (paused) for the key set; when `ring`, the root must be told to fetch
    /// it. The root finishes the call ([`Verifier::on_keys`]).
    Wait { ring: bool },
}

/// A governed call whose signature passed all but its key, waiting for the key set.
#[derive(Debug, Clone, PartialEq)]
struct Waiting {
    context_id: u32,
    id: Value,
    tool: String,
    presented: Presented,
}

/// One VM's verifier: its configuration, keys, fetch schedule, and the calls waiting for a
/// fetch.
#[derive(Debug)]
pub struct Verifier {
    config: Rc<VerifyConfig>,
    cache: ReplayCache,
    keys: KeySet,
    refresh: Option<Refresh>,
    waiting: Vec<Waiting>,
    /// Contexts the root refused after their wait for the key set: their response is this
    /// verifier's own, whose `atmost-tool-refusal` header stays.
    refused_after_wait: Vec<u32>,
}

impl Verifier {
    pub fn new(config: Rc<VerifyConfig>) -> Verifier {
        Verifier {
            cache: ReplayCache::new(config.replay_cache_entries),
            keys: KeySet::new(config.keys.clone()),
            refresh: config.jwks.as_ref().map(|j| Refresh::new(j.refresh_ms)),
            waiting: Vec::new(),
            refused_after_wait: Vec::new(),
            config,
        }
    }

    pub fn config(&self) -> &Rc<VerifyConfig> {
        &self.config
    }

    pub fn cache(&self) -> &ReplayCache {
        &self.cache
    }

    /// A call whose signature passed [`check::read`]: verified now if its key is known,
    /// else (with a fetched key set) after the next fetch.
    fn decide(&mut self, waiting: Waiting, now_ms: u64, store: &mut dyn SharedSlots) -> Verdict {
        if let Some(key) = self.keys.get(&waiting.presented.keyid) {
            return Verdict::Now(self.finish(&waiting, &key, now_ms / 1000, store));
        }
        let unknown = |w: &Waiting| {
            let nonce = Some(w.presented.nonce.as_str());
            refuse(&self.config, &unknown_key(), &w.id, &w.tool, nonce)
        };
        let Some(refresh) = self.refresh.as_mut() else {
            return Verdict::Now(unknown(&waiting));
        };
        if self.waiting.len() >= MAX_WAITING {
            return Verdict::Now(unknown(&waiting));
        }
        let ring = match refresh.on_unknown(now_ms) {
            OnUnknown::Refuse => return Verdict::Now(unknown(&waiting)),
            OnUnknown::Wait => false,
            OnUnknown::Request => true,
        };
        self.waiting.push(waiting);
        Verdict::Wait { ring }
    }

    /// The rest of the check once the key is known: the signature, then the replay cache.
    fn finish(&self, w: &Waiting, key: &[u8; 32], now: u64, store: &mut dyn SharedSlots) -> Step {
        let skew = self.config.max_skew_s;
        let checked = w
            .presented
            .verify(key)
            .and_then(|()| w.presented.still_valid(now, skew));
        let nonce = Some(w.presented.nonce.as_str());
        if let Err(d) = checked {
            return refuse(&self.config, &d, &w.id, &w.tool, nonce);
        }
        let keep_until = w.presented.expires.saturating_add(skew);
        let denial = match self.cache.record(store, &w.presented.nonce, keep_until, now) {
            Record::Recorded => {
                return Step::cont().with(Effect::Count(Stat::Verified)).with(Effect::Log(
                    Level::Debug,
                    format!(
                        "atmost: verified the dispatch signature of `{}` (nonce {})",
                        w.tool, w.presented.nonce
                    ),
                ))
            }
            Record::Replayed => Denial::new(
                DenialCode::SignatureReplayed,
                "this signature was already accepted: each dispatch is delivered once",
            ),
            Record::Unavailable(why) => Denial::new(
                DenialCode::ReplayCacheUnavailable,
                format!(
                    "the replay cache could not record this signature ({}); refused rather than accepted unrecorded",
                    match why {
                        replay::Unavailable::Full => "its slot is full of unexpired entries",
                        replay::Unavailable::Contended => "its slot is contended",
                        replay::Unavailable::Missing => "its slot does not exist",
                    }
                ),
            ),
        };
        refuse(&self.config, &denial, &w.id, &w.tool, nonce)
    }

    /// Root context: whether to start a fetch of the key set now (asked for by a waiting
    /// call, or due by the timer). Started if so.
    pub fn begin_refresh(&mut self, now_ms: u64) -> bool {
        self.refresh.as_mut().is_some_and(|r| r.begin(now_ms))
    }

    /// Root context: the fetch ended, with the JWKS body when it answered 200 (`None` when
    /// it failed, answered otherwise, or could not be started). Returns what each waiting
    /// call does now, by context id, and the counter of the fetch.
    pub fn on_keys(
        &mut self,
        body: Option<&[u8]>,
        now_ms: u64,
        store: &mut dyn SharedSlots,
    ) -> (Stat, Vec<(u32, Step)>) {
        let fetched = body.and_then(keys::parse_jwks);
        let ok = fetched.is_some();
        if let Some(keys) = fetched {
            self.keys.replace_fetched(keys);
        }
        if let Some(r) = self.refresh.as_mut() {
            r.end(now_ms, ok);
        }
        let stat = if ok {
            Stat::KeysRefreshed
        } else {
            Stat::KeysRefreshFailed
        };
        let waiting = std::mem::take(&mut self.waiting);
        let steps = waiting
            .into_iter()
            .map(|w| {
                let step = match self.keys.get(&w.presented.keyid) {
                    Some(key) => self.finish(&w, &key, now_ms / 1000, store),
                    None => {
                        let nonce = Some(w.presented.nonce.as_str());
                        refuse(&self.config, &unknown_key(), &w.id, &w.tool, nonce)
                    }
                };
                (w.context_id, step)
            })
            .collect::<Vec<_>>();
        for (context_id, step) in &steps {
            if step
                .effects
                .iter()
                .any(|e| matches!(e, Effect::LocalReply(_)))
            {
                self.refused_after_wait.push(*context_id);
            }
        }
        (stat, steps)
    }

    /// An HTTP context ended: it waits for nothing any more.
    pub fn forget(&mut self, context_id: u32) {
        self.waiting.retain(|w| w.context_id != context_id);
        self.refused_after_wait.retain(|c| *c != context_id);
    }

    /// Whether the root refused this context's call after its wait.
    pub fn refused_after_wait(&self, context_id: u32) -> bool {
        self.refused_after_wait.contains(&context_id)
    }

    /// How many calls wait for the key set.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// How many keys the last fetch brought.
    pub fn fetched_keys(&self) -> usize {
        self.keys.fetched()
    }
}

fn unknown_key() -> Denial {
    Denial::new(
        DenialCode::SignatureKeyUnknown,
        "the signature's keyid names no key this verifier trusts",
    )
}

#[derive(Debug, Clone)]
enum State {
    Start,
    Passing,
    ReadingBody(Box<(RequestHead, SignedHead)>),
    /// Waiting for the key set; the root finishes the call.
    Waiting,
    /// Refused, or let through after its check.
    Done,
}

/// One request in front of the tool.
#[derive(Debug, Clone)]
pub struct VerifyCall {
    config: Rc<VerifyConfig>,
    state: State,
}

impl VerifyCall {
    pub fn new(config: Rc<VerifyConfig>) -> VerifyCall {
        VerifyCall {
            config,
            state: State::Start,
        }
    }

    /// Short state name (tests).
    pub fn state_name(&self) -> &'static str {
        match self.state {
            State::Start => "start",
            State::Passing => "passing",
            State::ReadingBody(_) => "reading_body",
            State::Waiting => "waiting",
            State::Done => "done",
        }
    }

    /// The request's headers: refusals the gateway makes before reading a body are made
    /// alike (header aliases, body encoding, announced size); a POST with a body is held
    /// until the body is read.
    pub fn on_request_headers(&mut self, head: RequestHead, signed: SignedHead) -> Step {
        if !matches!(self.state, State::Start) {
            return Step::cont();
        }
        if let Some(alias) = &head.alias {
            self.state = State::Done;
            return alias_refused(alias);
        }
        // Over an upgraded connection a tools/call would reach the tool unverified.
        if let Some(refusal) = upgrade::refusal(&head, &self.config.upgrade_routes) {
            self.state = State::Done;
            return refusal;
        }
        if head.upgrade.is_some() || !head.method.eq_ignore_ascii_case("POST") || head.end_of_stream
        {
            self.state = State::Passing;
            return Step::cont();
        }
        if let Some(refusal) = unreadable_body(&head, self.config.max_body_bytes) {
            self.state = State::Done;
            return refusal;
        }
        self.state = State::ReadingBody(Box::new((head, signed)));
        // `request_hold: body`: the headers go on; the body is held until the check.
        match self.config.request_hold {
            RequestHold::Headers => Step::pause(),
            RequestHold::Body => Step::cont(),
        }
    }

    pub fn on_request_body(&mut self, size: usize, end_of_stream: bool) -> BodyStep {
        match &self.state {
            State::ReadingBody(_) => {
                if size as u64 > self.config.max_body_bytes {
                    self.state = State::Done;
                    BodyStep::Done(too_large(self.config.max_body_bytes))
                } else if end_of_stream {
                    BodyStep::Read { len: size }
                } else {
                    BodyStep::Done(Step::pause())
                }
            }
            State::Waiting => BodyStep::Done(Step::pause()),
            _ => BodyStep::Done(Step::cont()),
        }
    }

    pub fn on_request_trailers(&mut self) -> Step {
        match &self.state {
            State::ReadingBody(_) => {
                self.state = State::Done;
                trailers_refused()
            }
            State::Waiting => Step::pause(),
            _ => Step::cont(),
        }
    }

    /// The whole request body. `now_ms`: Unix milliseconds.
    pub fn on_request_body_data(
        &mut self,
        body: &[u8],
        verifier: &mut Verifier,
        context_id: u32,
        now_ms: u64,
        store: &mut dyn SharedSlots,
    ) -> Verdict {
        let State::ReadingBody(reading) = std::mem::replace(&mut self.state, State::Done) else {
            return Verdict::Now(Step::pause());
        };
        let (head, signed) = *reading;
        let call = match mcp::parse(body, &head.mirrored) {
            Err(reply) => return Verdict::Now(bad_request(*reply)),
            Ok(Message::ToolCall(call)) if self.config.governed_tools.contains(&call.name) => call,
            Ok(_) => {
                self.state = State::Passing;
                return Verdict::Now(Step::cont());
            }
        };
        let received = Received {
            method: &head.method,
            path: &head.path,
            body,
            tool: &call.name,
        };
        let config = &self.config;
        let presented = match check::read(
            &signed,
            received,
            now_ms / 1000,
            config.max_skew_s,
            &config.authorities,
        ) {
            Ok(p) => p,
            Err(r) => {
                let nonce = r.nonce.as_deref();
                return Verdict::Now(refuse(config, &r.denial, &call.id, &call.name, nonce));
            }
        };
        let verdict = verifier.decide(
            Waiting {
                context_id,
                id: call.id,
                tool: call.name,
                presented,
            },
            now_ms,
            store,
        );
        if matches!(verdict, Verdict::Wait { .. }) {
            self.state = State::Waiting;
        }
        verdict
    }
}
