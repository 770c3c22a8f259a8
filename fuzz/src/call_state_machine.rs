//! `call_state_machine`: one request's state machine (`call::Call`, what runs per request
//! in Envoy) driven by an arbitrary sequence of Envoy callbacks and ledger answers. Each
//! step is carried out by the filter's own `effects::apply`, against a host that may
//! refuse a request edit or fail to dispatch a callout, as Envoy may.
//!
//! The request side follows the order Envoy keeps (headers first and once, then the body in
//! chunks until end of stream, then trailers if the request has them); the ledger's answers
//! and the response come at any time after the headers, in any order; `on_log` ends it.
//!
//! The global property: a POST whose body a plain `serde_json` reading sees as a
//! `tools/call` of a governed tool (or as anything a server could run as a `tools/call`
//! without being one cleanly: see [`crate::plain`]) reaches the upstream only through one
//! `ResumeRequest`, carried out in the callback of a ledger answer `dispatch` (HTTP 200) to
//! that request's authorize callout, after its upstream key edit; before that every
//! request callback returns `Pause`, whatever the callbacks and the host did. And a
//! `dispatch` answer does resume the request, unless the host refused an edit, when the
//! call is answered locally instead.
//!
//! Asserts besides, and besides never panicking:
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

use crate::plain;
use arbitrary::{Arbitrary, Unstructured};
use atmost_config::{Config, UpstreamKey};
use atmost_filter::call::effects::{self, Refused};
use atmost_filter::call::resume::Ticket;
use atmost_filter::call::{
    BodyStep, Call, Effect, Flow, LogProps, RequestHead, ResponseHead, Step, IDEMPOTENCY_HEADER,
};
use atmost_filter::ledger_client::{Callout, Endpoint, LedgerReply};
use atmost_filter::parse::mcp::{self, Message, Mirrored};
use atmost_protocol::signature;
use atmost_protocol::token::permit_id_of;
use atmost_protocol::{AuthorizeRequest, Outcome};
use serde_json::{json, Value};
use std::rc::Rc;

const CONFIGS: [&str; 4] = [
    r#"{"ledger":{"cluster":"l","service_token":"t"},"upstream_key":{"secret":"0123456789abcdef0123"}}"#,
    r#"{"ledger":{"cluster":"l","service_token":"t"},"upstream_key":{"mode":"raw"},"denial_format":"error","max_body_bytes":64,"max_receipt_bytes":48,"governed_tools":["pay"]}"#,
    r#"{"ledger":{"cluster":"l","service_token":"t"},"upstream_key":{"mode":"off"},"key_required_tools":["*"],"permit_header":"x-permit"}"#,
    r#"{"ledger":{"cluster":"l","service_token":"t"},"upstream_key":{"secret":"0123456789abcdef0123"},"max_body_bytes":1,"max_receipt_bytes":1}"#,
];

/// A token of the ledger's shape, naming permit `pmt_0123456789abcdef01234567`.
const VALID_TOKEN: &str = "atmp_pmt_0123456789abcdef01234567_0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

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
        /// The whole body the client sends (empty: the headers end the stream, unless
        /// trailers follow).
        body: Bytes,
        /// Trailers follow the body.
        trailers: bool,
        session: Option<String>,
        resume: bool,
    },
    /// The next chunk of the body arrives: `take` more bytes.
    RequestBody {
        take: u16,
    },
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

/// One callback, and how the host treats what the machine asks in it: `host % 8 == 1`
/// refuses the first request edit (header or body write), `host % 8 == 2` fails to
/// dispatch the callout; anything else does what is asked.
#[derive(Arbitrary, Debug)]
struct Event {
    ev: Ev,
    host: u8,
}

/// What the host carried out of one callback's step (through `effects::apply`).
#[derive(Debug)]
struct Done {
    flow: Flow,
    effects: Vec<Effect>,
    callouts: Vec<Callout>,
    /// A request edit was refused.
    refused: bool,
}

struct FuzzHost {
    refuse_edit: bool,
    fail_dispatch: bool,
    done: Done,
}

impl effects::Host for FuzzHost {
    fn effect(&mut self, effect: Effect) -> Result<(), Refused> {
        let edit = matches!(
            effect,
            Effect::RemoveRequestHeader(_)
                | Effect::SetRequestHeader(..)
                | Effect::ReplaceRequestBody { .. }
        );
        if edit && self.refuse_edit && !self.done.refused {
            self.done.refused = true;
            return Err(Refused);
        }
        self.done.effects.push(effect);
        Ok(())
    }

    fn dispatch(&mut self, callout: &Callout) -> bool {
        if self.fail_dispatch {
            return false;
        }
        self.done.callouts.push(callout.clone());
        true
    }
}

/// Carries out `step` as the adapter does.
fn carry_out(call: &mut Call, step: Step, host: u8) -> Done {
    let mut h = FuzzHost {
        refuse_edit: host % 8 == 1,
        fail_dispatch: host % 8 == 2,
        done: Done {
            flow: Flow::Pause,
            effects: Vec::new(),
            callouts: Vec::new(),
            refused: false,
        },
    };
    let flow = effects::apply(call, step, &mut h);
    Done { flow, ..h.done }
}

/// The request as the client sends it, and how far Envoy has delivered it.
#[derive(Default)]
struct Request {
    /// The headers were delivered (Envoy calls `on_request_headers` once).
    started: bool,
    body: Vec<u8>,
    trailers: bool,
    /// Body bytes delivered so far.
    arrived: usize,
    /// Nothing more comes in the request direction.
    finished: bool,
    /// A plain reading sees a call that must not reach the upstream unchecked.
    must_hold: bool,
    /// Some of the request went upstream: a request callback returned `Continue`, or it
    /// was resumed.
    forwarded: bool,
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
    /// The authorize request made, which a `dispatch` answer is for (its permit, and the
    /// request it asked the ledger to sign).
    asked: Option<AuthorizeRequest>,
    /// Outcome reports handed to the queue or sent, in order (kind names).
    reports: Vec<&'static str>,
    /// A report is out on an outcomes callout.
    outcomes_pending: bool,
    request: Request,
    /// `on_log` ran: the stream is over.
    logged: bool,
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

/// What a ledger signs for `asked`: the `Signature-Input` and `Signature` of a dispatch of
/// attempt `att_1`, round 1, under `permit_id` (the signature's bytes stand in: the filter
/// holds no key to check them).
fn ledger_signature(asked: &AuthorizeRequest, permit_id: &str) -> Option<Value> {
    let target = asked.dispatch.as_ref()?;
    let digest = signature::content_digest_from_hex(&target.body_sha256)?;
    let request = signature::SignedRequest {
        method: &target.method,
        authority: &target.authority,
        path: &target.path,
        content_digest: &digest,
        idempotency_key: target.idempotency_key.as_deref(),
    };
    let nonce = signature::DispatchNonce {
        attempt_id: "att_1".into(),
        round: 1,
        permit_id: permit_id.into(),
        tool: asked.tool.clone(),
    };
    let input = request.signature_params(&signature::SignatureParams {
        created: 1_764_680_000,
        expires: 1_764_680_000 + target.validity_s,
        keyid: "kid".into(),
        nonce: nonce.encode(),
    });
    Some(json!({
        "signature_input": input.header_value(),
        "signature": signature::signature_header(&[7; 64]),
    }))
}

fn ledger_reply(
    status: &Status,
    body: &LedgerBody,
    asked: Option<&AuthorizeRequest>,
) -> (LedgerReply, bool) {
    let (bytes, dispatch) = match body {
        LedgerBody::Dispatch => {
            // The ledger answers for the permit the token names, signing what was asked.
            let permit_id = asked
                .and_then(|a| permit_id_of(&a.permit_token))
                .unwrap_or("pmt_none");
            let mut answer = json!({"decision":"dispatch","attempt_id":"att_1","permit_id":permit_id,
                                    "lease_ms":1000,"round":1,"capability":"cap-1"});
            if let Some(sig) = asked.and_then(|a| ledger_signature(a, permit_id)) {
                answer["signature"] = sig;
            }
            (answer.to_string().into_bytes(), true)
        }
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

fn observe(w: &mut Watch, cfg: &Config, done: &Done, from_ledger: bool) {
    if w.answered {
        assert!(
            done.callouts.is_empty(),
            "callout after a local reply: {done:?}"
        );
        for e in &done.effects {
            assert!(
                !matches!(
                    e,
                    Effect::LocalReply(_) | Effect::ResumeRequest | Effect::ResumeResponse
                ),
                "{e:?} after a local reply"
            );
        }
    }
    for e in &done.effects {
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
    for c in &done.callouts {
        match c.endpoint {
            Endpoint::Authorize => {
                w.authorize_callouts += 1;
                w.authorize_pending = true;
                assert_eq!(w.authorize_callouts, 1, "a second authorize callout");
                match serde_json::from_slice::<AuthorizeRequest>(&c.body) {
                    Ok(req) => {
                        assert!(!req.permit_token.is_empty());
                        assert_eq!(req.fingerprint.len(), 64);
                        w.raw_key = req.idempotency_key.clone();
                        w.asked = Some(req);
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
            Endpoint::Limits => {
                match serde_json::from_slice::<atmost_protocol::LimitsRequest>(&c.body) {
                    Ok(req) => {
                        assert!(!req.permit_token.is_empty());
                        assert!(!req.tools.is_empty());
                    }
                    Err(e) => panic!("limits callout body is not a LimitsRequest: {e}"),
                }
            }
        }
    }
}

/// The end of a request callback (headers, body, trailers): `Continue` lets the request
/// (or the rest of it) go upstream, which a request that must be held may never do.
fn request_callback(w: &mut Watch, done: &Done) {
    if done.flow == Flow::Continue && !w.answered {
        assert!(
            !w.request.must_hold || w.request.forwarded,
            "a governed POST went upstream through Continue from a request callback, not through a dispatch: {done:?}"
        );
        w.request.forwarded = true;
    }
}

/// Whether a plain reading of `body` sent by `method` sees a call that must not reach the
/// upstream unchecked: a well-formed `tools/call` of a governed tool, or a body a server
/// could run as a `tools/call` that is not one well-formed call (the filter refuses those).
fn must_hold(cfg: &Config, method: &str, body: &[u8]) -> bool {
    if !method.eq_ignore_ascii_case("POST") {
        return false;
    }
    let Some(v) = plain::read(body) else {
        return false;
    };
    match plain::as_call(&v) {
        Some(c) => cfg.governed_tools.contains(&c.name),
        None => plain::could_be_call(&v),
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

/// The configuration and events an input decodes to (`cargo run --example explain -- FILE`
/// prints them), for reading a crash.
pub fn explain(data: &[u8]) -> String {
    let mut u = Unstructured::new(data);
    let Ok(ci) = u8::arbitrary(&mut u) else {
        return "empty input".into();
    };
    let events = Vec::<Event>::arbitrary_take_rest(u).unwrap_or_default();
    format!(
        "config: {}\n{events:#?}",
        CONFIGS[usize::from(ci) % CONFIGS.len()]
    )
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
    let Ok(events) = Vec::<Event>::arbitrary_take_rest(u) else {
        return (false, 0);
    };
    let mut call = Call::new(Rc::clone(&cfg));
    let mut w = Watch::default();
    let mut mirrored = Mirrored::default();
    let mut dispatched_reports_start: Option<usize> = None;

    for Event { ev, host } in events.iter().take(64) {
        let host = *host;
        // Envoy calls nothing before the request headers, and nothing after `on_log`.
        if !w.request.started && !matches!(ev, Ev::RequestHeaders { .. }) {
            continue;
        }
        if w.logged {
            break;
        }
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
                body,
                trailers,
                session,
                resume,
            } => {
                if w.request.started {
                    continue;
                }
                mirrored = Mirrored {
                    method: mcp_method.clone(),
                    name: mcp_name.clone(),
                    protocol_version: version.clone(),
                    duplicated: *duplicated,
                };
                let method = ["POST", "GET", "DELETE", "post", ""][usize::from(*method) % 5];
                let body = body.get(&BODIES).to_vec();
                let end_of_stream = body.is_empty() && !*trailers;
                w.request = Request {
                    started: true,
                    must_hold: must_hold(&cfg, method, &body),
                    body,
                    trailers: *trailers,
                    finished: end_of_stream,
                    ..Request::default()
                };
                let head = RequestHead {
                    method: method.to_string(),
                    permit: match permits {
                        Permit::Valid => vec![VALID_TOKEN.as_bytes().to_vec()],
                        Permit::Raw(p) => p.clone(),
                    },
                    idempotency_key: keys.clone(),
                    mirrored: mirrored.clone(),
                    content_length: *content_length,
                    // Fixed, so the committed seeds keep their meaning; the charset and
                    // encoding checks have their own unit tests.
                    content_type: vec![b"application/json".to_vec()],
                    content_encoding: Vec::new(),
                    end_of_stream,
                    session_id: session.clone(),
                    path: "/mcp".into(),
                    authority: "mcp.example".into(),
                    last_event_id: None,
                    control_headers: Vec::new(),
                    signature_headers: Vec::new(),
                    alias: None,
                    resume: resume.then(|| Ticket {
                        grant: atmost_protocol::DispatchGrant {
                            attempt_id: "att-r".into(),
                            round: 1,
                            capability: "cap-r".into(),
                        },
                        id: json!(7),
                        tool: "pay".into(),
                        permit_hash: atmost_filter::call::resume::permit_hash(
                            VALID_TOKEN.as_bytes(),
                        ),
                        path: "/mcp".into(),
                        limits: None,
                    }),
                };
                let s = call.on_request_headers(head);
                let done = carry_out(&mut call, s, host);
                observe(&mut w, &cfg, &done, false);
                request_callback(&mut w, &done);
            }
            Ev::RequestBody { take } => {
                let r = &mut w.request;
                if !r.started || r.finished || r.body.is_empty() || r.arrived == r.body.len() {
                    continue;
                }
                r.arrived = (r.arrived + usize::from(*take)).min(r.body.len());
                let end_of_stream = r.arrived == r.body.len() && !r.trailers;
                r.finished = end_of_stream;
                let done = match call.on_request_body(r.arrived, end_of_stream) {
                    BodyStep::Done(s) => carry_out(&mut call, s, host),
                    BodyStep::Read { len } => {
                        let body = r.body[..len.min(r.arrived)].to_vec();
                        let governed = match mcp::parse(&body, &mirrored) {
                            Ok(Message::ToolCall(c)) => {
                                w.body_id = Some(c.id.clone());
                                cfg.governed_tools.contains(&c.name)
                            }
                            _ => false,
                        };
                        let s = call.on_request_body_data(&body);
                        if governed {
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
                        carry_out(&mut call, s, host)
                    }
                };
                observe(&mut w, &cfg, &done, false);
                request_callback(&mut w, &done);
            }
            Ev::RequestTrailers => {
                let r = &mut w.request;
                if !r.started || r.finished || !r.trailers || r.arrived < r.body.len() {
                    continue;
                }
                r.finished = true;
                let s = call.on_request_trailers();
                let done = carry_out(&mut call, s, host);
                observe(&mut w, &cfg, &done, false);
                request_callback(&mut w, &done);
            }
            Ev::CalloutFailed => {
                let s = call.on_callout_failed();
                w.authorize_pending = false;
                w.outcomes_pending = false;
                let done = carry_out(&mut call, s, host);
                observe(&mut w, &cfg, &done, false);
            }
            Ev::LedgerReply { status, body } => {
                let (reply, dispatch_ok) = ledger_reply(status, body, w.asked.as_ref());
                let authorizing = w.authorize_pending && call.state_name() == "authorizing";
                let s = call.on_ledger_reply(&reply);
                let done = carry_out(&mut call, s, host);
                let resumes = done
                    .effects
                    .iter()
                    .position(|e| matches!(e, Effect::ResumeRequest));
                if let Some(at) = resumes {
                    assert!(
                        authorizing && dispatch_ok,
                        "resumed without a dispatch decision"
                    );
                    assert!(!w.resumed_request, "resumed twice");
                    assert!(
                        !w.request.forwarded,
                        "resumed a request that had already gone upstream"
                    );
                    assert!(
                        done.effects[..at].iter().any(|e| matches!(e,
                            Effect::SetRequestHeader(n, _) | Effect::RemoveRequestHeader(n)
                                if n == IDEMPOTENCY_HEADER)),
                        "resumed before the upstream key was set: {done:?}"
                    );
                    w.resumed_request = true;
                    w.request.forwarded = true;
                    dispatched_reports_start = Some(w.reports.len());
                } else if authorizing && dispatch_ok {
                    // A dispatch answer resumes the request, or answers it and reports the
                    // round never sent: a refused edit, or a dispatch the filter cannot send
                    // (a token naming no permit, so nothing was asked to be signed).
                    assert!(
                        done.effects
                            .iter()
                            .any(|e| matches!(e, Effect::LocalReply(_)))
                            && done.effects.iter().any(|e| matches!(e,
                                Effect::Enqueue(r) if matches!(r.outcome, Outcome::Released { .. }))),
                        "a dispatch answer neither resumed the request nor answered it: {done:?}"
                    );
                }
                if authorizing {
                    w.authorize_pending = false;
                }
                w.outcomes_pending = false;
                observe(&mut w, &cfg, &done, true);
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
                let done = carry_out(&mut call, s, host);
                observe(&mut w, &cfg, &done, false);
            }
            Ev::ResponseBody {
                size,
                end_of_stream,
            } => {
                if let BodyStep::Done(s) = call.on_response_body(*size as usize, *end_of_stream) {
                    let done = carry_out(&mut call, s, host);
                    observe(&mut w, &cfg, &done, false);
                }
            }
            Ev::ResponseTrailers => {
                if let BodyStep::Done(s) = call.on_response_trailers() {
                    let done = carry_out(&mut call, s, host);
                    observe(&mut w, &cfg, &done, false);
                }
            }
            Ev::ResponseBodyData {
                bytes,
                end_of_stream,
            } => {
                let s = call.on_response_body_data(bytes.get(&RESPONSES), *end_of_stream);
                let done = carry_out(&mut call, s, host);
                observe(&mut w, &cfg, &done, false);
            }
            Ev::Log { attempts, flags } => {
                w.logged = true;
                let s = call.on_log(LogProps {
                    attempts: attempts.map(u64::from),
                    flags: *flags,
                });
                let done = carry_out(&mut call, s, host);
                observe(&mut w, &cfg, &done, false);
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
