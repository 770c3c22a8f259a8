//! `call_state_machine`: one request's state machine (`call::Call`, what runs per request
//! in Envoy) driven by an arbitrary sequence of Envoy callbacks and ledger answers. Each
//! step is carried out by the filter's own `effects::apply`, against a host that may
//! refuse a request or response edit or fail to dispatch a callout, as Envoy may.
//!
//! The request side follows the order Envoy keeps (headers first and once, then the body in
//! chunks until end of stream, then trailers if the request has them); so does the
//! upstream's answer, which Envoy buffers while the filter holds it and passes on when it
//! lets it go ([`answer`]). The ledger's answers and the response come at any time after
//! the request headers, in any order; `on_log` ends it. The configurations cover both
//! `request_hold` modes and `tools_list_limits`, and the ledger answers each callout as the
//! ledger does: a signed Dispatch when asked to sign, the figures of the tools a limits
//! callout names, `403 permit_invalid`, other statuses, unreadable bodies, no answer.
//!
//! The global property: a POST whose body a plain `serde_json` reading sees as a
//! `tools/call` of a governed tool (or as anything a server could run as a `tools/call`
//! without being one cleanly: see [`crate::plain`]) reaches the upstream only through one
//! `ResumeRequest`, carried out in the callback of a ledger answer `dispatch` (HTTP 200) to
//! that request's authorize callout; before that every request callback returns `Pause`
//! (with `request_hold: body`, every callback but the headers', which lets the headers go
//! upstream at once), whatever the callbacks and the host did. And a `dispatch` answer does
//! resume the request, unless the host refused an edit, when the call is answered locally
//! instead, or (`request_hold: body`) the upstream answered first, when the attempt is
//! released.
//!
//! Asserts besides, and besides never panicking:
//! - after a local reply nothing else happens: no second reply, no resume, no callout;
//! - `ResumeRequest` / `ResumeResponse` only come from a ledger answer (a callout
//!   callback), `ResumeRequest` at most once and only after an authorize callout whose
//!   answer was `dispatch` with HTTP 200; `ResumeResponse` only while the answer is held;
//! - the body step of a governed `tools/call` never lets the request continue: it pauses
//!   (callout or local reply);
//! - an authorize callout carries the permit token and the body's tool, and at most one
//!   authorize callout is made per request;
//! - the upstream `Idempotency-Key` set on dispatch is 64 hex digits in `hmac` mode and
//!   never the raw key;
//! - no request header is edited once the headers went upstream;
//! - `request_hold: headers`: the authorize asks the ledger to sign the dispatch whenever
//!   the token names a permit, and the request resumes with the key set and the
//!   `Signature-Input` and `Signature` the ledger gave;
//! - `request_hold: body`: the headers of a POST with a body leave from its headers
//!   callback (unless it is refused there) and its body only through the dispatch; no
//!   `Idempotency-Key` header goes upstream for a POST under a permit that may be a governed
//!   call; the authorize asks for no signature; once the upstream answered before the
//!   decision the ledger is not asked any more, and its answer to an authorize already out
//!   resumes the held response, sends nothing, and releases a dispatched attempt;
//! - `tools_list_limits`: a limits callout only for the answer of a `tools/list` that
//!   carried a permit, at most one per answer, carrying that permit and only governed tools
//!   the answer lists; the answer is held while it is out; the ledger's reply resumes it
//!   once, and edits it only when the reply is a `200` `LimitsResponse`; a callout the host
//!   would not dispatch lets the answer go on at once, unedited;
//! - every byte of the upstream's answer reaches the client once nothing is pending
//!   (no callout out, the upstream done, no local reply): as the upstream sent it, or,
//!   after figures from the ledger, with exactly those figures written into the tools it
//!   lists, and with its `content-length` removed when its length changed. (Not judged
//!   after what Envoy never does, which the events still drive for robustness:
//!   `on_callout_failed` out of turn, a ledger answer while no callout is out.)
//! - `answer_release: at_once`: a `completed` or `accepted` report goes to the root's batch
//!   unwaited, in a step that lets the answer go on; an `input_required` answer is held for
//!   its report as under `after_receipt`, which holds every answer for its report;
//! - `approval_hold_ms`: an `approval_required` answer holds the call (no reply, no resume)
//!   only as the answer to its authorize, and the call asks again with that authorize's
//!   exact bytes, whose answer (the next ledger answer) it handles as the first;
//! - every local reply is JSON; a denial answers with the request's JSON-RPC id;
//! - at most one outcome report per dispatched attempt is handed to the root queue, and a
//!   receipt-bearing report (`completed`, …) is never followed by `released`.

use crate::plain;
use answer::Answer;
use arbitrary::{Arbitrary, Unstructured};
use atmost_config::{AnswerRelease, Config, RequestHold, UpstreamKey};
use atmost_filter::call::effects::{self, EditRefused};
use atmost_filter::call::resume::Ticket;
use atmost_filter::call::{
    BodyStep, Call, Effect, Flow, LogProps, PhaseName, RequestHead, ResponseHead, Step,
    IDEMPOTENCY_HEADER,
};
use atmost_filter::ledger_client::{Callout, Endpoint, LedgerReply};
use atmost_filter::parse::mcp::{self, Message, Mirrored};
use atmost_filter::stats::Stat;
use atmost_protocol::signature;
use atmost_protocol::token::permit_id_of;
use atmost_protocol::{
    AuthorizeRequest, LimitsRequest, LimitsResponse, Outcome, PermitLimits, MAX_LIMITS_TOOLS,
};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::rc::Rc;

mod answer;

const CONFIGS: [&str; 8] = [
    r#"{"ledger":{"cluster":"l","service_token":"svc-token-0123456789abcdef0123456789"},"upstream_key":{"secret":"0123456789abcdef0123"},"approval_hold_ms":60000}"#,
    r#"{"ledger":{"cluster":"l","service_token":"svc-token-0123456789abcdef0123456789"},"upstream_key":{"mode":"raw"},"denial_format":"error","max_body_bytes":64,"max_receipt_bytes":48,"governed_tools":["pay"]}"#,
    r#"{"ledger":{"cluster":"l","service_token":"svc-token-0123456789abcdef0123456789"},"upstream_key":{"mode":"off"},"key_required_tools":["*"],"permit_header":"x-permit","answer_release":"at_once"}"#,
    r#"{"ledger":{"cluster":"l","service_token":"svc-token-0123456789abcdef0123456789"},"upstream_key":{"secret":"0123456789abcdef0123"},"max_body_bytes":1,"max_receipt_bytes":1}"#,
    r#"{"ledger":{"cluster":"l","service_token":"svc-token-0123456789abcdef0123456789"},"upstream_key":{"secret":"0123456789abcdef0123"},"request_hold":"body","completion_reports":"per_call"}"#,
    r#"{"ledger":{"cluster":"l","service_token":"svc-token-0123456789abcdef0123456789"},"upstream_key":{"mode":"raw"},"request_hold":"body","tools_list_limits":true,"governed_tools":["pay","refund"],"denial_format":"error"}"#,
    r#"{"ledger":{"cluster":"l","service_token":"svc-token-0123456789abcdef0123456789"},"upstream_key":{"secret":"0123456789abcdef0123"},"tools_list_limits":true,"governed_tools":["pay","echo"],"completion_reports":"per_call"}"#,
    r#"{"ledger":{"cluster":"l","service_token":"svc-token-0123456789abcdef0123456789"},"upstream_key":{"mode":"off"},"request_hold":"body","tools_list_limits":true,"key_required_tools":["*"],"permit_header":"x-permit","max_receipt_bytes":96}"#,
];

/// A token of the ledger's shape, naming permit `pmt_0123456789abcdef01234567`.
const VALID_TOKEN: &str = "atmp_pmt_0123456789abcdef01234567_0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

const BODIES: [&str; 9] = [
    r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"pay","arguments":{"amount":1}}}"#,
    r#"{"jsonrpc":"2.0","id":"a","method":"tools/call","params":{"name":"pay","_meta":{"dev.atmost/idempotency-key":"k1"}}}"#,
    r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"echo","arguments":{"text":"x"}}}"#,
    r#"{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"pay","requestState":"s"}}"#,
    r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
    r#"[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"pay"}}]"#,
    r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
    "not json",
    r#"{"jsonrpc":"2.0","id":"l","method":"tools/list","params":{"_meta":{"dev.atmost/idempotency-key":"k2"}}}"#,
];

const RESPONSES: [&str; 10] = [
    r#"{"jsonrpc":"2.0","id":7,"result":{"content":[{"type":"text","text":"ok"}]}}"#,
    r#"{"jsonrpc":"2.0","id":"a","error":{"code":-1,"message":"m"}}"#,
    "data: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{\"content\":[]}}\n\n",
    "id: e1\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\"}\n\n",
    r#"{"jsonrpc":"2.0","id":4,"result":{"resultType":"input_required","requestState":"s"}}"#,
    r#"{"jsonrpc":"2.0","id":3,"result":{"task":{"taskId":"t1"}}}"#,
    r#"{"jsonrpc":"2.0","id":1,"result":{"tools":[{"name":"pay","inputSchema":{"type":"object"}},{"name":"search"},{"name":"echo","_meta":{"x":1}},{"name":"refund","_meta":7}]}}"#,
    "event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":\"l\",\"result\":{\"tools\":[{\"name\":\"pay\"},{\"name\":\"refund\",\"_meta\":{}}]}}\n\n",
    "id: 1\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/tools/list_changed\"}\n\ndata: {\"jsonrpc\":\"2.0\",\"id\":1,\ndata: \"result\":{\"tools\":[{\"name\":\"echo\"},{\"name\":\"pay\"}]}}\n\n: done\n",
    r#"[{"jsonrpc":"2.0","id":9,"result":{}},{"jsonrpc":"2.0","id":1,"result":{"tools":[{"name":"pay"},{"name":"pay"}]}}]"#,
];

const CONTENT_TYPES: [Option<&str>; 5] = [
    None,
    Some("application/json"),
    Some("text/event-stream; charset=utf-8"),
    Some("text/html"),
    Some("APPLICATION/JSON;x=1"),
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
    /// The figures of each tool the limits callout asked about.
    Limits(u8),
    /// `{"error":"permit_invalid"}` with HTTP 403 (unless the status says the callout
    /// failed): the ledger's answer to a limits callout whose token does not authenticate.
    PermitInvalid,
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
    /// `on_callout_failed` out of turn: the adapter calls it only in the callback whose
    /// callout could not be dispatched (host `% 8 == 2` does that), so this only checks
    /// that the machine survives it; the answer's delivery is not judged after it.
    CalloutFailed,
    LedgerReply {
        status: Status,
        body: LedgerBody,
    },
    /// The upstream's answer begins: its headers, and the whole body it will send (empty
    /// without trailers: the headers end the stream).
    ResponseHeaders {
        content_type: u8,
        body: Bytes,
        trailers: bool,
    },
    /// The next chunk of the answer's body arrives: `take` more bytes.
    ResponseBody {
        take: u16,
    },
    ResponseTrailers,
    /// `completion_reports: batched`: the root's batch carrying this call's report is done
    /// and the root resumed the response.
    BatchDone,
    Log {
        attempts: Option<u8>,
        flags: Option<u64>,
    },
}

/// One callback, and how the host treats what the machine asks in it: `host % 8 == 1`
/// refuses the first request edit (header or body write), `host % 8 == 2` fails to
/// dispatch the callout, `host % 8 == 3` refuses the first response edit; anything else
/// does what is asked.
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
    /// Callouts the host would not dispatch.
    not_dispatched: Vec<Endpoint>,
    /// A request edit was refused.
    refused: bool,
    /// A response edit was refused.
    response_refused: bool,
    /// A `ResumeResponse` came while nothing of the answer was held.
    resumed_unheld: bool,
}

impl Done {
    fn has(&self, f: impl Fn(&Effect) -> bool) -> bool {
        self.effects.iter().any(f)
    }

    fn count(&self, f: impl Fn(&Effect) -> bool) -> usize {
        self.effects.iter().filter(|e| f(e)).count()
    }
}

struct FuzzHost<'a> {
    refuse_request_edit: bool,
    refuse_response_edit: bool,
    fail_dispatch: bool,
    answer: &'a mut Answer,
    done: Done,
}

impl effects::Host for FuzzHost<'_> {
    fn effect(&mut self, effect: Effect) -> Result<(), EditRefused> {
        let request_edit = matches!(
            effect,
            Effect::RemoveRequestHeader(_)
                | Effect::SetRequestHeader(..)
                | Effect::SetRequestSecret(..)
                | Effect::ReplaceRequestBody { .. }
        );
        if request_edit && self.refuse_request_edit && !self.done.refused {
            self.done.refused = true;
            return Err(EditRefused);
        }
        if effect.edits_response() && self.refuse_response_edit && !self.done.response_refused {
            self.done.response_refused = true;
            self.answer.edit_refused = true;
            return Err(EditRefused);
        }
        match &effect {
            Effect::ReplaceResponseBody { original_len, body } => {
                self.answer.replace(*original_len, body);
            }
            Effect::RemoveResponseHeader(name) if name == "content-length" => {
                self.answer.length_removed = true;
            }
            Effect::ResumeResponse => {
                self.done.resumed_unheld |= !self.answer.held;
                self.answer.pass_on();
            }
            _ => {}
        }
        self.done.effects.push(effect);
        Ok(())
    }

    fn dispatch(&mut self, callout: &Callout) -> bool {
        if self.fail_dispatch {
            self.done.not_dispatched.push(callout.endpoint);
            return false;
        }
        self.done.callouts.push(callout.clone());
        true
    }
}

/// Carries out `step` as the adapter does.
fn carry_out(call: &mut Call, step: Step, host: u8, answer: &mut Answer) -> Done {
    let mut h = FuzzHost {
        refuse_request_edit: host % 8 == 1,
        fail_dispatch: host % 8 == 2,
        refuse_response_edit: host % 8 == 3,
        answer,
        done: Done {
            flow: Flow::Pause,
            effects: Vec::new(),
            callouts: Vec::new(),
            not_dispatched: Vec::new(),
            refused: false,
            response_refused: false,
            resumed_unheld: false,
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
    /// The headers went upstream: the headers callback returned `Continue`, or a later
    /// request callback did, or the request was resumed.
    headers_forwarded: bool,
    /// Some of the body went upstream: a body or trailers callback returned `Continue`, or
    /// the request was resumed (or it has no body and its headers went).
    body_forwarded: bool,
    /// The permit token the request carries: its one permit header value, trimmed, if it is
    /// visible ASCII.
    permit: Option<String>,
    /// `request_hold: body`, a POST with a body, a permit header, and headers that do not
    /// rule out a governed call: no `Idempotency-Key` header may go upstream.
    key_withheld: bool,
    /// A plain reading sees a `tools/list` request with this id.
    list_id: Option<Value>,
}

/// What a run reached, for the tests that keep the committed seeds meaningful (and for
/// picking new seeds out of a grown corpus: `cargo run --example pick_seeds`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Reached {
    /// The request was resumed after a `dispatch` answer.
    pub dispatched: bool,
    /// Outcome reports made (queued, batched or sent).
    pub reports: usize,
    /// `request_hold: body`: the body of a governed call was sent after its dispatch.
    pub body_mode_dispatched: bool,
    /// `request_hold: body`: the upstream answered before the decision.
    pub answered_early: bool,
    /// … and the ledger's `dispatch` answer to the authorize already out was released,
    /// the call never sent.
    pub released_after_early_answer: bool,
    /// A limits callout was dispatched for a `tools/list` answer.
    pub limits_asked: bool,
    /// The ledger answered it with figures, and they were written into the answer.
    pub limits_edited: bool,
    /// The ledger answered it with a status other than 200 (`403 permit_invalid`, …).
    pub limits_refused: bool,
    /// Its answer had no headers: the callout failed or timed out.
    pub limits_timed_out: bool,
    /// The host would not dispatch it.
    pub limits_not_dispatched: bool,
    /// `answer_release: at_once`: an answer went on before its report was acknowledged.
    pub released_unwaited: bool,
    /// `approval_hold_ms`: a governed call the ledger answered `approval_required` was held
    /// open, the ledger to be asked again.
    pub held_for_approval: bool,
}

#[derive(Default)]
struct Watch {
    body_mode: bool,
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
    /// Its bytes, which a held call sends again unchanged.
    asked_body: Option<Vec<u8>>,
    /// Outcome reports handed to the queue or sent, in order (kind names).
    reports: Vec<&'static str>,
    /// A report is out on an outcomes callout.
    outcomes_pending: bool,
    /// `completion_reports: batched`: a report is in the root's batch.
    batch_pending: bool,
    /// `request_hold: body`: the upstream answered before the decision.
    answered_early: bool,
    /// The limits callout made, and whether its answer is still to come.
    asked_limits: Option<LimitsRequest>,
    limits_pending: bool,
    /// The figures the ledger gave for the tools/list answer (a `200` `LimitsResponse` to
    /// the limits callout).
    figures: Option<BTreeMap<String, PermitLimits>>,
    /// Something Envoy never does happened: `on_callout_failed` out of turn, or a ledger
    /// answer while no callout was out.
    off_script: bool,
    request: Request,
    /// `on_log` ran: the stream is over.
    logged: bool,
    reached: Reached,
}

fn kind(o: &Outcome) -> &'static str {
    match o {
        Outcome::Completed { .. } => "completed",
        Outcome::InputRequired { .. } => "input_required",
        Outcome::Accepted { .. } => "accepted",
        Outcome::Released { .. } => "released",
        Outcome::Uncertain { .. } => "uncertain",
        Outcome::RefusedAtTool { .. } => "refused_at_tool",
    }
}

fn released(e: &Effect, why: &str) -> bool {
    matches!(e, Effect::Enqueue(r) if matches!(&r.outcome, Outcome::Released { reason } if reason.contains(why)))
}

fn edits_request_header(e: &Effect) -> bool {
    matches!(
        e,
        Effect::SetRequestHeader(..)
            | Effect::SetRequestSecret(..)
            | Effect::RemoveRequestHeader(_)
    )
}

/// What a ledger signs for `asked`: the `Signature-Input` and `Signature` of a dispatch of
/// attempt `att_1`, round 1, under `permit_id` (the signature's bytes stand in: the filter
/// holds no key to check them).
fn ledger_signature(asked: &AuthorizeRequest, permit_id: &str) -> Option<(String, String)> {
    let target = asked.dispatch.as_ref()?;
    let nonce = signature::DispatchNonce {
        attempt_id: "att_1".into(),
        round: 1,
        permit_id: permit_id.into(),
        tool: asked.tool.clone(),
    };
    let (input, _) = target.to_sign(1_764_680_000, "kid", &nonce)?;
    Some((input.header_value(), signature::signature_header(&[7; 64])))
}

/// The figures a ledger gives for each tool a limits callout asks about (`n` varies them:
/// no cap, none left, some left; a budget or none).
fn limits_answer(asked: Option<&LimitsRequest>, n: u8) -> LimitsResponse {
    let tools = asked.map(|a| a.tools.as_slice()).unwrap_or_default();
    LimitsResponse {
        tools: tools
            .iter()
            .enumerate()
            .map(|(i, tool)| {
                let limits = PermitLimits::until("2030-01-01T00:00:00.000Z")
                    .with_calls_left(match (usize::from(n) + i) % 3 {
                        0 => None,
                        1 => Some(0),
                        _ => Some(u64::from(n)),
                    })
                    .with_budget_left(n.is_multiple_of(2).then_some(97));
                (tool.clone(), limits)
            })
            .collect(),
    }
}

/// The ledger's answer as the filter gets it.
struct LedgerAnswer {
    reply: LedgerReply,
    /// A `dispatch` with HTTP 200.
    dispatch_ok: bool,
    /// The signature a `dispatch` carries.
    signature: Option<(String, String)>,
}

fn ledger_reply(
    status: &Status,
    body: &LedgerBody,
    asked: Option<&AuthorizeRequest>,
    asked_limits: Option<&LimitsRequest>,
) -> LedgerAnswer {
    let mut status = match status {
        Status::Ok => Some(200),
        Status::Failed => None,
        Status::Other(n) => Some(u32::from(*n)),
    };
    let mut signature = None;
    let (bytes, dispatch) = match body {
        LedgerBody::Dispatch => {
            // The ledger answers for the permit the token names, signing what was asked.
            let permit_id = asked
                .and_then(|a| permit_id_of(&a.permit_token))
                .unwrap_or("pmt_none");
            let mut answer = json!({"decision":"dispatch","attempt_id":"att_1","permit_id":permit_id,
                                    "lease_ms":1000,"round":1,"capability":"cap-1"});
            signature = asked.and_then(|a| ledger_signature(a, permit_id));
            if let Some((input, sig)) = &signature {
                answer["signature"] = json!({"signature_input": input, "signature": sig});
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
        // The top of the range is `approval_required`, which a configuration with
        // `approval_hold_ms` holds open (the harness's clock stands still: only the
        // ledger's next answer ends the hold).
        LedgerBody::Deny(c) if *c >= 240 => (
            json!({"decision":"deny","code":"approval_required","message":"a person decides","data":{"approval_id":"att-0","retry_after":c % 7,"approval_expires_at":"2030-01-01T00:00:00Z"}}).to_string().into_bytes(),
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
        LedgerBody::Limits(n) => (
            serde_json::to_vec(&limits_answer(asked_limits, *n)).unwrap_or_default(),
            false,
        ),
        LedgerBody::PermitInvalid => {
            status = status.map(|_| 403);
            (br#"{"error":"permit_invalid"}"#.to_vec(), false)
        }
        LedgerBody::Raw(b) => (b.clone(), false),
    };
    LedgerAnswer {
        dispatch_ok: dispatch && status == Some(200),
        signature: signature.filter(|_| dispatch && status == Some(200)),
        reply: LedgerReply {
            status,
            body: bytes,
        },
    }
}

fn observe(w: &mut Watch, cfg: &Config, a: &Answer, done: &Done, from_ledger: bool) {
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
    assert!(
        !done.resumed_unheld || w.off_script,
        "ResumeResponse while nothing of the answer was held: {done:?}"
    );
    for e in &done.effects {
        if edits_request_header(e) {
            assert!(
                !w.request.headers_forwarded,
                "{e:?}: a request header edited after the headers went upstream"
            );
        }
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
                assert!(
                    !w.request.key_withheld,
                    "request_hold: body: an Idempotency-Key header went upstream with the headers of a POST that may be a governed call: {value}"
                );
                if let UpstreamKey::Hmac { .. } = cfg.upstream_key {
                    assert_eq!(value.len(), 64);
                    assert!(value.bytes().all(|b| b.is_ascii_hexdigit()));
                    assert_ne!(Some(value), w.raw_key.as_ref(), "raw key sent upstream");
                }
            }
            Effect::Enqueue(r) => w.reports.push(kind(&r.outcome)),
            Effect::Complete(r) => {
                w.reports.push(kind(&r.outcome));
                w.batch_pending = true;
                assert!(
                    cfg.answer_release == AnswerRelease::AfterReceipt
                        || matches!(r.outcome, Outcome::InputRequired { .. }),
                    "answer_release: at_once held the answer for a {} report",
                    kind(&r.outcome)
                );
            }
            Effect::CompleteUnwaited(r) => {
                w.reports.push(kind(&r.outcome));
                assert_eq!(
                    cfg.answer_release,
                    AnswerRelease::AtOnce,
                    "an answer released before its report without answer_release: at_once"
                );
                assert!(
                    matches!(
                        r.outcome,
                        Outcome::Completed { .. } | Outcome::Accepted { .. }
                    ),
                    "a {} answer released before its report",
                    kind(&r.outcome)
                );
                assert_eq!(
                    done.flow,
                    Flow::Continue,
                    "answer_release: at_once held the answer it reported unwaited"
                );
                w.reached.released_unwaited = true;
            }
            _ => {}
        }
    }
    if done.not_dispatched.contains(&Endpoint::Limits) {
        w.reached.limits_not_dispatched = true;
    }
    for c in &done.callouts {
        match c.endpoint {
            // The harness's calls take no part in session credentials: none is ever asked.
            Endpoint::Credential => {
                panic!("a credential callout from a call without session credentials")
            }
            Endpoint::Authorize => {
                w.authorize_callouts += 1;
                w.authorize_pending = true;
                assert_eq!(w.authorize_callouts, 1, "a second authorize callout");
                assert!(
                    !w.answered_early,
                    "request_hold: body: the ledger was asked after the upstream had answered"
                );
                match serde_json::from_slice::<AuthorizeRequest>(&c.body) {
                    Ok(req) => {
                        assert!(!req.permit_token.is_empty());
                        assert_eq!(req.fingerprint.len(), 64);
                        let names_permit = permit_id_of(&req.permit_token).is_some();
                        assert_eq!(
                            req.dispatch.is_some(),
                            !w.body_mode && names_permit,
                            "the authorize asks for a signature exactly under request_hold: headers (and a token naming a permit): {req:?}"
                        );
                        w.raw_key = req.idempotency_key.clone();
                        w.asked = Some(req);
                        w.asked_body = Some(c.body.clone());
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
                assert!(
                    w.asked_limits.is_none(),
                    "a second limits callout for one answer"
                );
                assert!(
                    cfg.tools_list_limits,
                    "a limits callout without tools_list_limits"
                );
                let Some(id) = &w.request.list_id else {
                    panic!("a limits callout for a request that is not a tools/list");
                };
                assert!(a.started, "a limits callout before the answer began");
                match serde_json::from_slice::<LimitsRequest>(&c.body) {
                    Ok(req) => {
                        assert_eq!(
                            Some(&req.permit_token),
                            w.request.permit.as_ref(),
                            "the limits callout names another permit than the request's"
                        );
                        assert!(!req.tools.is_empty() && req.tools.len() <= MAX_LIMITS_TOOLS);
                        let listed = answer::listed_names(&a.body, a.sse, id);
                        for (i, t) in req.tools.iter().enumerate() {
                            assert!(
                                cfg.governed_tools.contains(t),
                                "asked about `{t}`, not governed"
                            );
                            assert!(
                                listed.contains(t),
                                "asked about `{t}`, which the answer does not list"
                            );
                            assert!(!req.tools[..i].contains(t), "asked about `{t}` twice");
                        }
                        w.asked_limits = Some(req);
                        w.limits_pending = true;
                        w.reached.limits_asked = true;
                    }
                    Err(e) => panic!("limits callout body is not a LimitsRequest: {e}"),
                }
            }
        }
    }
}

/// The end of the request headers callback: `Continue` sends the headers upstream (and the
/// whole request when it has no body). Under `request_hold: headers` a request that must be
/// held may never do that.
fn request_headers_callback(w: &mut Watch, done: &Done) {
    if done.flow == Flow::Continue && !w.answered {
        assert!(
            w.body_mode || !w.request.must_hold,
            "a governed POST's headers went upstream through Continue before a dispatch: {done:?}"
        );
        w.request.headers_forwarded = true;
        if w.request.finished {
            w.request.body_forwarded = true;
        }
    }
}

/// The end of a request body or trailers callback: `Continue` lets the request (or the rest
/// of it) go upstream, which a request that must be held may never do before its dispatch.
fn request_body_callback(w: &mut Watch, done: &Done) {
    if done.flow == Flow::Continue && !w.answered {
        assert!(
            !w.request.must_hold || w.resumed_request,
            "a governed POST went upstream through Continue from a request callback, not through a dispatch: {done:?}"
        );
        w.request.headers_forwarded = true;
        w.request.body_forwarded = true;
    }
}

/// The end of a response callback: while the limits callout is out the answer stays held; a
/// limits callout the host would not dispatch lets it go on at once.
fn response_callback(w: &mut Watch, a: &mut Answer, done: &Done) {
    if !w.answered {
        if w.limits_pending {
            assert_eq!(
                done.flow,
                Flow::Pause,
                "the tools/list answer went on while the ledger was asked for its figures"
            );
        }
        if done.not_dispatched.contains(&Endpoint::Limits) {
            assert_eq!(
                done.flow,
                Flow::Continue,
                "a limits callout that could not leave still holds the answer"
            );
        }
    }
    a.after_callback(done.flow);
}

/// Whether a POST may be a governed `tools/call` judged from its headers alone, as
/// `request_hold: body` must before the body arrives: unless `Mcp-Method` names another
/// method or `Mcp-Name` a tool that is not governed (and neither is repeated).
fn may_be_governed(cfg: &Config, mirrored: &Mirrored) -> bool {
    if mirrored.duplicated {
        return true;
    }
    match (mirrored.method.as_deref(), mirrored.name.as_deref()) {
        (Some(m), _) if m != "tools/call" => false,
        (_, Some(name)) => cfg.governed_tools.contains(name),
        _ => true,
    }
}

/// The token of the one permit header value, as a ledger would be sent it.
fn permit_token(values: &[Vec<u8>]) -> Option<String> {
    let [one] = values else { return None };
    let t = std::str::from_utf8(one).ok()?.trim();
    (!t.is_empty() && t.bytes().all(|b| (0x21..=0x7e).contains(&b))).then(|| t.to_string())
}

/// The id of a `tools/list` request, as a plain reading sees one.
fn list_id(method: &str, body: &[u8]) -> Option<Value> {
    if !method.eq_ignore_ascii_case("POST") {
        return None;
    }
    let v = plain::read(body)?;
    if v.get("method")?.as_str()? != "tools/list" {
        return None;
    }
    v.get("id")
        .filter(|id| id.is_string() || id.is_number())
        .cloned()
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

/// The answer's delivery, once nothing can change it any more: every byte the upstream sent
/// reached the client, as sent or with the ledger's figures in.
fn check_delivery(w: &Watch, a: &Answer) {
    let pending = w.authorize_pending || w.outcomes_pending || w.limits_pending || w.batch_pending;
    if !a.started || !a.finished || w.answered || w.off_script || pending {
        return;
    }
    assert!(
        !a.replaced_past_end || a.edit_refused,
        "a body edit replaced more bytes than Envoy held"
    );
    assert!(
        !a.held && a.buffer.is_empty(),
        "the upstream's answer is held with nothing left to wait for: {} bytes never reached the client",
        a.buffer.len()
    );
    if a.client.len() != a.body.len() {
        assert!(
            a.length_removed,
            "the answer's length changed but its content-length stayed"
        );
    }
    let edited = match (&w.figures, &w.request.list_id) {
        (Some(figures), Some(id)) => {
            answer::edited_as_expected(&a.body, &a.client, a.sse, id, figures)
        }
        _ => false,
    };
    if w.figures.is_some() && !a.edit_refused {
        assert!(
            edited,
            "the tools/list answer did not reach the client with the ledger's figures:\nsent:     {}\nreceived: {}",
            String::from_utf8_lossy(&a.body),
            String::from_utf8_lossy(&a.client)
        );
    } else {
        assert!(
            a.client == a.body || edited,
            "the upstream's answer did not reach the client as sent:\nsent:     {}\nreceived: {}",
            String::from_utf8_lossy(&a.body),
            String::from_utf8_lossy(&a.client)
        );
    }
}

pub fn check(data: &[u8]) {
    run(data);
}

/// What a run reached: (the request was dispatched, outcome reports made). Tests use it to
/// show the committed corpus drives the machine past the ledger.
pub fn reach(data: &[u8]) -> (bool, usize) {
    let r = run(data);
    (r.dispatched, r.reports)
}

/// Everything a run reached (see [`Reached`]).
pub fn reached(data: &[u8]) -> Reached {
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
        "config: {}\n{events:#?}\nreached: {:?}",
        CONFIGS[usize::from(ci) % CONFIGS.len()],
        std::panic::catch_unwind(|| run(data)).ok()
    )
}

fn run(data: &[u8]) -> Reached {
    let mut u = Unstructured::new(data);
    let Ok(ci) = u8::arbitrary(&mut u) else {
        return Reached::default();
    };
    let cfg = match Config::parse(CONFIGS[usize::from(ci) % CONFIGS.len()].as_bytes()) {
        Ok(c) => Rc::new(c),
        Err(e) => panic!("fuzz config refused: {e}"),
    };
    let Ok(events) = Vec::<Event>::arbitrary_take_rest(u) else {
        return Reached::default();
    };
    let mut call = Call::new(Rc::clone(&cfg));
    let mut w = Watch {
        body_mode: cfg.request_hold == RequestHold::Body,
        ..Watch::default()
    };
    let mut a = Answer::default();
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
                let permit = match permits {
                    Permit::Valid => vec![VALID_TOKEN.as_bytes().to_vec()],
                    Permit::Raw(p) => p.clone(),
                };
                let is_post = method.eq_ignore_ascii_case("POST");
                w.request = Request {
                    started: true,
                    must_hold: must_hold(&cfg, method, &body),
                    list_id: list_id(method, &body),
                    permit: permit_token(&permit),
                    key_withheld: w.body_mode
                        && is_post
                        && !end_of_stream
                        && !permit.is_empty()
                        && may_be_governed(&cfg, &mirrored),
                    body,
                    trailers: *trailers,
                    finished: end_of_stream,
                    ..Request::default()
                };
                let head = RequestHead {
                    method: method.to_string(),
                    permit,
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
                    // No upgrade, so the committed seeds keep their meaning: a request that
                    // asks to upgrade ends at its headers (src/call/tests/upgrades.rs).
                    upgrade: None,
                    route: None,
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
                let done = carry_out(&mut call, s, host, &mut a);
                observe(&mut w, &cfg, &a, &done, false);
                if w.body_mode && is_post && !end_of_stream && !w.answered {
                    assert_eq!(
                        done.flow,
                        Flow::Continue,
                        "request_hold: body: the headers of a POST were held"
                    );
                }
                request_headers_callback(&mut w, &done);
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
                    BodyStep::Done(s) => carry_out(&mut call, s, host, &mut a),
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
                        carry_out(&mut call, s, host, &mut a)
                    }
                };
                observe(&mut w, &cfg, &a, &done, false);
                request_body_callback(&mut w, &done);
            }
            Ev::RequestTrailers => {
                let r = &mut w.request;
                if !r.started || r.finished || !r.trailers || r.arrived < r.body.len() {
                    continue;
                }
                r.finished = true;
                let s = call.on_request_trailers();
                let done = carry_out(&mut call, s, host, &mut a);
                observe(&mut w, &cfg, &a, &done, false);
                request_body_callback(&mut w, &done);
            }
            Ev::CalloutFailed => {
                w.off_script = true;
                let s = call.on_callout_failed();
                w.authorize_pending = false;
                w.outcomes_pending = false;
                w.limits_pending = false;
                let done = carry_out(&mut call, s, host, &mut a);
                observe(&mut w, &cfg, &a, &done, false);
            }
            Ev::LedgerReply { status, body } => {
                // Envoy hands a callout's answer only to the callout's own stream: an answer
                // while none is out still must not break the machine, but what it does to the
                // answer's delivery is not judged.
                w.off_script |= !(w.authorize_pending || w.outcomes_pending || w.limits_pending);
                let phase = call.phase_name();
                let authorizing = w.authorize_pending
                    && matches!(phase, PhaseName::Authorizing | PhaseName::HeldForApproval);
                let listing = w.limits_pending && phase == PhaseName::ListingAsking;
                let LedgerAnswer {
                    reply,
                    dispatch_ok,
                    signature,
                } = ledger_reply(status, body, w.asked.as_ref(), w.asked_limits.as_ref());
                let figures = (reply.status == Some(200))
                    .then(|| serde_json::from_slice::<LimitsResponse>(&reply.body).ok())
                    .flatten()
                    .map(|l| l.tools);
                let s = call.on_ledger_reply(&reply);
                let done = carry_out(&mut call, s, host, &mut a);
                // The answer settles the callout it is for; the step may make another.
                if authorizing {
                    w.authorize_pending = false;
                }
                w.outcomes_pending = false;
                if listing {
                    w.limits_pending = false;
                }
                observe(&mut w, &cfg, &a, &done, true);
                if done.has(|e| matches!(e, Effect::HoldForApproval { .. })) {
                    assert!(
                        authorizing && cfg.approval_hold_ms > 0,
                        "held for approval outside an authorize answer, or without approval_hold_ms: {done:?}"
                    );
                    assert_eq!(call.phase_name(), PhaseName::HeldForApproval);
                    assert!(
                        !done.has(|e| matches!(e, Effect::LocalReply(_) | Effect::ResumeRequest)),
                        "a held call was answered or let go: {done:?}"
                    );
                    // The root asks again with the same bytes; the next answer is to that.
                    assert_eq!(
                        call.reask().map(|c| c.body).as_ref(),
                        w.asked_body.as_ref(),
                        "a held call asks the ledger again with other bytes"
                    );
                    w.authorize_pending = true;
                    w.reached.held_for_approval = true;
                }
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
                        !w.answered_early,
                        "request_hold: body: the body went upstream after the upstream had answered"
                    );
                    assert!(
                        !w.request.body_forwarded,
                        "resumed a request whose body had already gone upstream"
                    );
                    let before = &done.effects[..at];
                    if w.body_mode {
                        assert!(
                            w.request.headers_forwarded,
                            "request_hold: body: resumed a request whose headers were held"
                        );
                        w.reached.body_mode_dispatched = true;
                    } else {
                        assert!(
                            !w.request.headers_forwarded,
                            "resumed a request that had already gone upstream"
                        );
                        assert!(
                            before.iter().any(|e| matches!(e,
                                Effect::SetRequestHeader(n, _) | Effect::RemoveRequestHeader(n)
                                    if n == IDEMPOTENCY_HEADER)),
                            "resumed before the upstream key was set: {done:?}"
                        );
                        let Some((input, sig)) = &signature else {
                            panic!("request_hold: headers: resumed on a dispatch the ledger did not sign");
                        };
                        for (name, value) in [("signature-input", input), ("signature", sig)] {
                            assert!(
                                before.iter().any(|e| matches!(e,
                                    Effect::SetRequestHeader(n, v) if n == name && v == value)),
                                "request_hold: headers: resumed without the ledger's `{name}`: {done:?}"
                            );
                        }
                    }
                    w.resumed_request = true;
                    w.request.headers_forwarded = true;
                    w.request.body_forwarded = true;
                    dispatched_reports_start = Some(w.reports.len());
                } else if authorizing && dispatch_ok && w.answered_early {
                    // The body never left: the attempt is given back, the held answer goes on.
                    assert!(
                        done.has(|e| released(e, "upstream_answered_first")),
                        "request_hold: body: a dispatch after the upstream answered was not released: {done:?}"
                    );
                    w.reached.released_after_early_answer = true;
                } else if authorizing && dispatch_ok {
                    // A dispatch answer resumes the request, or answers it and reports the
                    // round never sent: a refused edit, or a dispatch the filter cannot send
                    // (a token naming no permit, so nothing was asked to be signed).
                    assert!(
                        done.has(|e| matches!(e, Effect::LocalReply(_)))
                            && done.has(|e| released(e, "never_sent")),
                        "a dispatch answer neither resumed the request nor answered it: {done:?}"
                    );
                }
                if authorizing && w.answered_early {
                    assert!(
                        !done.has(|e| matches!(e, Effect::LocalReply(_)))
                            && done.count(|e| *e == Effect::ResumeResponse) == 1,
                        "request_hold: body: the ledger's answer after the upstream's did not let the held answer go on: {done:?}"
                    );
                }
                if listing {
                    check_limits_answer(&mut w, &reply, figures, &done);
                }
            }
            Ev::ResponseHeaders {
                content_type,
                body,
                trailers,
            } => {
                if a.started {
                    continue;
                }
                let content_type = CONTENT_TYPES[usize::from(*content_type) % CONTENT_TYPES.len()];
                let body = body.get(&RESPONSES).to_vec();
                let end_of_stream = body.is_empty() && !*trailers;
                a = Answer {
                    started: true,
                    sse: content_type.is_some_and(|c| c.starts_with("text/event-stream")),
                    body,
                    trailers: *trailers,
                    finished: end_of_stream,
                    ..Answer::default()
                };
                let phase = call.phase_name();
                let before_decision = w.body_mode
                    && w.request.headers_forwarded
                    && !w.answered
                    && matches!(phase, PhaseName::ReadingBody | PhaseName::Authorizing);
                // No verifier's refusal: the upstream here is the tool itself (its refusals
                // have unit tests of their own, src/call/tests/tool_refusal.rs).
                let s = call.on_response_headers(ResponseHead {
                    content_type: content_type.map(str::to_string),
                    end_of_stream,
                    tool_refusal: None,
                });
                let done = carry_out(&mut call, s, host, &mut a);
                if before_decision {
                    assert!(
                        done.has(|e| *e == Effect::Count(Stat::UpstreamAnsweredEarly)),
                        "request_hold: body: an answer before the decision went unnoticed: {done:?}"
                    );
                    let expected = if phase == PhaseName::Authorizing {
                        Flow::Pause
                    } else {
                        Flow::Continue
                    };
                    assert_eq!(
                        done.flow, expected,
                        "request_hold: body: an answer before the decision (in {phase:?})"
                    );
                    w.answered_early = true;
                    w.reached.answered_early = true;
                }
                observe(&mut w, &cfg, &a, &done, false);
                response_callback(&mut w, &mut a, &done);
            }
            Ev::ResponseBody { take } => {
                let Some(end_of_stream) = a.deliver(*take) else {
                    continue;
                };
                let done = match call.on_response_body(a.buffer.len(), end_of_stream) {
                    BodyStep::Done(s) => carry_out(&mut call, s, host, &mut a),
                    BodyStep::Read { len } => {
                        let bytes = a.buffer[..len.min(a.buffer.len())].to_vec();
                        let s = call.on_response_body_data(&bytes, end_of_stream);
                        carry_out(&mut call, s, host, &mut a)
                    }
                };
                observe(&mut w, &cfg, &a, &done, false);
                response_callback(&mut w, &mut a, &done);
            }
            Ev::ResponseTrailers => {
                if !a.deliver_trailers() {
                    continue;
                }
                let done = match call.on_response_trailers() {
                    BodyStep::Done(s) => carry_out(&mut call, s, host, &mut a),
                    BodyStep::Read { len } => {
                        let bytes = a.buffer[..len.min(a.buffer.len())].to_vec();
                        let s = call.on_response_body_data(&bytes, true);
                        carry_out(&mut call, s, host, &mut a)
                    }
                };
                observe(&mut w, &cfg, &a, &done, false);
                response_callback(&mut w, &mut a, &done);
            }
            Ev::BatchDone => {
                if !w.batch_pending {
                    continue;
                }
                w.batch_pending = false;
                call.on_completion_settled();
                a.pass_on();
            }
            Ev::Log { attempts, flags } => {
                w.logged = true;
                let s = call.on_log(LogProps {
                    attempts: attempts.map(u64::from),
                    flags: *flags,
                });
                let done = carry_out(&mut call, s, host, &mut a);
                observe(&mut w, &cfg, &a, &done, false);
            }
        }
    }

    check_delivery(&w, &a);
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
    w.reached.dispatched = w.resumed_request;
    w.reached.reports = w.reports.len();
    w.reached
}

/// The ledger's reply to the limits callout: it lets the held answer go on once, and edits
/// it only with figures the ledger gave.
fn check_limits_answer(
    w: &mut Watch,
    reply: &LedgerReply,
    figures: Option<BTreeMap<String, PermitLimits>>,
    done: &Done,
) {
    assert_eq!(
        done.count(|e| *e == Effect::ResumeResponse),
        1,
        "the reply to a limits callout must let the held answer go on once: {done:?}"
    );
    let edits = done.count(|e| matches!(e, Effect::ReplaceResponseBody { .. }));
    assert!(edits <= 1, "the answer was edited twice: {done:?}");
    assert!(
        done.callouts.is_empty()
            && !done.has(|e| matches!(
                e,
                Effect::LocalReply(_)
                    | Effect::ResumeRequest
                    | Effect::SetRequestHeader(..)
                    | Effect::RemoveRequestHeader(_)
                    | Effect::ReplaceRequestBody { .. }
            )),
        "the reply to a limits callout did more than release the answer: {done:?}"
    );
    if figures.is_none() {
        assert_eq!(
            edits, 0,
            "the tools/list answer was edited though the ledger gave no figures: {done:?}"
        );
    }
    match reply.status {
        None => w.reached.limits_timed_out = true,
        Some(200) => w.reached.limits_edited |= figures.is_some() && edits == 1,
        Some(_) => w.reached.limits_refused = true,
    }
    w.figures = figures;
}
