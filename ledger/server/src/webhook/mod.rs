//! The approval webhook (`--approval-webhook`): one signed JSON POST for each new request
//! for approval and each decision (docs/approvals.md, "Webhook").
//!
//! [`Webhook::notify`] only puts the event in a bounded queue, so delivery never delays the
//! decision that caused it, and a receiver that is down or slow costs the ledger nothing but
//! the queue. One task sends the events in the order they came, one at a time (a receiver
//! sees a request before its decision), each tried by the [`RetrySchedule`].

mod event;
mod signature;
#[cfg(test)]
mod tests;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::metrics::{Metrics, WebhookDelivery};
use atmost_ledger::clock::Clock;

pub use event::{ApprovalEvent, ApprovalEventType, ApprovalSubject, Decision};
pub use signature::{WebhookSecret, MIN_SECRET_BYTES, SIGNATURE_HEADER};

/// Events waiting to be sent; one more is dropped (and counted).
pub const QUEUE_CAPACITY: usize = 1024;

/// How each event is tried: one try, then one more after each wait.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetrySchedule {
    /// The waits between two tries: tries = waits + 1.
    pub waits: Vec<Duration>,
    /// How long one try may take, from connecting to the answer's status.
    pub timeout: Duration,
}

impl Default for RetrySchedule {
    /// Six tries of 5 s, 1, 2, 4, 8 and 16 s apart: a receiver that restarts within half a
    /// minute misses nothing.
    fn default() -> Self {
        RetrySchedule {
            waits: [1, 2, 4, 8, 16].map(Duration::from_secs).to_vec(),
            timeout: Duration::from_secs(5),
        }
    }
}

impl RetrySchedule {
    pub fn tries(&self) -> usize {
        self.waits.len() + 1
    }
}

/// Where events go and how they are signed and tried.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    pub url: reqwest::Url,
    pub secret: WebhookSecret,
    pub schedule: RetrySchedule,
    pub queue_capacity: usize,
}

impl WebhookConfig {
    /// The webhook of `--approval-webhook` and `--approval-webhook-secret-file`: none when
    /// neither is given (an empty value counts as not given), refused when only one is, when
    /// the URL is not http(s), or when the secret file cannot be read or is too short. The
    /// error names the flag at fault, and never the URL itself (a chat tool's webhook URL is
    /// often a credential).
    pub fn from_flags(
        url: Option<&str>,
        secret_file: Option<&Path>,
    ) -> Result<Option<WebhookConfig>, String> {
        let url = url.map(str::trim).filter(|u| !u.is_empty());
        let secret_file = secret_file.filter(|p| !p.as_os_str().is_empty());
        let (url, secret_file) = match (url, secret_file) {
            (None, None) => return Ok(None),
            (Some(url), Some(file)) => (url, file),
            (Some(_), None) => {
                return Err("--approval-webhook (ATMOST_APPROVAL_WEBHOOK) needs --approval-webhook-secret-file (ATMOST_APPROVAL_WEBHOOK_SECRET_FILE): every event is signed".into())
            }
            (None, Some(file)) => {
                return Err(format!(
                    "--approval-webhook-secret-file {}: given without --approval-webhook (ATMOST_APPROVAL_WEBHOOK), the URL events go to",
                    file.display()
                ))
            }
        };
        let url = reqwest::Url::parse(url)
            .map_err(|e| format!("--approval-webhook (ATMOST_APPROVAL_WEBHOOK): not a URL: {e}"))?;
        if !matches!(url.scheme(), "http" | "https") || url.host().is_none() {
            return Err(
                "--approval-webhook (ATMOST_APPROVAL_WEBHOOK) must be an http:// or https:// URL with a host"
                    .into(),
            );
        }
        Ok(Some(WebhookConfig {
            url,
            secret: WebhookSecret::read(secret_file)?,
            schedule: RetrySchedule::default(),
            queue_capacity: QUEUE_CAPACITY,
        }))
    }
}

/// The running webhook: what handlers hand events to. Cheap to clone.
#[derive(Clone)]
pub struct Webhook {
    queue: mpsc::Sender<ApprovalEvent>,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Webhook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Webhook")
            .field(
                "queued",
                &(self.queue.max_capacity() - self.queue.capacity()),
            )
            .finish_non_exhaustive()
    }
}

impl Webhook {
    /// Starts the task that sends the events, on the current tokio runtime (an error outside
    /// one, or when the HTTP client cannot be built). It stops once every handle is dropped
    /// and the queue is empty.
    pub fn spawn(
        config: WebhookConfig,
        metrics: Arc<Metrics>,
        clock: Arc<dyn Clock>,
    ) -> Result<Webhook, String> {
        let runtime =
            tokio::runtime::Handle::try_current().map_err(|e| format!("approval webhook: {e}"))?;
        // The reconciler installs the same provider; whichever comes first wins, and both are
        // ring.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .timeout(config.schedule.timeout)
            // A redirect is not a delivery: a POST followed to another address would either be
            // resent there unasked or turned into a GET.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| format!("approval webhook HTTP client: {e}"))?;
        let (queue, events) = mpsc::channel(config.queue_capacity.max(1));
        metrics.show_webhook_deliveries();
        info!(
            scheme = config.url.scheme(),
            host = config.url.host_str().unwrap_or_default(),
            "approval webhook on"
        );
        let sender = Sender {
            http,
            url: config.url,
            secret: config.secret,
            schedule: config.schedule,
            clock,
            metrics: metrics.clone(),
        };
        runtime.spawn(sender.run(events));
        Ok(Webhook { queue, metrics })
    }

    /// Queues `event` for delivery and returns at once: never waits, never fails. With the
    /// queue full the event is dropped, counted `dropped_queue_full` and logged.
    pub fn notify(&self, event: ApprovalEvent) {
        match self.queue.try_send(event) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(event)) => {
                self.metrics
                    .count_webhook_delivery(WebhookDelivery::DroppedQueueFull);
                warn!(
                    approval_id = event.approval_id(),
                    event = %event.event_type(),
                    "approval webhook event dropped: the queue is full"
                );
            }
            // Only once the task is gone, which it never is while a handle lives; counted
            // all the same, since the event is lost.
            Err(mpsc::error::TrySendError::Closed(event)) => {
                self.metrics.count_webhook_delivery(WebhookDelivery::Failed);
                warn!(
                    approval_id = event.approval_id(),
                    event = %event.event_type(),
                    "approval webhook event dropped: delivery has stopped"
                );
            }
        }
    }
}

/// The task's half: sends each event by the schedule.
struct Sender {
    http: reqwest::Client,
    url: reqwest::Url,
    secret: WebhookSecret,
    schedule: RetrySchedule,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
}

impl Sender {
    async fn run(self, mut events: mpsc::Receiver<ApprovalEvent>) {
        while let Some(event) = events.recv().await {
            let result = self.deliver(&event).await;
            self.metrics.count_webhook_delivery(result);
        }
    }

    /// Tries `event` until one try is answered 2xx or the schedule is spent.
    async fn deliver(&self, event: &ApprovalEvent) -> WebhookDelivery {
        let body = match serde_json::to_vec(event) {
            Ok(body) => body,
            Err(e) => {
                warn!(approval_id = event.approval_id(), error = %e, "approval webhook event not written");
                return WebhookDelivery::Failed;
            }
        };
        let tries = self.schedule.tries();
        let mut why = String::new();
        for attempt in 1..=tries {
            if let Some(wait) = attempt
                .checked_sub(2)
                .and_then(|i| self.schedule.waits.get(i))
            {
                tokio::time::sleep(*wait).await;
            }
            match self.try_once(&body).await {
                Ok(()) => {
                    debug!(approval_id = event.approval_id(), event = %event.event_type(), attempt, "approval webhook event delivered");
                    return WebhookDelivery::Delivered;
                }
                Err(e) => {
                    debug!(approval_id = event.approval_id(), attempt, error = %e, "approval webhook try failed");
                    why = e;
                }
            }
        }
        warn!(
            approval_id = event.approval_id(),
            event = %event.event_type(),
            tries,
            error = %why,
            "approval webhook event not delivered: every try failed, dropped"
        );
        WebhookDelivery::Failed
    }

    /// One POST of `body`, signed now; `Err` says why it did not count as delivered, without
    /// the URL.
    async fn try_once(&self, body: &[u8]) -> Result<(), String> {
        let now = self.clock.now_ms().div_euclid(1000);
        let response = self
            .http
            .post(self.url.clone())
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(SIGNATURE_HEADER, self.secret.signature(now, body))
            .body(body.to_vec())
            .send()
            .await
            .map_err(|e| e.without_url().to_string())?;
        let status = response.status();
        if status.is_success() {
            Ok(())
        } else {
            Err(format!("answered HTTP {}", status.as_u16()))
        }
    }
}
