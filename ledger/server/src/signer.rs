//! The active signing key as this replica holds it. Reading it from the store on every
//! authorize would add a store round trip to each governed call; holding it for good would
//! miss a rotation made by another replica. So it is held for `--signing-key-refresh` and
//! then read again; this replica's own rotation replaces it at once. A key retired elsewhere
//! may sign here until the next read: it stays published long enough for that
//! ([`atmost_ledger::keys::PUBLICATION_MARGIN_S`]).

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use thiserror::Error;

use atmost_ledger::clock::Millis;
use atmost_ledger::error::LedgerError;
use atmost_ledger::keys::{PublicSigningKey, SigningKey};
use atmost_ledger::store::Store;

/// Why no key can sign now. Either way the call is denied `gateway_unavailable` before
/// anything is decided.
#[derive(Debug, Error)]
pub enum KeyUnavailable {
    #[error("no signing key is active")]
    NoActiveKey,
    #[error(transparent)]
    Store(#[from] LedgerError),
}

struct Held {
    key: Arc<SigningKey>,
    read_at: Instant,
}

pub struct Signer {
    refresh: Duration,
    held: RwLock<Option<Held>>,
    /// One read of the store at a time: the calls that find the key stale together wait for
    /// one read instead of each making its own.
    reading: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kid = self.fresh_or_stale().map(|k| k.kid().to_string());
        f.debug_struct("Signer")
            .field("refresh", &self.refresh)
            .field("kid", &kid)
            .finish()
    }
}

impl Signer {
    /// A signer that reads the active key again once it has held it for `refresh` (zero: on
    /// every call).
    pub fn new(refresh: Duration) -> Self {
        Signer {
            refresh,
            held: RwLock::new(None),
            reading: tokio::sync::Mutex::new(()),
        }
    }

    fn fresh(&self) -> Option<Arc<SigningKey>> {
        let held = self.held.read().unwrap_or_else(|p| p.into_inner());
        held.as_ref()
            .filter(|h| h.read_at.elapsed() < self.refresh)
            .map(|h| h.key.clone())
    }

    fn fresh_or_stale(&self) -> Option<Arc<SigningKey>> {
        let held = self.held.read().unwrap_or_else(|p| p.into_inner());
        held.as_ref().map(|h| h.key.clone())
    }

    fn hold(&self, key: Option<Arc<SigningKey>>) {
        let mut held = self.held.write().unwrap_or_else(|p| p.into_inner());
        *held = key.map(|key| Held {
            key,
            read_at: Instant::now(),
        });
    }

    /// Makes sure the store has an active key (one is made at `now` when none is) and holds
    /// it: the ledger does this before it listens.
    pub async fn start(
        &self,
        store: &dyn Store,
        now: Millis,
    ) -> Result<Arc<SigningKey>, LedgerError> {
        let key = Arc::new(store.ensure_signing_key(now).await?);
        self.hold(Some(key.clone()));
        Ok(key)
    }

    /// The key that signs now: the one held, or the store's active key once the held one is
    /// due to be read again. A key that cannot be read is not replaced by the one held
    /// before: a row found corrupt, or gone, stops the signing at once.
    pub async fn active(&self, store: &dyn Store) -> Result<Arc<SigningKey>, KeyUnavailable> {
        if let Some(key) = self.fresh() {
            return Ok(key);
        }
        let _reading = self.reading.lock().await;
        if let Some(key) = self.fresh() {
            return Ok(key);
        }
        match store.active_signing_key().await {
            Ok(Some(key)) => {
                let key = Arc::new(key);
                self.hold(Some(key.clone()));
                Ok(key)
            }
            Ok(None) => {
                self.hold(None);
                Err(KeyUnavailable::NoActiveKey)
            }
            Err(e) => {
                self.hold(None);
                Err(KeyUnavailable::Store(e))
            }
        }
    }

    /// Rotates the store's key at `now` and holds the new one; answers it and the key it
    /// retired.
    pub async fn rotate(
        &self,
        store: &dyn Store,
        now: Millis,
    ) -> Result<(Arc<SigningKey>, Option<PublicSigningKey>), LedgerError> {
        let _reading = self.reading.lock().await;
        let rotation = store.rotate_signing_key(now).await?;
        let key = Arc::new(rotation.active);
        self.hold(Some(key.clone()));
        Ok((key, rotation.retired))
    }
}
