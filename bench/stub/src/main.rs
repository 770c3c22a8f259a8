//! Benchmark stubs, both on one single-threaded runtime (so a stub never takes more than
//! one core from the setup under test):
//!
//! - `--mcp PORT`: a minimal MCP upstream over Streamable HTTP with JSON responses. It
//!   answers `initialize`, `tools/list` and `tools/call` (echoing the request's `id`),
//!   and 202 to notifications. Enough for the gateway to see real JSON-RPC responses.
//!   It keeps the header lines of the first request that carries a dispatch signature
//!   (a `signature` header) and answers them, as JSON, to `GET /_bench/signed`: what a
//!   signed dispatch adds to the upstream request, read from one the run really sent.
//!   `DELETE /_bench/signed` forgets it, so the next signed request is kept (the runner
//!   does so before a setup whose ledger really signs: D0's signatures stand in).
//! - `--callout PORT`: a static target for the reference callout filter: every request
//!   gets the same small JSON body (the shape of an authorize `dispatch` answer), except
//!   `POST /v1/outcomes`, which gets one `applied` ack per report. An authorize request
//!   naming a dispatch target is answered with a signature over it in the ledger's form
//!   (`atmost_protocol::signature`), its 64 bytes standing in: the gateway checks the
//!   form, not the bytes, which are the verifier's to check. That is enough for atmost
//!   itself to run against it as a ledger that decides nothing, stores nothing and signs
//!   for free (setup D0: the gateway's own cost).
//!
//! Both speak HTTP/1.1 and HTTP/2 with prior knowledge (h2c), like the ledger.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use atmost_protocol::signature::{self, DispatchNonce};
use atmost_protocol::{token, AuthorizeRequest};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::Value;
use tokio::net::TcpListener;

/// The first signed request's header lines, as JSON, since the last `DELETE`.
static SIGNED: Mutex<Option<Vec<u8>>> = Mutex::new(None);
/// Whether [`SIGNED`] holds one: every request reads it, only a keeping one locks.
static KEPT: AtomicBool = AtomicBool::new(false);

fn record_signed(req: &Request<Incoming>) {
    if KEPT.load(Ordering::Relaxed) || !req.headers().contains_key("signature") {
        return;
    }
    let headers: Vec<(String, String)> = req
        .headers()
        .iter()
        .map(|(n, v)| {
            (
                n.as_str().to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let record = serde_json::json!({
        "method": req.method().as_str(),
        "uri": req.uri().to_string(),
        "version": format!("{:?}", req.version()),
        "headers": headers,
    });
    if let Ok(mut kept) = SIGNED.lock() {
        kept.get_or_insert_with(|| record.to_string().into_bytes());
        KEPT.store(true, Ordering::Relaxed);
    }
}

/// `GET /_bench/signed`: the kept request; `DELETE`: forget it.
fn signed_answer(method: &hyper::Method) -> Response<Full<Bytes>> {
    let Ok(mut kept) = SIGNED.lock() else {
        return json(StatusCode::INTERNAL_SERVER_ERROR, b"{}".to_vec());
    };
    if method == hyper::Method::DELETE {
        *kept = None;
        KEPT.store(false, Ordering::Relaxed);
        return json(StatusCode::OK, b"{}".to_vec());
    }
    match kept.as_ref() {
        Some(record) => json(StatusCode::OK, record.clone()),
        None => json(StatusCode::NOT_FOUND, b"{}".to_vec()),
    }
}

const CALLOUT_BODY: &str = r#"{"decision":"dispatch","attempt_id":"bench","permit_id":"bench","lease_ms":120000,"round":1,"capability":"bench"}"#;

/// The static Dispatch answer, under the permit the token names and signed over the
/// request's dispatch target, when the request is an authorize naming one (the gateway sends
/// nothing upstream under another permit or without a signature).
fn authorize_answer(body: &[u8]) -> Vec<u8> {
    // The reference callout filter's static request (setups S, S2) names none: answered
    // without parsing, as before signing.
    const DISPATCH: &[u8] = br#""dispatch""#;
    if !body.windows(DISPATCH.len()).any(|w| w == DISPATCH) {
        return CALLOUT_BODY.as_bytes().to_vec();
    }
    let Some((req, target)) = serde_json::from_slice::<AuthorizeRequest>(body)
        .ok()
        .and_then(|r| r.dispatch.clone().map(|t| (r, t)))
    else {
        return CALLOUT_BODY.as_bytes().to_vec();
    };
    let Some(permit_id) = token::permit_id_of(&req.permit_token) else {
        return CALLOUT_BODY.as_bytes().to_vec();
    };
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let nonce = DispatchNonce {
        attempt_id: "bench".into(),
        round: 1,
        permit_id: permit_id.into(),
        tool: req.tool.clone(),
    };
    let Some((input, _)) = target.to_sign(created, "bench", &nonce) else {
        return CALLOUT_BODY.as_bytes().to_vec();
    };
    let signed = serde_json::json!({
        "signature_input": input.header_value(),
        "signature": signature::signature_header(&[7; 64]),
    });
    let mut answer: Value = match serde_json::from_str(CALLOUT_BODY) {
        Ok(v) => v,
        Err(_) => return CALLOUT_BODY.as_bytes().to_vec(),
    };
    answer["permit_id"] = Value::from(permit_id);
    answer["signature"] = signed;
    answer.to_string().into_bytes()
}

fn json(status: StatusCode, body: Vec<u8>) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    resp
}

/// An outcomes batch answered as the ledger would if every report applied.
fn outcomes_answer(body: &[u8]) -> Response<Full<Bytes>> {
    let reports = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.get("reports").and_then(Value::as_array).map(Vec::len));
    match reports {
        Some(n) => {
            let acks = vec![r#""applied""#; n].join(",");
            json(
                StatusCode::OK,
                format!(r#"{{"acks":[{acks}]}}"#).into_bytes(),
            )
        }
        None => json(
            StatusCode::BAD_REQUEST,
            br#"{"error":"not a batch"}"#.to_vec(),
        ),
    }
}

fn mcp_answer(body: &[u8]) -> Response<Full<Bytes>> {
    let Ok(msg) = serde_json::from_slice::<Value>(body) else {
        return json(
            StatusCode::BAD_REQUEST,
            br#"{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"Parse error"}}"#
                .to_vec(),
        );
    };
    let Some(id) = msg.get("id") else {
        // A notification: accepted, no body.
        let mut resp = Response::new(Full::new(Bytes::new()));
        *resp.status_mut() = StatusCode::ACCEPTED;
        return resp;
    };
    let id = id.to_string();
    let result = match msg.get("method").and_then(Value::as_str) {
        Some("initialize") => r#"{"protocolVersion":"2025-06-18","capabilities":{"tools":{"listChanged":false}},"serverInfo":{"name":"atmost-bench-stub","version":"0.1.0"}}"#,
        Some("tools/list") => r#"{"tools":[{"name":"echo","description":"Echoes text","inputSchema":{"type":"object","properties":{"text":{"type":"string"}},"required":["text"]}}]}"#,
        Some("tools/call") => r#"{"content":[{"type":"text","text":"ok"}],"isError":false}"#,
        _ => {
            return json(
                StatusCode::OK,
                format!(r#"{{"jsonrpc":"2.0","id":{id},"error":{{"code":-32601,"message":"Method not found"}}}}"#)
                    .into_bytes(),
            )
        }
    };
    json(
        StatusCode::OK,
        format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{result}}}"#).into_bytes(),
    )
}

async fn serve(listener: TcpListener, mcp: bool) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| async move {
                let outcomes = req.uri().path() == "/v1/outcomes";
                if mcp && req.uri().path() == "/_bench/signed" {
                    return Ok::<_, Infallible>(signed_answer(req.method()));
                }
                if mcp {
                    record_signed(&req);
                }
                let body = match req.into_body().collect().await {
                    Ok(b) => b.to_bytes(),
                    Err(_) => Bytes::new(),
                };
                let resp = if mcp {
                    mcp_answer(&body)
                } else if outcomes {
                    outcomes_answer(&body)
                } else {
                    json(StatusCode::OK, authorize_answer(&body))
                };
                Ok::<_, Infallible>(resp)
            });
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

fn usage() -> ! {
    eprintln!("usage: atmost-bench-stub [--mcp PORT] [--callout PORT]");
    std::process::exit(2)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.is_empty() || args.iter().any(|a| a == "--help" || a == "-h") {
        usage();
    }
    let mut tasks = Vec::new();
    for pair in args.chunks(2) {
        let [flag, port] = pair else { usage() };
        let mcp = match flag.as_str() {
            "--mcp" => true,
            "--callout" => false,
            _ => usage(),
        };
        let Ok(port) = port.parse::<u16>() else {
            usage()
        };
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let listener = match TcpListener::bind(addr).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("atmost-bench-stub: cannot listen on {addr}: {e}");
                std::process::exit(1)
            }
        };
        tasks.push(tokio::spawn(serve(listener, mcp)));
    }
    let _ = tokio::signal::ctrl_c().await;
}
