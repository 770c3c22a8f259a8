//! The webhook against a receiver on loopback that records every request and answers as each
//! test scripts it; the signature is checked with the `hmac` crate, not the `ring` one the
//! webhook signs with.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::Router;
use hmac::{Hmac, KeyInit, Mac};
use serde_json::json;
use sha2::Sha256;
use tokio::sync::Semaphore;

use super::*;
use atmost_ledger::clock::ManualClock;

const SECRET: &[u8] = b"a-webhook-secret-of-32-bytes-or-more";
/// 2026-12-07T10:00:00Z.
const NOW_MS: i64 = 1_796_637_600_000;

/// What the receiver got.
#[derive(Debug, Clone)]
struct Seen {
    content_type: Option<String>,
    signature: Option<String>,
    body: Bytes,
}

#[derive(Default)]
struct Script {
    seen: Mutex<Vec<Seen>>,
    /// The statuses of the next answers, in order; 200 once none is left.
    statuses: Mutex<VecDeque<StatusCode>>,
    /// Every answer after the script: 200 unless set.
    then: Mutex<Option<StatusCode>>,
    delay: Mutex<Duration>,
    /// With `Some`, each answer waits for a permit of it.
    gate: Option<Arc<Semaphore>>,
}

struct Receiver {
    url: reqwest::Url,
    script: Arc<Script>,
}

impl Receiver {
    async fn start(script: Script) -> Receiver {
        let script = Arc::new(script);
        let app = Router::new()
            .route("/hook", post(receive))
            .with_state(script.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        Receiver {
            url: format!("http://{addr}/hook").parse().unwrap(),
            script,
        }
    }

    fn seen(&self) -> Vec<Seen> {
        self.script.seen.lock().unwrap().clone()
    }
}

async fn receive(State(script): State<Arc<Script>>, headers: HeaderMap, body: Bytes) -> StatusCode {
    let header = |name: &str| headers.get(name).map(|v| v.to_str().unwrap().to_string());
    script.seen.lock().unwrap().push(Seen {
        content_type: header("content-type"),
        signature: header("atmost-signature"),
        body,
    });
    let delay = *script.delay.lock().unwrap();
    tokio::time::sleep(delay).await;
    if let Some(gate) = &script.gate {
        gate.acquire().await.unwrap().forget();
    }
    let scripted = script.statuses.lock().unwrap().pop_front();
    scripted
        .or(*script.then.lock().unwrap())
        .unwrap_or(StatusCode::OK)
}

/// A webhook to `receiver` trying each event up to six times 10 ms apart, the receiver's
/// answer awaited `timeout`.
fn start(receiver: &Receiver, timeout: Duration, queue_capacity: usize) -> (Webhook, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new().unwrap());
    let config = WebhookConfig {
        url: receiver.url.clone(),
        secret: WebhookSecret::from_file_bytes(SECRET).unwrap(),
        schedule: RetrySchedule {
            waits: vec![Duration::from_millis(10); 5],
            timeout,
        },
        queue_capacity,
    };
    let webhook =
        Webhook::spawn(config, metrics.clone(), Arc::new(ManualClock::new(NOW_MS))).unwrap();
    (webhook, metrics)
}

fn count(metrics: &Metrics, result: WebhookDelivery) -> u64 {
    let series = format!(
        "atmost_approval_webhook_deliveries_total{{result=\"{}\"}} ",
        result.as_str()
    );
    let text = metrics.render().unwrap();
    text.lines()
        .find_map(|line| line.strip_prefix(&series))
        .map(|n| n.parse().unwrap())
        .unwrap_or(0)
}

/// Waits (at most 5 s) until `result` has been counted `n` times.
async fn counted(metrics: &Metrics, result: WebhookDelivery, n: u64) {
    let give_up = Instant::now() + Duration::from_secs(5);
    while count(metrics, result) < n {
        assert!(Instant::now() < give_up, "{result} never reached {n}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn subject(approval_id: &str) -> ApprovalSubject {
    ApprovalSubject {
        approval_id: approval_id.into(),
        permit_id: "pmt_1".into(),
        permit_label: "billing agent".into(),
        tool: "refund".into(),
        cost: 120_000,
    }
}

fn requested(approval_id: &str) -> ApprovalEvent {
    ApprovalEvent::requested(
        subject(approval_id),
        Some(json!({"amount": 120000, "card": "[redacted]"})),
        NOW_MS,
        NOW_MS + 15 * 60_000,
    )
}

/// Checks `signature` over `body` with the `hmac` crate and returns its `t`.
fn verified_time(signature: &str, body: &[u8]) -> i64 {
    let (t, v1) = signature
        .strip_prefix("t=")
        .and_then(|rest| rest.split_once(",v1="))
        .unwrap_or_else(|| panic!("not t=…,v1=…: {signature}"));
    assert_eq!(v1, v1.to_lowercase(), "lowercase hex");
    let mut mac = Hmac::<Sha256>::new_from_slice(SECRET).unwrap();
    mac.update(t.as_bytes());
    mac.update(b".");
    mac.update(body);
    mac.verify_slice(&hex::decode(v1).unwrap())
        .expect("the signature verifies");
    t.parse().unwrap()
}

#[test]
fn each_event_type_has_the_documented_fields_and_no_others() {
    assert_eq!(
        serde_json::to_value(requested("att_1")).unwrap(),
        json!({"type": "approval.requested", "approval_id": "att_1", "permit_id": "pmt_1",
               "permit_label": "billing agent", "tool": "refund", "cost": 120000,
               "arguments": {"amount": 120000, "card": "[redacted]"},
               "requested_at": "2026-12-07T10:00:00.000Z", "expires_at": "2026-12-07T10:15:00.000Z"})
    );
    let without_arguments = ApprovalEvent::requested(subject("att_1"), None, NOW_MS, NOW_MS);
    assert_eq!(
        serde_json::to_value(without_arguments).unwrap()["arguments"],
        json!(null)
    );
    let decision = Decision {
        by: "ana".into(),
        at: NOW_MS + 60_000,
        note: None,
    };
    assert_eq!(
        serde_json::to_value(ApprovalEvent::approved(
            subject("att_1"),
            decision.clone(),
            NOW_MS + 20 * 60_000
        ))
        .unwrap(),
        json!({"type": "approval.approved", "approval_id": "att_1", "permit_id": "pmt_1",
               "permit_label": "billing agent", "tool": "refund", "cost": 120000,
               "decided_by": "ana", "decided_at": "2026-12-07T10:01:00.000Z", "note": null,
               "use_by": "2026-12-07T10:20:00.000Z"})
    );
    let rejected = ApprovalEvent::rejected(
        subject("att_1"),
        Decision {
            note: Some("not this card".into()),
            ..decision
        },
    );
    assert_eq!(rejected.event_type(), ApprovalEventType::Rejected);
    assert_eq!(
        serde_json::to_value(rejected).unwrap(),
        json!({"type": "approval.rejected", "approval_id": "att_1", "permit_id": "pmt_1",
               "permit_label": "billing agent", "tool": "refund", "cost": 120000,
               "decided_by": "ana", "decided_at": "2026-12-07T10:01:00.000Z",
               "note": "not this card"})
    );
    assert_eq!(
        ApprovalEventType::NAMES,
        [
            "approval.requested",
            "approval.approved",
            "approval.rejected"
        ]
    );
}

#[tokio::test]
async fn an_event_is_posted_as_its_json_signed_over_the_time_and_the_body() {
    let receiver = Receiver::start(Script::default()).await;
    let (webhook, metrics) = start(&receiver, Duration::from_secs(5), QUEUE_CAPACITY);
    let event = requested("att_1");
    webhook.notify(event.clone());
    counted(&metrics, WebhookDelivery::Delivered, 1).await;
    let seen = receiver.seen();
    assert_eq!(seen.len(), 1);
    let request = &seen[0];
    assert_eq!(request.content_type.as_deref(), Some("application/json"));
    let body: serde_json::Value = serde_json::from_slice(&request.body).unwrap();
    assert_eq!(body, serde_json::to_value(&event).unwrap());
    let t = verified_time(request.signature.as_deref().unwrap(), &request.body);
    assert_eq!(
        t,
        NOW_MS / 1000,
        "t is the injected clock's time, in seconds"
    );
    // Another secret, or another body, does not verify.
    let mut other = Hmac::<Sha256>::new_from_slice(b"another-secret-of-32-bytes-or-more!").unwrap();
    other.update(format!("{t}.").as_bytes());
    other.update(&request.body);
    let v1 = request
        .signature
        .as_deref()
        .unwrap()
        .split_once(",v1=")
        .unwrap()
        .1;
    assert!(other.verify_slice(&hex::decode(v1).unwrap()).is_err());
    assert_eq!(count(&metrics, WebhookDelivery::Failed), 0);
}

#[tokio::test]
async fn two_failures_then_a_success_is_three_tries_and_one_delivery() {
    let receiver = Receiver::start(Script {
        statuses: Mutex::new([StatusCode::INTERNAL_SERVER_ERROR; 2].into()),
        ..Script::default()
    })
    .await;
    let (webhook, metrics) = start(&receiver, Duration::from_secs(5), QUEUE_CAPACITY);
    webhook.notify(requested("att_1"));
    counted(&metrics, WebhookDelivery::Delivered, 1).await;
    // Nothing more comes after the delivery.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let seen = receiver.seen();
    assert_eq!(seen.len(), 3);
    for request in &seen {
        assert_eq!(request.body, seen[0].body, "each try sends the same body");
        verified_time(request.signature.as_deref().unwrap(), &request.body);
    }
    assert_eq!(count(&metrics, WebhookDelivery::Delivered), 1);
    assert_eq!(count(&metrics, WebhookDelivery::Failed), 0);
}

#[tokio::test]
async fn a_receiver_that_always_fails_gets_six_tries_then_the_event_is_counted_failed() {
    let receiver = Receiver::start(Script {
        then: Mutex::new(Some(StatusCode::SERVICE_UNAVAILABLE)),
        ..Script::default()
    })
    .await;
    let (webhook, metrics) = start(&receiver, Duration::from_secs(5), QUEUE_CAPACITY);
    webhook.notify(requested("att_1"));
    counted(&metrics, WebhookDelivery::Failed, 1).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(receiver.seen().len(), 6);
    assert_eq!(count(&metrics, WebhookDelivery::Delivered), 0);
    // The next event is tried afresh.
    *receiver.script.then.lock().unwrap() = Some(StatusCode::NO_CONTENT);
    webhook.notify(requested("att_2"));
    counted(&metrics, WebhookDelivery::Delivered, 1).await;
    assert_eq!(receiver.seen().len(), 7);
}

#[tokio::test]
async fn a_receiver_that_answers_too_late_is_tried_again() {
    let receiver = Receiver::start(Script {
        delay: Mutex::new(Duration::from_millis(300)),
        ..Script::default()
    })
    .await;
    let (webhook, metrics) = start(&receiver, Duration::from_millis(50), QUEUE_CAPACITY);
    webhook.notify(requested("att_1"));
    counted(&metrics, WebhookDelivery::Failed, 1).await;
    assert_eq!(receiver.seen().len(), 6);
}

#[tokio::test]
async fn a_full_queue_drops_and_counts_without_waiting() {
    let gate = Arc::new(Semaphore::new(0));
    let receiver = Receiver::start(Script {
        gate: Some(gate.clone()),
        ..Script::default()
    })
    .await;
    let (webhook, metrics) = start(&receiver, Duration::from_secs(5), 2);
    // The first is taken from the queue and held at the receiver; two more fill the queue.
    webhook.notify(requested("att_0"));
    let give_up = Instant::now() + Duration::from_secs(5);
    while receiver.seen().is_empty() {
        assert!(Instant::now() < give_up, "the first event never arrived");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let started = Instant::now();
    for i in 1..=5 {
        webhook.notify(requested(&format!("att_{i}")));
    }
    assert!(
        started.elapsed() < Duration::from_millis(100),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(count(&metrics, WebhookDelivery::DroppedQueueFull), 3);
    gate.add_permits(3);
    counted(&metrics, WebhookDelivery::Delivered, 3).await;
    let delivered: Vec<String> = receiver
        .seen()
        .iter()
        .map(|s| {
            let body: serde_json::Value = serde_json::from_slice(&s.body).unwrap();
            body["approval_id"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(
        delivered,
        ["att_0", "att_1", "att_2"],
        "in order, the dropped ones never"
    );
}

#[tokio::test]
async fn notify_returns_at_once_while_the_receiver_is_slow() {
    let receiver = Receiver::start(Script {
        delay: Mutex::new(Duration::from_millis(500)),
        ..Script::default()
    })
    .await;
    let (webhook, metrics) = start(&receiver, Duration::from_secs(5), QUEUE_CAPACITY);
    let started = Instant::now();
    for i in 0..3 {
        webhook.notify(requested(&format!("att_{i}")));
    }
    assert!(
        started.elapsed() < Duration::from_millis(50),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(count(&metrics, WebhookDelivery::Delivered), 0);
    counted(&metrics, WebhookDelivery::Delivered, 1).await;
    assert!(started.elapsed() >= Duration::from_millis(500));
}

#[test]
fn the_shipped_schedule_is_six_tries_of_five_seconds() {
    let schedule = RetrySchedule::default();
    assert_eq!(schedule.tries(), 6);
    assert_eq!(schedule.waits, [1, 2, 4, 8, 16].map(Duration::from_secs));
    assert_eq!(schedule.timeout, Duration::from_secs(5));
}

#[test]
fn a_webhook_needs_an_http_url_and_a_long_enough_secret_file() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good");
    std::fs::write(&good, [SECRET, b"\n"].concat()).unwrap();
    let short = dir.path().join("short");
    // 31 bytes once the newline is removed.
    std::fs::write(&short, [&SECRET[..31], b"\n"].concat()).unwrap();
    let url = "https://hooks.example.org/atmost?token=s3cret";
    let from = |url: Option<&str>, file: Option<&Path>| WebhookConfig::from_flags(url, file);

    assert!(from(None, None).unwrap().is_none());
    assert!(
        from(Some(""), None).unwrap().is_none(),
        "an empty variable is not given"
    );
    let config = from(Some(url), Some(&good)).unwrap().unwrap();
    assert_eq!(config.url.as_str(), url);
    assert_eq!(config.schedule, RetrySchedule::default());
    assert_eq!(config.queue_capacity, QUEUE_CAPACITY);
    assert!(from(Some("http://127.0.0.1:9000/hook"), Some(&good)).is_ok());

    let e = from(Some(url), None).unwrap_err();
    assert!(e.contains("--approval-webhook-secret-file"), "{e}");
    let e = from(None, Some(&good)).unwrap_err();
    assert!(
        e.starts_with(&format!(
            "--approval-webhook-secret-file {}",
            good.display()
        )),
        "{e}"
    );
    let e = from(Some(url), Some(&short)).unwrap_err();
    assert!(
        e.starts_with(&format!(
            "--approval-webhook-secret-file {}: ",
            short.display()
        )),
        "{e}"
    );
    assert!(e.contains("31 bytes") && e.contains("at least 32"), "{e}");
    let missing = dir.path().join("missing");
    let e = from(Some(url), Some(&missing)).unwrap_err();
    assert!(
        e.starts_with(&format!(
            "--approval-webhook-secret-file {}: ",
            missing.display()
        )),
        "{e}"
    );
    for bad in [
        "ftp://hooks.example.org/x",
        "hooks.example.org/atmost",
        "file:///etc/passwd",
        "https://",
    ] {
        let e = from(Some(bad), Some(&good)).unwrap_err();
        assert!(
            e.starts_with("--approval-webhook (ATMOST_APPROVAL_WEBHOOK)"),
            "{bad}: {e}"
        );
    }
    let e = from(Some("https://[s3cret/atmost"), Some(&good))
        .map(|_| String::new())
        .unwrap_or_else(|e| e);
    assert!(!e.contains("s3cret"), "the URL is never shown: {e}");
}

#[test]
fn one_trailing_newline_is_removed_from_the_secret_and_nothing_else() {
    let with_newline = WebhookSecret::from_file_bytes(&[SECRET, b"\n"].concat()).unwrap();
    let without = WebhookSecret::from_file_bytes(SECRET).unwrap();
    assert_eq!(
        with_newline.signature(1, b"{}"),
        without.signature(1, b"{}")
    );
    let two = WebhookSecret::from_file_bytes(&[SECRET, b"\n\n"].concat()).unwrap();
    assert_ne!(two.signature(1, b"{}"), without.signature(1, b"{}"));
    assert_eq!(format!("{without:?}"), "WebhookSecret(redacted)");
    // The signature of a known secret, time and body, as any HMAC-SHA256 computes it (Python's
    // `hmac.new(secret, b'1796637600.{"a":1}', hashlib.sha256)` gives the same).
    assert_eq!(
        without.signature(1_796_637_600, b"{\"a\":1}"),
        "t=1796637600,v1=05f861a2523e6aae8086fd95068d2d57130096417bfef18b9b51de6fac7e1790"
    );
    let mut mac = Hmac::<Sha256>::new_from_slice(SECRET).unwrap();
    mac.update(b"1796637600.{\"a\":1}");
    assert_eq!(
        without.signature(1_796_637_600, b"{\"a\":1}"),
        format!(
            "t=1796637600,v1={}",
            hex::encode(mac.finalize().into_bytes())
        )
    );
}

#[test]
fn spawning_outside_a_runtime_is_an_error_not_a_panic() {
    let config = WebhookConfig {
        url: "http://127.0.0.1:1/hook".parse().unwrap(),
        secret: WebhookSecret::from_file_bytes(SECRET).unwrap(),
        schedule: RetrySchedule::default(),
        queue_capacity: 1,
    };
    let metrics = Arc::new(Metrics::new().unwrap());
    assert!(Webhook::spawn(config, metrics, Arc::new(ManualClock::new(0))).is_err());
}
