//! What the root context shares with its HTTP contexts (one VM is single-threaded).

use super::host::{self, Metrics};
use crate::call::credential::CredentialCache;
use crate::report::{Reporter, RootEffect};
use atmost_config::Config;
use proxy_wasm::hostcalls;
use std::cell::RefCell;
use std::rc::Rc;

#[derive(Clone)]
pub struct Shared {
    pub config: Rc<Config>,
    pub reporter: Rc<RefCell<Reporter>>,
    /// The root's doorbell: a shared queue registered under a name unique to this VM.
    pub doorbell: Option<u32>,
    pub metrics: Rc<Metrics>,
    /// This worker's credentials for the session's requests (`credential_cache_ms` > 0).
    pub credentials: Option<Rc<RefCell<CredentialCache>>>,
}

impl Shared {
    /// Carries out one of the reporter's effects in the current context. A `Resume`
    /// switches the effective context: the caller switches back before its own hostcalls.
    pub fn root_effect(&self, effect: RootEffect) {
        match effect {
            RootEffect::Resume(context_id) => {
                if hostcalls::set_effective_context(context_id).is_ok() {
                    let _ = hostcalls::resume_http_response();
                }
            }
            RootEffect::Count(stat) => self.metrics.inc(stat),
            RootEffect::Log(level, message) => host::log(level, &message),
        }
    }
}
