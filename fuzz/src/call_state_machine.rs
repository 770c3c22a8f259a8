//! `call_state_machine`: one request's state machine (`call::Call`, what runs per request
//! in Envoy) driven by an arbitrary sequence of Envoy callbacks and ledger answers.
//!
//! Asserts, besides never panicking:
//! - after a local reply nothing else happens: no second reply, no resume, no callout;
//! - `ResumeRequest` / `ResumeResponse` only come from a ledger answer (a callout
//!   callback), `ResumeRequest` at most once and only after an authorize callout whose
//!   answer was `dispatch` with HTTP 200;
//! - the body step of a governed `tools/call` never lets the request continue: it pauses
//!   (callout or local reply);
//! - an authorize callout carries the permit token and the body's tool, and at most one
//!   authorize callout is made per request;
//! - the upstream `Idempotency-Key` set on dispatch is 64 hex digits in `hmac` mode and
//!   never the raw key;
//! - every local reply is JSON; a denial answers with the request's JSON-RPC id;
//! - at most one outcome report per dispatched attempt is handed to the root queue, and a
//!   receipt-bearing report (`completed`, …) is never followed by `released`.

use arbitrary::{Arbitrary, Unstructured};
use atmost_config::{Config, UpstreamKey};
use atmost_filter::call::{
    BodyStep, Call, Effect, Flow, LogProps, RequestHead, ResponseHead, Step, IDEMPOTENCY_HEADER,
};
use atmost_filter::ledger::{Endpoint, LedgerReply};
use atmost_filter::mcp::{self, Message, Mirrored};
use atmost_filter::resume::Ticket;
use atmost_protocol::{AuthorizeRequest, Outcome};
use serde_json::{json, Value};
use std::rc::Rc;

const CONFIGS: [&str; 4] = [
    r#"{"ledger":{"cluster":"l","service_token":"t"},"upstream_key":{"secret":"0123456789abcdef0123"}}"#,
    r#"{"ledger":{"cluster":"l","service_token":"t"},"upstream_key":{"mode":"raw"},"denial_format":"error","max_body_bytes":64,"max_receipt_bytes":48,"governed_tools":["pay"]}"#,
    r#"{"ledger":{"cluster":"l","service_token":"t"},"upstream_key":{"mode":"off"},"key_required_tools":["*"],"permit_header":"x-permit"}"#,
    r#"{"ledger":{"cluster":"l","service_token":"t"},"upstream_key":{"secret":"0123456789abcdef0123"},"max_body_bytes":1,"max_receipt_bytes":1}"#,
];

const BODIES: [&str; 8] = [
    r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"pay","arguments":{"amount":1}}}"#,
    r#"{"jsonrpc":"2.0","id":"a","method":"tools/call","params":{"name":"pay","_meta":{"dev.atmost/idempotency-key":"k1"}}}"#,
    r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"echo","arguments":{"text":"x"}}}"#,
    r#"{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"pay","requestState":"s"}}"#,
    r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
    r#"[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"pay"}}]"#,
    r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
    "not json",
];

const RESPONSES: [&str; 6] = [
    r#"{"jsonrpc":"2.0","id":7,"result":{"content":[{"type":"text","text":"ok"}]}}"#,
    r#"{"jsonrpc":"2.0","id":"a","error":{"code":-1,"message":"m"}}"#,
    "data: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{\"content\":[]}}\n\n",
    "id: e1\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\"}\n\n",
    r#"{"jsonrpc":"2.0","id":4,"result":{"resultType":"input_required","requestState":"s"}}"#,
    r#"{"jsonrpc":"2.0","id":3,"result":{"task":{"taskId":"t1"}}}"#,
];

#[derive(Arbitrary, Debug)]
enum Bytes {
    Known(u8),
    Raw(Vec<u8>),
}

impl Bytes {
    fn get<'a>(&'a self, table: &[&'a str]) -> &'a [u8] {
        match self {
            Bytes::Known(i) => table[usize::from(*i) % table.len()].as_bytes(),
            Bytes::Raw(b) => b,
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Status {
    Ok,
    /// Zero headers: the callout failed or timed out.
    Failed,
    Other(u16),
}

#[derive(Arbitrary, Debug)]
enum Permit {
    Valid,
    Raw(Vec<Vec<u8>>),
}

#[derive(Arbitrary, Debug)]
enum LedgerBody {
    Dispatch,
    Replay(Bytes),
    Deny(u8),
    Acks(u8),
    Raw(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
enum Ev {
    RequestHeaders {
        method: u8,
        permits: Permit,
        keys: Vec<Vec<u8>>,
        mcp_method: Option<String>,
        mcp_name: Option<String>,
        version: Option<String>,
        duplicated: bool,
        content_length: Option<u64>,
        end_of_stream: bool,
        session: Option<String>,
        resume: bool,
    },
    RequestBody {
        size: u32,
        end_of_stream: bool,
    },
    RequestBodyData(Bytes),
    RequestTrailers,
    CalloutFailed,
    LedgerReply {
        status: Status,
        body: LedgerBody,
    },
    ResponseHeaders {
        content_type: u8,
        end_of_stream: bool,
    },
    ResponseBody {
        size: u32,
        end_of_stream: bool,
    },
    ResponseTrailers,
    ResponseBodyData {
        bytes: Bytes,
        end_of_stream: bool,
    },
    Log {
        attempts: Option<u8>,
        flags: Option<u64>,
    },
}

#[derive(Default)]
struct Watch {
    /// A local reply was sent.
    answered: bool,
    /// The pending callout is an authorize.
    authorize_pending: bool,
    authorize_callouts: usize,
    resumed_request: bool,
    /// The last request body read, and its JSON-RPC id.
    body_id: Option<Value>,
    raw_key: Option<String>,
    /// Outcome reports handed to the queue or sent, in order (kind names).
    reports: Vec<&'static str>,
    /// A report is out on an outcomes callout.
    outcomes_pending: bool,
}

fn kind(o: &Outcome) -> &'static str {
    match o {
        Outcome::Completed { .. } => "completed",
        Outcome::InputRequired { .. } => "input_required",
        Outcome::Accepted { .. } => "accepted",
        Outcome::Released { .. } => "released",
        Outcome::Uncertain { .. } => "uncertain",
    }
}

fn ledger_reply(status: &Status, body: &LedgerBody) -> (LedgerReply, bool) {
    let (bytes, dispatch) = match body {
        LedgerBody::Dispatch => (
            json!({"decision":"dispatch","attempt_id":"att-1","permit_id":"p-1","lease_ms":1000,"round":1,"capability":"cap-1"})
                .to_string()
                .into_bytes(),
            true,
        ),
        LedgerBody::Replay(r) => (
            json!({"decision":"replay","attempt_id":"att-0",
                   "receipt": String::from_utf8_lossy(r.get(&RESPONSES))})
            .to_string()
            .into_bytes(),
            false,
        ),
        LedgerBody::Deny(c) => {
            let codes = [
                "permit_invalid",
                "permit_max_calls_exceeded",
                "delivery_uncertain",
                "idempotency_key_conflict",
                "bogus_code",
            ];
            (
                json!({"decision":"deny","code":codes[usize::from(*c) % codes.len()],"message":"no","data":{"tool":"pay","limit":1}}).to_string().into_bytes(),
                false,
            )
        }
        LedgerBody::Acks(n) => {
            let acks: Vec<&str> = (0..n % 3)
                .map(|i| ["applied", "already_recorded", "conflict"][usize::from(i)])
                .collect();
            (json!({"acks": acks}).to_string().into_bytes(), false)
        }
        LedgerBody::Raw(b) => (b.clone(), false),
    };
    let status = match status {
        Status::Ok => Some(200),
        Status::Failed => None,
        Status::Other(n) => Some(u32::from(*n)),
    };
    (
        LedgerReply {
            status,
            body: bytes,
        },
        dispatch && status == Some(200),
    )
}

fn observe(w: &mut Watch, cfg: &Config, step: &Step, from_ledger: bool) {
    if w.answered {
        assert!(
            step.callout.is_none(),
            "callout after a local reply: {step:?}"
        );
        for e in &step.effects {
            assert!(
                !matches!(
                    e,
                    Effect::LocalReply(_) | Effect::ResumeRequest | Effect::ResumeResponse
                ),
                "{e:?} after a local reply"
            );
        }
    }
    for e in &step.effects {
        match e {
            Effect::LocalReply(r) => {
                w.answered = true;
                let v = crate::util::assert_reply_is_json(r);
                if r.header("atmost-denial").is_some() {
                    if let Some(id) = &w.body_id {
                        assert_eq!(&v["id"], id, "denial answers another id");
                    }
                }
            }
            Effect::ResumeRequest | Effect::ResumeResponse => {
                assert!(from_ledger, "{e:?} outside a callout callback");
            }
            Effect::SetRequestHeader(name, value) if name == IDEMPOTENCY_HEADER => {
                if let UpstreamKey::Hmac { .. } = cfg.upstream_key {
                    assert_eq!(value.len(), 64);
                    assert!(value.bytes().all(|b| b.is_ascii_hexdigit()));
                    assert_ne!(Some(value), w.raw_key.as_ref(), "raw key sent upstream");
                }
            }
            Effect::Enqueue(r) => w.reports.push(kind(&r.outcome)),
            _ => {}
        }
    }
    if let Some(c) = &step.callout {
        match c.endpoint {
            Endpoint::Authorize => {
                w.authorize_callouts += 1;
                w.authorize_pending = true;
                assert_eq!(w.authorize_callouts, 1, "a second authorize callout");
                match serde_json::from_slice::<AuthorizeRequest>(&c.body) {
                    Ok(req) => {
                        assert!(!req.permit_token.is_empty());
                        assert_eq!(req.fingerprint.len(), 64);
                        w.raw_key = req.idempotency_key;
                    }
                    Err(e) => panic!("authorize callout body is not an AuthorizeRequest: {e}"),
                }
            }
            Endpoint::Outcomes => {
                w.outcomes_pending = true;
                match serde_json::from_slice::<atmost_protocol::OutcomesRequest>(&c.body) {
                    Ok(req) => {
                        assert_eq!(req.reports.len(), 1);
                        for r in &req.reports {
                            w.reports.push(kind(&r.outcome));
                        }
                    }
                    Err(e) => panic!("outcomes callout body is not an OutcomesRequest: {e}"),
                }
            }
        }
    }
}

fn body_step(w: &mut Watch, cfg: &Config, s: BodyStep) {
    if let BodyStep::Done(step) = s {
        observe(w, cfg, &step, false);
    }
}

pub fn check(data: &[u8]) {
    run(data);
}

/// What a run reached: (the request was dispatched, outcome reports made). Tests use it to
/// show the committed corpus drives the machine past the ledger.
pub fn reach(data: &[u8]) -> (bool, usize) {
    run(data)
}

fn run(data: &[u8]) -> (bool, usize) {
    let mut u = Unstructured::new(data);
    let Ok(ci) = u8::arbitrary(&mut u) else {
        return (false, 0);
    };
    let cfg = match Config::parse(CONFIGS[usize::from(ci) % CONFIGS.len()].as_bytes()) {
        Ok(c) => Rc::new(c),
        Err(e) => panic!("fuzz config refused: {e}"),
    };
    let Ok(events) = Vec::<Ev>::arbitrary_take_rest(u) else {
        return (false, 0);
    };
    let mut call = Call::new(Rc::clone(&cfg));
    let mut w = Watch::default();
    let mut mirrored = Mirrored::default();
    let mut dispatched_reports_start: Option<usize> = None;

    for ev in events.iter().take(64) {
        match ev {
            Ev::RequestHeaders {
                method,
                permits,
                keys,
                mcp_method,
                mcp_name,
                version,
                duplicated,
                content_length,
                end_of_stream,
                session,
                resume,
            } => {
                mirrored = Mirrored {
                    method: mcp_method.clone(),
                    name: mcp_name.clone(),
                    protocol_version: version.clone(),
                    duplicated: *duplicated,
                };
                let head = RequestHead {
                    method: ["POST", "GET", "DELETE", "post", ""][usize::from(*method) % 5]
                        .to_string(),
                    permit: match permits {
                        Permit::Valid => vec![b"tok-123".to_vec()],
                        Permit::Raw(p) => p.clone(),
                    },
                    idempotency_key: keys.clone(),
                    mirrored: mirrored.clone(),
                    content_length: *content_length,
                    // Fixed, so the committed seeds keep their meaning; the charset and
                    // encoding checks have their own unit tests.
                    content_type: vec![b"application/json".to_vec()],
                    content_encoding: Vec::new(),
                    end_of_stream: *end_of_stream,
                    session_id: session.clone(),
                    path: "/mcp".into(),
                    resume: resume.then(|| Ticket {
                        grant: atmost_protocol::DispatchGrant {
                            attempt_id: "att-r".into(),
                            round: 1,
                            capability: "cap-r".into(),
                        },
                        id: json!(7),
                        tool: "pay".into(),
                        permit_hash: atmost_filter::resume::permit_hash(b"tok-123"),
                        path: "/mcp".into(),
                    }),
                };
                let s = call.on_request_headers(head);
                observe(&mut w, &cfg, &s, false);
            }
            Ev::RequestBody {
                size,
                end_of_stream,
            } => {
                let s = call.on_request_body(*size as usize, *end_of_stream);
                body_step(&mut w, &cfg, s);
            }
            Ev::RequestBodyData(b) => {
                let body = b.get(&BODIES);
                let governed = match mcp::parse(body, &mirrored) {
                    Ok(Message::ToolCall(c)) => {
                        w.body_id = Some(c.id.clone());
                        cfg.governed_tools.contains(&c.name)
                    }
                    _ => false,
                };
                let was_reading = call.state_name() == "reading_body";
                let s = call.on_request_body_data(body);
                if was_reading && governed {
                    assert_eq!(
                        s.flow,
                        Flow::Pause,
                        "a governed tools/call continued unchecked"
                    );
                    assert!(
                        s.callout.is_some()
                            || s.effects.iter().any(|e| matches!(e, Effect::LocalReply(_))),
                        "a governed tools/call neither asked the ledger nor answered: {s:?}"
                    );
                }
                observe(&mut w, &cfg, &s, false);
            }
            Ev::RequestTrailers => {
                let s = call.on_request_trailers();
                observe(&mut w, &cfg, &s, false);
            }
            Ev::CalloutFailed => {
                let s = call.on_callout_failed();
                w.authorize_pending = false;
                w.outcomes_pending = false;
                observe(&mut w, &cfg, &s, false);
            }
            Ev::LedgerReply { status, body } => {
                let (reply, dispatch_ok) = ledger_reply(status, body);
                let authorizing = w.authorize_pending && call.state_name() == "authorizing";
                let s = call.on_ledger_reply(&reply);
                let resumes = s.effects.iter().any(|e| matches!(e, Effect::ResumeRequest));
                if resumes {
                    assert!(
                        authorizing && dispatch_ok,
                        "resumed without a dispatch decision"
                    );
                    assert!(!w.resumed_request, "resumed twice");
                    w.resumed_request = true;
                    dispatched_reports_start = Some(w.reports.len());
                }
                if authorizing {
                    w.authorize_pending = false;
                }
                w.outcomes_pending = false;
                observe(&mut w, &cfg, &s, true);
            }
            Ev::ResponseHeaders {
                content_type,
                end_of_stream,
            } => {
                let ct = [
                    None,
                    Some("application/json"),
                    Some("text/event-stream; charset=utf-8"),
                    Some("text/html"),
                    Some("APPLICATION/JSON;x=1"),
                ];
                let s = call.on_response_headers(ResponseHead {
                    content_type: ct[usize::from(*content_type) % ct.len()].map(str::to_string),
                    end_of_stream: *end_of_stream,
                });
                observe(&mut w, &cfg, &s, false);
            }
            Ev::ResponseBody {
                size,
                end_of_stream,
            } => {
                let s = call.on_response_body(*size as usize, *end_of_stream);
                body_step(&mut w, &cfg, s);
            }
            Ev::ResponseTrailers => {
                let s = call.on_response_trailers();
                body_step(&mut w, &cfg, s);
            }
            Ev::ResponseBodyData {
                bytes,
                end_of_stream,
            } => {
                let s = call.on_response_body_data(bytes.get(&RESPONSES), *end_of_stream);
                observe(&mut w, &cfg, &s, false);
            }
            Ev::Log { attempts, flags } => {
                let s = call.on_log(LogProps {
                    attempts: attempts.map(u64::from),
                    flags: *flags,
                });
                observe(&mut w, &cfg, &s, false);
            }
        }
    }

    // One report per dispatched attempt (a failed `completed` report may be queued again),
    // and nothing turns a captured receipt into `released`.
    if let Some(start) = dispatched_reports_start {
        let reports = &w.reports[start..];
        if let Some(first) = reports.first() {
            assert!(
                reports.iter().all(|k| k == first),
                "conflicting reports {reports:?}"
            );
        }
        if reports
            .iter()
            .any(|k| *k != "released" && *k != "uncertain")
        {
            assert!(
                !reports.contains(&"released"),
                "receipt then released: {reports:?}"
            );
        }
    }
    (w.resumed_request, w.reports.len())
}
