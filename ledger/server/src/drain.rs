//! A planned stop in two steps: first the ledger turns not ready (`/readyz` answers 503
//! `draining`) while it still serves every other request, so that Envoy's active health check
//! and Kubernetes' endpoint removal move traffic to another replica; only after the drain delay
//! does the server stop accepting and finish what is in flight. Stopping at the first signal
//! would deny the calls a gateway still sends here before it has noticed (`gateway_unavailable`).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tracing::info;

use crate::metrics::Metrics;

/// Waits for a stop signal, drains, and returns when the server should shut down gracefully:
/// after `drain_delay`, or at once on a second signal (an operator who does not want to wait).
/// Every value received on `stop_signals` is one SIGTERM or Ctrl-C.
pub async fn drain_then_stop(
    mut stop_signals: mpsc::Receiver<()>,
    metrics: Arc<Metrics>,
    drain_delay: Duration,
) {
    if stop_signals.recv().await.is_none() {
        // No signal can come any more: keep serving, as a ledger without signals always did.
        std::future::pending::<()>().await;
    }
    metrics.draining.set(1);
    info!(
        drain_delay_ms = u64::try_from(drain_delay.as_millis()).unwrap_or(u64::MAX),
        "draining: /readyz answers 503 until the drain delay ends or a second signal comes, then the ledger stops"
    );
    tokio::select! {
        () = tokio::time::sleep(drain_delay) => {}
        Some(()) = stop_signals.recv() => info!("second stop signal: the rest of the drain delay is skipped"),
    }
}

/// One drain for both listeners (the API's and the admin's): each shuts down gracefully when
/// the drain it was made from ends.
#[derive(Debug, Clone)]
pub struct Shutdown(watch::Receiver<bool>);

impl Shutdown {
    /// Runs `drain` (e.g. [`drain_then_stop`]) in a task of its own.
    pub fn after(drain: impl Future<Output = ()> + Send + 'static) -> Self {
        let (stopping, stopped) = watch::channel(false);
        tokio::spawn(async move {
            drain.await;
            let _ = stopping.send(true);
        });
        Shutdown(stopped)
    }

    /// Completes once the drain has ended: a listener's graceful shutdown.
    pub fn signal(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut stopped = self.0.clone();
        async move {
            // An error means the drain task is gone without saying so: stop as well.
            let _ = stopped.wait_for(|s| *s).await;
        }
    }
}

/// SIGTERM and Ctrl-C (SIGINT), each forwarded as one `()`. Registered before the ledger
/// listens, so a signal that comes early is not lost and a failure to register stops the start.
#[cfg(unix)]
pub fn os_stop_signals() -> std::io::Result<mpsc::Receiver<()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let (tx, rx) = mpsc::channel(4);
    tokio::spawn(async move {
        loop {
            tokio::select! {
                Some(()) = terminate.recv() => {}
                Some(()) = interrupt.recv() => {}
                else => return,
            }
            if tx.send(()).await.is_err() {
                return;
            }
        }
    });
    Ok(rx)
}

#[cfg(not(unix))]
pub fn os_stop_signals() -> std::io::Result<mpsc::Receiver<()>> {
    let (tx, rx) = mpsc::channel(4);
    tokio::spawn(async move {
        while tokio::signal::ctrl_c().await.is_ok() {
            if tx.send(()).await.is_err() {
                return;
            }
        }
    });
    Ok(rx)
}
