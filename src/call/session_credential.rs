//! The permit's credential on the session's requests other than a dispatched `tools/call`
//! (`initialize`, `tools/list`, notifications, `GET` streams), with `credential_cache_ms` > 0
//! (docs/design.md#the-agent-holds-no-credential).
//!
//! Such a request under a permit passes as before, and also gets the permit's credential, if
//! Envoy routed it to the credential's route, after the agent's own value under that header
//! is removed. The credential comes from the worker's [`CredentialCache`], or, when it has
//! nothing fresh for the permit, from one `POST /v1/credential` while the request is held
//! (`request_hold: headers`; in the body form the headers have left already, and nothing is
//! set). A `tools/call` never gets it this way: a governed one only with its Dispatch answer,
//! an ungoverned one not at all. When the ledger cannot be asked, the request goes on
//! without a credential.

use std::cell::RefCell;
use std::rc::Rc;

use super::credential::{self, CredentialCache};
use super::{permit, Effect, Flow, Level, RequestHead, Step};
use crate::ledger_client::{Callout, LedgerReply};
use atmost_protocol::credential::UpstreamCredential;

/// What the machine keeps for the session's credential.
#[derive(Debug, Clone)]
pub(super) struct Session {
    cache: Rc<RefCell<CredentialCache>>,
    /// When the request began (milliseconds since the epoch): the time it reads the cache
    /// at, and the time an answer it asked for is kept from.
    now_ms: u64,
    /// The request's permit token and route, while it may still get the credential.
    permit: Option<(String, Option<String>)>,
    /// A `POST /v1/credential` for this request is out.
    asking: bool,
}

impl Session {
    /// The session's credentials for a request: `cache` is its worker's, `now_ms` the time
    /// the request began.
    pub(super) fn new(cache: Rc<RefCell<CredentialCache>>, now_ms: u64) -> Session {
        Session {
            cache,
            now_ms,
            permit: None,
            asking: false,
        }
    }

    /// Notes the request's permit and route, read from its headers.
    pub(super) fn note(&mut self, head: &RequestHead, permit_header: &str) {
        self.permit = permit::token(&head.permit, permit_header)
            .ok()
            .map(|t| (t, head.route.clone()));
    }

    /// A `tools/call` passing ungoverned: it carries no credential.
    pub(super) fn forget_permit(&mut self) {
        self.permit = None;
    }

    /// `step`, of a request that passes with its headers held, with the credential added:
    /// from the cache, or held for the ledger's answer. A step that does not let the
    /// request go on is given back unchanged.
    pub(super) fn add_to(&mut self, step: Step) -> Step {
        if step.flow != Flow::Continue || step.callout.is_some() {
            return step;
        }
        let Some((token, route)) = self.permit.as_ref() else {
            return step;
        };
        let cached = self.cache.borrow().get(token, self.now_ms);
        match cached {
            Some(found) => step.with_all(edits_for(found.as_ref(), route.as_deref())),
            None => {
                self.asking = true;
                let callout = Callout::credential(token);
                Step {
                    flow: Flow::Pause,
                    effects: step.effects,
                    callout: Some(callout),
                }
            }
        }
    }

    /// The ledger's answer to this request's credential callout, if one is out: the request
    /// resumes, with the credential when there is one for its route.
    pub(super) fn on_reply(&mut self, reply: &LedgerReply) -> Option<Step> {
        if !self.asking {
            return None;
        }
        self.asking = false;
        let (token, route) = self.permit.take()?;
        let step = match reply.credential() {
            Ok(found) => {
                self.cache
                    .borrow_mut()
                    .put(&token, self.now_ms, found.clone());
                Step::cont().with_all(edits_for(found.as_ref(), route.as_deref()))
            }
            Err(e) => Step::cont().with(Effect::Log(
                Level::Warn,
                format!("atmost: the session's credential could not be asked ({e}); the request goes on without it"),
            )),
        };
        Some(step.with(Effect::ResumeRequest))
    }

    /// The credential callout could not be dispatched: the request goes on without it.
    pub(super) fn on_callout_failed(&mut self) -> Option<Step> {
        if !self.asking {
            return None;
        }
        self.asking = false;
        Some(
            Step::cont().with(Effect::Log(
                Level::Warn,
                "atmost: could not dispatch the credential callout; the request goes on without it"
                    .into(),
            )),
        )
    }
}

/// The edits that put `found` on a request routed to `route`; none without a credential, on
/// another route, or for one that cannot be set.
fn edits_for(found: Option<&UpstreamCredential>, route: Option<&str>) -> Vec<Effect> {
    found
        .and_then(|c| credential::edits(c, route, true).ok())
        .unwrap_or_default()
}
