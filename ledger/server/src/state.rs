//! What every handler shares: the ledger's configuration and its running state.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::info;

use crate::admins::Admins;
use crate::auth_limit::{AuthLimit, FailureLimiter};
use crate::metrics::Metrics;
use crate::readiness::Readiness;
use crate::redact::Redaction;
use crate::signer::Signer;
use crate::webhook::{ApprovalEvent, Webhook};
use atmost_ledger::clock::Clock;
use atmost_ledger::credentials::CredentialKey;
use atmost_ledger::decide::Leases;
use atmost_ledger::error::LedgerError;
use atmost_ledger::model::KeyCarrier;
use atmost_ledger::store::Store;

/// Secrets and timings of a running ledger.
#[derive(Clone)]
pub struct ServerConfig {
    pub service_token: String,
    /// Who may call the admin API and sign in to the inbox (`--admin-token`,
    /// `--admin-tokens-file`), shared with the task that reads the file again.
    pub admins: Arc<Admins>,
    pub lease: Duration,
    /// How long a filter that does not send [`CALLOUT_TIMEOUT_HEADER`] waits for an
    /// authorize (`--callout-timeout`).
    pub callout_timeout: Duration,
    /// Argument fields never shown (admin API, CLI, inbox).
    pub redaction: Redaction,
    pub inbox: InboxConfig,
    /// How long a replica signs with the active key it read before reading it again.
    pub key_refresh: Duration,
    /// The `iss` of the receipts it signs.
    pub receipt_issuer: String,
    /// The keys verifiers at the tool prove their refusals with (`--tool-refusal-keys`).
    pub tool_refusal_keys: crate::tool_refusal::RefusalKeys,
    /// Failed authentications per source before 429 (crate::auth_limit).
    pub auth_limit: AuthLimit,
    /// How long after a permit stopped authorizing the sweeper purges its history; `None`
    /// keeps everything (docs/design.md#purging-ended-permits).
    pub purge_ended_permits_after: Option<Duration>,
    /// The key the credentials in the ledger's custody are sealed under
    /// (`--credential-key-file`, `ATMOST_CREDENTIAL_KEY`); without it the ledger keeps none.
    pub credential_key: Option<Arc<CredentialKey>>,
    /// Approvals' lapse times and who may name the person deciding (docs/approvals.md).
    pub approvals: ApprovalConfig,
}

/// The approval settings (`atmost ledger --approval-…`, `--admin-identity-…`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApprovalConfig {
    /// How long a request waits for a person's decision (`--approval-wait`).
    pub wait: Duration,
    /// How long an approval waits for the agent's retry (`--approval-use-within`).
    pub use_within: Duration,
    /// The authenticating proxy whose header names the person deciding, if one is trusted.
    pub identity: Option<IdentityProxy>,
}

impl Default for ApprovalConfig {
    fn default() -> Self {
        ApprovalConfig {
            wait: Duration::from_millis(Leases::DEFAULT_APPROVAL_WAIT_MS),
            use_within: Duration::from_secs(600),
            identity: None,
        }
    }
}

/// An authenticating proxy in front of the admin port: the admin whose token it alone holds,
/// and the header it names the signed-in person in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdentityProxy {
    pub admin: String,
    pub header: axum::http::HeaderName,
}

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConfig")
            .field("service_token", &"<redacted>")
            .field("admins", &self.admins)
            .field("lease", &self.lease)
            .field("callout_timeout", &self.callout_timeout)
            .field("redaction", &self.redaction)
            .field("inbox", &self.inbox)
            .field("key_refresh", &self.key_refresh)
            .field("receipt_issuer", &self.receipt_issuer)
            .field("tool_refusal_keys", &self.tool_refusal_keys)
            .field("auth_limit", &self.auth_limit)
            .field("purge_ended_permits_after", &self.purge_ended_permits_after)
            .field("credential_key", &self.credential_key)
            .field("approvals", &self.approvals)
            .finish()
    }
}

/// The inbox's settings (`atmost ledger --inbox-…`; crate::inbox).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxConfig {
    /// How long a session lasts after sign-in.
    pub session_ttl: Duration,
    /// An `awaiting_input` attempt is listed once it has waited this long.
    pub stuck_after: Duration,
    /// Mark cookies `Secure` on every response, not only when a proxy says the page was
    /// reached over TLS.
    pub secure_cookies: bool,
    /// Per tool, the form of the key its reconcile rule's lookup searches by (a rule whose
    /// lookup names `{{forwarded_key}}`); a tool without one is taken to be searched by the
    /// `Idempotency-Key` header.
    pub lookup_forms: BTreeMap<String, KeyCarrier>,
}

impl Default for InboxConfig {
    fn default() -> Self {
        InboxConfig {
            session_ttl: Duration::from_secs(3600),
            stuck_after: Duration::from_secs(60),
            secure_cookies: false,
            lookup_forms: BTreeMap::new(),
        }
    }
}

/// Most permits whose credential name a replica keeps in memory before it forgets them all.
const MAX_CACHED_PERMITS: usize = 65_536;

/// What a replica remembers of credentials (crate::credentials): which credential each permit
/// it has seen names (a permit's credential never changes, so this is never stale). The
/// credentials themselves are read from the store at each use, so a rotation on any replica
/// is the next dispatch's.
#[derive(Debug, Default)]
pub struct Custody {
    names: Mutex<HashMap<String, Option<String>>>,
}

impl Custody {
    /// The credential name remembered for `permit_id` (`Some(None)`: it names none), `None`
    /// when this replica has not seen the permit.
    pub fn name_of(&self, permit_id: &str) -> Option<Option<String>> {
        self.names
            .lock()
            .ok()
            .and_then(|names| names.get(permit_id).cloned())
    }

    /// Remembers the credential `permit_id` names; past [`MAX_CACHED_PERMITS`] everything is
    /// forgotten first (a permit read again costs one store read).
    pub fn remember(&self, permit_id: &str, name: Option<String>) {
        if let Ok(mut names) = self.names.lock() {
            if names.len() >= MAX_CACHED_PERMITS {
                names.clear();
            }
            names.insert(permit_id.to_string(), name);
        }
    }
}

pub struct AppState {
    pub store: Arc<dyn Store>,
    pub clock: Arc<dyn Clock>,
    pub config: ServerConfig,
    pub metrics: Arc<Metrics>,
    /// The active signing key as this replica holds it.
    pub signer: Signer,
    /// The latest background store check, which `/readyz` answers from (shared with the
    /// task that makes it).
    pub readiness: Arc<Readiness>,
    /// Failed authentications per source (bearer tokens, inbox sign-ins).
    pub auth_failures: FailureLimiter,
    /// When the gauges read from the store were last read (see [`refresh_store_gauges`]).
    pub(crate) store_gauges_read_at: tokio::sync::Mutex<Option<Instant>>,
    /// Which credential each permit names.
    pub custody: Custody,
    /// Where approval events go (`--approval-webhook`); none without the flag. Set by the
    /// ledger's start once the runtime it sends on exists.
    pub webhook: Option<Webhook>,
}

impl AppState {
    /// The state of a ledger on `store`; its signer holds no key until
    /// [`Signer::start`] (the ledger calls it before it listens).
    pub fn new(
        store: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
        config: ServerConfig,
        metrics: Arc<Metrics>,
    ) -> Self {
        let signer = Signer::new(config.key_refresh);
        let auth_failures = FailureLimiter::new(config.auth_limit);
        AppState {
            store,
            clock,
            config,
            metrics,
            signer,
            readiness: Arc::default(),
            auth_failures,
            store_gauges_read_at: tokio::sync::Mutex::new(None),
            custody: Default::default(),
            webhook: None,
        }
    }

    /// Hands `event` to the webhook, if there is one; returns at once whatever becomes of it
    /// (crate::webhook).
    pub fn notify_approval(&self, event: ApprovalEvent) {
        if let Some(webhook) = &self.webhook {
            webhook.notify(event);
        }
    }

    /// Makes sure the store has an active signing key and holds it.
    pub async fn start_signing(&self) -> Result<(), LedgerError> {
        let key = self.signer.start(&*self.store, self.clock.now_ms()).await?;
        info!(kid = key.kid(), "signing key ready");
        Ok(())
    }

    pub(crate) fn lease_ms(&self) -> u64 {
        millis(self.config.lease)
    }

    /// The call lease and the approval wait every decision is made with.
    pub(crate) fn leases(&self) -> Leases {
        Leases {
            call_ms: self.lease_ms(),
            approval_wait_ms: millis(self.config.approvals.wait),
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

pub type Shared = Arc<AppState>;
