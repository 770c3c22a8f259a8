//! What the root context shares with its HTTP contexts (one VM is single-threaded).

use super::host::{self, Metrics};
use crate::call::credential::CredentialCache;
use crate::call::Call;
use crate::held_calls::HeldCalls;
use crate::report::{Reporter, RootEffect};
use atmost_config::Config;
use proxy_wasm::hostcalls;
use std::cell::RefCell;
use std::rc::{Rc, Weak};

/// The calls this worker holds for approval, each reached through its HTTP context's
/// machine (weakly: a request that ends drops it, whatever the table still says).
pub type Holds = Rc<RefCell<HeldCalls<Weak<RefCell<Call>>>>>;

#[derive(Clone)]
pub struct Shared {
    pub config: Rc<Config>,
    pub reporter: Rc<RefCell<Reporter>>,
    /// The root's doorbell: a shared queue registered under a name unique to this VM.
    pub doorbell: Option<u32>,
    pub metrics: Rc<Metrics>,
    /// This worker's credentials for the session's requests (`credential_cache_ms` > 0).
    pub credentials: Option<Rc<RefCell<CredentialCache>>>,
    /// The calls held for approval (`approval_hold_ms`), which the root asks about again.
    pub holds: Holds,
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
