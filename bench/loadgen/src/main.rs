//! Load for the benchmarks, where a packaged tool cannot do it:
//!
//! `rate`: open-loop load at a fixed rate over HTTP/1.1 keep-alive connections. Request i
//! is due at `start + i / rate` (a dedicated pacing thread); its latency is measured from
//! that due time, not from when a connection was free to send it, so a stall shows up in
//! the percentiles instead of silently lowering the rate (coordinated omission
//! corrected, like wrk2 or `oha --latency-correction`). Bodies come from a file, one
//! template per line, used in turn; `{SEQ}` becomes a number unique in the run, so every
//! `tools/call` can carry a fresh idempotency key (which `oha` cannot do: it picks body
//! lines at random, so keys would repeat).
//!
//! `ledger`: the ledger alone. N workers over a few HTTP/2 (h2c) connections, each doing
//! authorize (fresh key) then a `completed` report for the attempt, as the filter does.
//!
//! Both can send their requests under several permits (`--permit-file`, one token a line):
//! request i carries token i mod n, so every permit gets the same share of the load, as n
//! agents of the same rate would.
//!
//! Both print one JSON object on stdout.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use atmost_protocol::{Outcome, OutcomeReport, OutcomesRequest};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio::sync::Notify;

type Res<T> = Result<T, String>;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn need(args: &[String], name: &str) -> Res<String> {
    arg(args, name).ok_or_else(|| format!("missing {name}"))
}

fn num<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> Res<T> {
    match arg(args, name) {
        None => Ok(default),
        Some(v) => v.parse().map_err(|_| format!("bad {name}: {v}")),
    }
}

fn all(args: &[String], name: &str) -> Vec<String> {
    args.windows(2)
        .filter(|w| w[0] == name)
        .map(|w| w[1].clone())
        .collect()
}

/// The permit tokens of `--permit-file` (one a line) and of `--permit` (comma-separated),
/// in that order.
fn permit_tokens(args: &[String]) -> Res<Vec<String>> {
    let mut tokens = Vec::new();
    if let Some(path) = arg(args, "--permit-file") {
        let text = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
        tokens.extend(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(str::to_string),
        );
    }
    if let Some(list) = arg(args, "--permit") {
        tokens.extend(
            list.split(',')
                .filter(|t| !t.is_empty())
                .map(str::to_string),
        );
    }
    Ok(tokens)
}

/// Host:port and path of an `http://` URL.
fn split_url(url: &str) -> Res<(String, String)> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("only http:// URLs: {url}"))?;
    Ok(match rest.find('/') {
        Some(i) => (rest[..i].to_string(), rest[i..].to_string()),
        None => (rest.to_string(), "/".to_string()),
    })
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn summary(mut lat_us: Vec<u64>) -> Value {
    lat_us.sort_unstable();
    json!({
        "p50_us": percentile(&lat_us, 50.0),
        "p90_us": percentile(&lat_us, 90.0),
        "p99_us": percentile(&lat_us, 99.0),
        "p999_us": percentile(&lat_us, 99.9),
        "max_us": lat_us.last().copied().unwrap_or(0),
    })
}

/// Due requests, shared by the pacing thread and the connection tasks.
struct Queue {
    due: Mutex<VecDeque<(u64, Instant)>>,
    notify: Notify,
}

#[derive(Default)]
struct Tally {
    ok: u64,
    non2xx: u64,
    errors: u64,
    lat_us: Vec<u64>,
}

async fn rate(args: &[String]) -> Res<Value> {
    let url = need(args, "--url")?;
    let rate: f64 = num(args, "--rate", 1000.0)?;
    let secs: f64 = num(args, "--duration", 5.0)?;
    let conns: usize = num(args, "--connections", 64)?;
    let prefix = arg(args, "--key-prefix").unwrap_or_else(|| "k".into());
    let templates: Vec<String> = std::fs::read_to_string(need(args, "--body-file")?)
        .map_err(|e| e.to_string())?
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_string)
        .collect();
    if templates.is_empty() {
        return Err("empty body file".into());
    }
    let headers: Vec<(String, String)> = all(args, "--header")
        .iter()
        .filter_map(|h| h.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    // Request i goes under permit i mod n (`atmost-permit`), none without a permit.
    let permits = Arc::new(permit_tokens(args)?);
    let (authority, path) = split_url(&url)?;
    let total = (rate * secs).round() as u64;
    let queue = Arc::new(Queue {
        due: Mutex::new(VecDeque::new()),
        notify: Notify::new(),
    });
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now() + Duration::from_millis(50);
    let interval = Duration::from_secs_f64(1.0 / rate);
    {
        let queue = Arc::clone(&queue);
        std::thread::spawn(move || {
            let mut i = 0u64;
            while i < total {
                let now = Instant::now();
                let mut pushed = false;
                while i < total {
                    let due = start + interval.mul_f64(i as f64);
                    if due > now {
                        break;
                    }
                    if let Ok(mut q) = queue.due.lock() {
                        q.push_back((i, due));
                    }
                    pushed = true;
                    i += 1;
                }
                if pushed {
                    queue.notify.notify_waiters();
                    for _ in 0..conns {
                        queue.notify.notify_one();
                    }
                }
                let next = start + interval.mul_f64(i as f64);
                let now = Instant::now();
                if next > now {
                    std::thread::sleep(next - now);
                }
            }
        });
    }
    let end_of_schedule = start + Duration::from_secs_f64(secs);
    let deadline = end_of_schedule + Duration::from_secs(3);
    let templates = Arc::new(templates);
    let headers = Arc::new(headers);
    let mut tasks = Vec::new();
    for _ in 0..conns {
        let stream = TcpStream::connect(&authority)
            .await
            .map_err(|e| format!("connect {authority}: {e}"))?;
        let _ = stream.set_nodelay(true);
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let (queue, done, templates, headers, permits) = (
            Arc::clone(&queue),
            Arc::clone(&done),
            Arc::clone(&templates),
            Arc::clone(&headers),
            Arc::clone(&permits),
        );
        let (authority, path, prefix) = (authority.clone(), path.clone(), prefix.clone());
        tasks.push(tokio::spawn(async move {
            let mut tally = Tally::default();
            loop {
                let next = queue.due.lock().ok().and_then(|mut q| q.pop_front());
                let Some((i, due)) = next else {
                    if done.load(Ordering::Relaxed) >= total || Instant::now() > deadline {
                        break;
                    }
                    let _ = tokio::time::timeout(Duration::from_millis(5), queue.notify.notified())
                        .await;
                    continue;
                };
                if Instant::now() > deadline {
                    break;
                }
                let t = &templates[(i as usize) % templates.len()];
                let body = t.replace("{SEQ}", &format!("{prefix}-{i}"));
                let mut req = Request::post(path.as_str())
                    .header("host", authority.as_str())
                    .header("content-type", "application/json")
                    .header("accept", "application/json, text/event-stream");
                for (k, v) in headers.iter() {
                    req = req.header(k.as_str(), v.as_str());
                }
                if !permits.is_empty() {
                    let permit = &permits[(i as usize) % permits.len()];
                    req = req.header("atmost-permit", permit.as_str());
                }
                let Ok(req) = req.body(Full::new(Bytes::from(body))) else {
                    tally.errors += 1;
                    continue;
                };
                let result = async {
                    send.ready().await?;
                    let resp = send.send_request(req).await?;
                    let status = resp.status();
                    resp.into_body().collect().await?;
                    Ok::<_, hyper::Error>(status)
                }
                .await;
                match result {
                    Ok(s) if s.is_success() => tally.ok += 1,
                    Ok(_) => tally.non2xx += 1,
                    Err(_) => {
                        tally.errors += 1;
                        done.fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                }
                tally
                    .lat_us
                    .push(u64::try_from(due.elapsed().as_micros()).unwrap_or(u64::MAX));
                done.fetch_add(1, Ordering::Relaxed);
            }
            tally
        }));
    }
    let mut all_t = Tally::default();
    for t in tasks {
        if let Ok(t) = t.await {
            all_t.ok += t.ok;
            all_t.non2xx += t.non2xx;
            all_t.errors += t.errors;
            all_t.lat_us.extend(t.lat_us);
        }
    }
    let finished = Instant::now();
    // Requests never answered (overload): counted with the time they had waited so far, a
    // lower bound, so the percentiles cannot look better than the truth.
    let completed = all_t.lat_us.len() as u64;
    let unfinished = total.saturating_sub(completed);
    let mut lat = all_t.lat_us;
    for i in completed..total {
        let due = start + interval.mul_f64(i as f64);
        lat.push(u64::try_from(finished.saturating_duration_since(due).as_micros()).unwrap_or(0));
    }
    let elapsed = finished.duration_since(start).as_secs_f64().min(secs + 3.0);
    let mut out = summary(lat);
    let extra = json!({
        "target_rps": rate,
        "scheduled": total,
        "completed": completed,
        "unfinished": unfinished,
        "ok": all_t.ok,
        "non2xx": all_t.non2xx,
        "errors": all_t.errors,
        "achieved_rps": completed as f64 / elapsed.max(secs),
        "overloaded": (completed as f64) < 0.99 * (total as f64),
        "connections": conns,
    });
    if let (Some(o), Some(e)) = (out.as_object_mut(), extra.as_object()) {
        o.extend(e.clone());
    }
    Ok(out)
}

async fn h2_conn(authority: &str) -> Res<hyper::client::conn::http2::SendRequest<Full<Bytes>>> {
    let stream = TcpStream::connect(authority)
        .await
        .map_err(|e| format!("connect {authority}: {e}"))?;
    let _ = stream.set_nodelay(true);
    let (send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    Ok(send)
}

async fn post(
    send: &mut hyper::client::conn::http2::SendRequest<Full<Bytes>>,
    authority: &str,
    path: &str,
    token: &str,
    body: Vec<u8>,
) -> Res<(u16, Bytes)> {
    let req = Request::post(format!("http://{authority}{path}"))
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {token}"))
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    send.ready().await.map_err(|e| e.to_string())?;
    let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((status, body))
}

async fn ledger(args: &[String]) -> Res<Value> {
    let (authority, _) = split_url(&need(args, "--url")?)?;
    let token = need(args, "--service-token")?;
    // Several permits: pair i goes under permit i mod n, so each gets the same share.
    let permits = Arc::new(permit_tokens(args)?);
    if permits.is_empty() {
        return Err("missing --permit or --permit-file".into());
    }
    let workers: usize = num(args, "--concurrency", 64)?;
    let conns: usize = num(args, "--connections", 2)?;
    let secs: f64 = num(args, "--duration", 10.0)?;
    let prefix = arg(args, "--key-prefix").unwrap_or_else(|| "lk".into());
    let batched = args.iter().any(|a| a == "--batched-completions");
    let mut senders = Vec::new();
    let mut batchers = Vec::new();
    for _ in 0..conns.max(1) {
        let send = h2_conn(&authority).await?;
        // One batcher per connection, as the filter has one per Envoy worker.
        batchers.push(Batcher::start(
            send.clone(),
            authority.clone(),
            token.clone(),
        ));
        senders.push(send);
    }
    let start = Instant::now();
    let stop = start + Duration::from_secs_f64(secs);
    let seq = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for w in 0..workers {
        let mut send = senders[w % senders.len()].clone();
        let batcher = batched.then(|| Arc::clone(&batchers[w % batchers.len()]));
        let (authority, token, permits, prefix, seq) = (
            authority.clone(),
            token.clone(),
            Arc::clone(&permits),
            prefix.clone(),
            Arc::clone(&seq),
        );
        tasks.push(tokio::spawn(async move {
            let mut tally = Tally::default();
            while Instant::now() < stop {
                let i = seq.fetch_add(1, Ordering::Relaxed);
                let key = format!("{prefix}-{i}");
                let permit = &permits[(i as usize) % permits.len()];
                let t0 = Instant::now();
                let auth = json!({
                    "permit_token": permit,
                    "tool": "echo",
                    "idempotency_key": key,
                    "fingerprint": format!("{i:064x}"),
                    "arguments": {"text": key},
                });
                let body = serde_json::to_vec(&auth).unwrap_or_default();
                let grant = match post(&mut send, &authority, "/v1/authorize", &token, body).await {
                    Ok((200, b)) => serde_json::from_slice::<Value>(&b).ok().and_then(|v| {
                        if v["decision"] != "dispatch" {
                            return None;
                        }
                        Some((
                            v["attempt_id"].as_str()?.to_string(),
                            u32::try_from(v["round"].as_u64()?).ok()?,
                            v["capability"].as_str()?.to_string(),
                        ))
                    }),
                    _ => None,
                };
                let Some((attempt_id, round, capability)) = grant else {
                    tally.errors += 1;
                    continue;
                };
                let report = OutcomeReport {
                    attempt_id,
                    round,
                    capability,
                    outcome: Outcome::Completed {
                        receipt: format!(
                            r#"{{"jsonrpc":"2.0","id":{i},"result":{{"content":[{{"type":"text","text":"ok"}}],"isError":false}}}}"#
                        ),
                    },
                };
                let answer = match &batcher {
                    Some(b) => b.report(report).await,
                    None => {
                        let body = serde_json::to_vec(&OutcomesRequest {
                            reports: vec![report],
                        })
                        .unwrap_or_default();
                        post(&mut send, &authority, "/v1/outcomes", &token, body).await
                    }
                };
                match answer {
                    Ok((200, b)) if b.windows(7).any(|w| w == b"applied") => {
                        tally.ok += 1;
                        tally
                            .lat_us
                            .push(u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX));
                    }
                    Ok(_) => tally.non2xx += 1,
                    Err(_) => tally.errors += 1,
                }
            }
            tally
        }));
    }
    let mut all_t = Tally::default();
    for t in tasks {
        if let Ok(t) = t.await {
            all_t.ok += t.ok;
            all_t.non2xx += t.non2xx;
            all_t.errors += t.errors;
            all_t.lat_us.extend(t.lat_us);
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    let mut out = summary(all_t.lat_us);
    let extra = json!({
        "pairs": all_t.ok,
        "pairs_per_s": all_t.ok as f64 / elapsed,
        "failed": all_t.errors + all_t.non2xx,
        "seconds": elapsed,
        "concurrency": workers,
        "connections": conns,
        "permits": permits.len(),
        "batched_completions": batched,
    });
    if let (Some(o), Some(e)) = (out.as_object_mut(), extra.as_object()) {
        o.extend(e.clone());
    }
    Ok(out)
}

/// Where a batched report's caller waits for its share of the answer.
type AnswerTo = tokio::sync::oneshot::Sender<Res<(u16, Bytes)>>;

/// Completion reports sent the way the filter's root context sends them
/// (`completion_reports: batched`): everything waiting goes in one request, the next request
/// leaves when the previous one is answered, and each caller waits for its batch's answer.
struct Batcher {
    waiting: Mutex<Vec<(OutcomeReport, AnswerTo)>>,
    notify: Notify,
}

/// Most reports in one request, as in the filter.
const MAX_BATCH: usize = 100;

impl Batcher {
    fn start(
        mut send: hyper::client::conn::http2::SendRequest<Full<Bytes>>,
        authority: String,
        token: String,
    ) -> Arc<Batcher> {
        let b = Arc::new(Batcher {
            waiting: Mutex::new(Vec::new()),
            notify: Notify::new(),
        });
        let me = Arc::clone(&b);
        tokio::spawn(async move {
            loop {
                let batch: Vec<_> = {
                    let mut w = me.waiting.lock().unwrap_or_else(|p| p.into_inner());
                    let n = w.len().min(MAX_BATCH);
                    w.drain(..n).collect()
                };
                if batch.is_empty() {
                    me.notify.notified().await;
                    continue;
                }
                let (reports, replies): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
                let body = serde_json::to_vec(&OutcomesRequest { reports }).unwrap_or_default();
                let answer = post(&mut send, &authority, "/v1/outcomes", &token, body).await;
                // Each caller gets its own ack: "applied" in the n-th place of the answer.
                let acks: Vec<String> = match &answer {
                    Ok((200, b)) => serde_json::from_slice::<Value>(b)
                        .ok()
                        .and_then(|v| v["acks"].as_array().cloned())
                        .unwrap_or_default()
                        .iter()
                        .map(|a| a.as_str().unwrap_or("").to_string())
                        .collect(),
                    _ => Vec::new(),
                };
                for (n, reply) in replies.into_iter().enumerate() {
                    let mine = match (&answer, acks.get(n)) {
                        (Ok((status, _)), Some(ack)) => Ok((*status, Bytes::from(ack.clone()))),
                        (Ok((status, body)), None) => Ok((*status, body.clone())),
                        (Err(e), _) => Err(e.clone()),
                    };
                    let _ = reply.send(mine);
                }
            }
        });
        b
    }

    async fn report(&self, report: OutcomeReport) -> Res<(u16, Bytes)> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((report, tx));
        self.notify.notify_one();
        rx.await.map_err(|e| e.to_string())?
    }
}

const USAGE: &str = "usage:
  atmost-bench-load rate --url http://H:P/path --rate RPS --duration S --body-file F
                         [--connections N] [--key-prefix P] [--header 'name: value']...
                         [--permit TOKEN[,TOKEN...]] [--permit-file F]
  atmost-bench-load ledger --url http://H:P --service-token T
                         (--permit TOKEN[,TOKEN...] | --permit-file F)
                         [--batched-completions]
                         [--concurrency 64] [--connections 2] [--duration 10] [--key-prefix P]";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build();
    let Ok(rt) = rt else {
        eprintln!("atmost-bench-load: no runtime");
        std::process::exit(1)
    };
    let result = match args.first().map(String::as_str) {
        Some("rate") => rt.block_on(rate(&args)),
        Some("ledger") => rt.block_on(ledger(&args)),
        _ => {
            eprintln!("{USAGE}");
            std::process::exit(2)
        }
    };
    match result {
        Ok(v) => println!("{v}"),
        Err(e) => {
            eprintln!("atmost-bench-load: {e}");
            std::process::exit(1)
        }
    }
}
