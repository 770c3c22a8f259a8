//! SSE answers whose stream ends with HTTP trailers (an HTTP/2 upstream: its last DATA frame
//! does not end the stream, a HEADERS frame does), driven through a model of what Envoy does
//! with the filter's answers. The filter holds back an event it has not seen whole when it
//! edits the answer; whatever it holds must reach the client before the trailers.

use super::*;
use crate::call::effects::{self, EditRefused};
use crate::ledger_client::Callout;

/// Envoy's side of one response as the filter meets it through proxy-wasm in Envoy 1.40
/// (`source/extensions/common/wasm/context.cc` over the HTTP filter manager):
/// - a body callback answered `Pause` (`StopIterationAndBuffer`) leaves its bytes with Envoy;
///   the next body callback appends its chunk to them and offers the filter the whole
///   buffer, and the trailers callback offers that buffer too;
/// - a body edit (`set_buffer(0, n, bytes)`) drains the first `n` bytes and puts `bytes` in
///   front of the rest;
/// - `Continue`, or a resume, sends what Envoy holds, then the trailers if they came;
/// - a body callback answered `Continue` sends its chunk; the next callback has only its own
///   chunk (the trailers callback: no body at all).
#[derive(Default)]
struct Envoy {
    /// The bytes the filter sees: the chunk of the callback under way, after what Envoy
    /// holds for the filter.
    body: Vec<u8>,
    /// Trailers came and the filter paused them.
    trailers_held: bool,
    /// Envoy refuses every body edit.
    refuse_body_edits: bool,
    /// What reached the client, and whether the trailers followed it.
    client: Vec<u8>,
    client_trailers: bool,
    callouts: Vec<Callout>,
    /// Reports handed to the root with nothing held for them (`answer_release: at_once`).
    unwaited: Vec<Outcome>,
}

impl effects::Host for Envoy {
    fn effect(&mut self, effect: Effect) -> Result<(), EditRefused> {
        match effect {
            Effect::ReplaceResponseBody { original_len, body } => {
                if self.refuse_body_edits {
                    return Err(EditRefused);
                }
                let rest = self.body.get(original_len..).unwrap_or_default().to_vec();
                self.body = body;
                self.body.extend(rest);
            }
            Effect::ResumeResponse => self.send(),
            Effect::CompleteUnwaited(report) => self.unwaited.push(report.outcome),
            _ => {}
        }
        Ok(())
    }

    fn dispatch(&mut self, callout: &Callout) -> bool {
        self.callouts.push(callout.clone());
        true
    }
}

impl Envoy {
    /// Iteration goes on: the body Envoy holds goes out, then the trailers that waited.
    fn send(&mut self) {
        self.client.append(&mut self.body);
        if std::mem::take(&mut self.trailers_held) {
            self.client_trailers = true;
        }
    }

    fn data(&mut self, call: &mut Call, chunk: &[u8], end_of_stream: bool) {
        self.body.extend_from_slice(chunk);
        let step = match call.on_response_body(self.body.len(), end_of_stream) {
            BodyStep::Done(step) => step,
            BodyStep::Read { len } => {
                let bytes = self.body.get(..len).unwrap_or(&self.body).to_vec();
                call.on_response_body_data(&bytes, end_of_stream)
            }
        };
        if effects::apply(call, step, self) == Flow::Continue {
            self.send();
        }
    }

    fn trailers(&mut self, call: &mut Call) {
        let step = match call.on_response_trailers() {
            BodyStep::Done(step) => step,
            BodyStep::Read { len } => {
                let bytes = self.body.get(..len).unwrap_or(&self.body).to_vec();
                call.on_response_body_data(&bytes, true)
            }
        };
        self.trailers_held = true;
        if effects::apply(call, step, self) == Flow::Continue {
            self.send();
        }
    }

    /// The ledger answers the callout the filter made last.
    fn ledger_answers(&mut self, call: &mut Call, reply: &LedgerReply) {
        let step = call.on_ledger_reply(reply);
        let _ = effects::apply(call, step, self);
    }

    /// The outcomes the filter reported in its callouts.
    fn reported(&self) -> Vec<Outcome> {
        self.callouts
            .iter()
            .filter(|c| c.endpoint == Endpoint::Outcomes)
            .flat_map(|c| {
                serde_json::from_slice::<OutcomesRequest>(&c.body)
                    .map(|r| r.reports)
                    .unwrap_or_default()
            })
            .map(|r| r.outcome)
            .collect()
    }
}

fn acked() -> LedgerReply {
    LedgerReply {
        status: Some(200),
        body: br#"{"acks":["applied"]}"#.to_vec(),
    }
}

const PROGRESS: &str = "event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{\"progressToken\":1,\"progress\":1}}\n\n";
const ANSWER: &str =
    r#"{"jsonrpc":"2.0","id":7,"result":{"content":[{"type":"text","text":"paid"}]}}"#;

/// [`ANSWER`] as the client gets it: with the permit's figures.
fn answer_with_figures() -> String {
    format!(
        r#"{{"jsonrpc":"2.0","id":7,"result":{{"_meta":{{"dev.atmost/permit":{}}},"content":[{{"type":"text","text":"paid"}}]}}}}"#,
        figures_json()
    )
}

/// Every way to cut `stream` in two chunks, and in three.
fn cuts(stream: &[u8]) -> Vec<Vec<&[u8]>> {
    let n = stream.len();
    let mut out: Vec<Vec<&[u8]>> = (1..n).map(|c| vec![&stream[..c], &stream[c..]]).collect();
    for a in (1..n).step_by(7) {
        for b in (a + 1..n).step_by(5) {
            out.push(vec![&stream[..a], &stream[a..b], &stream[b..]]);
        }
    }
    out
}

/// The chunks, for a failure's message.
fn shown(chunks: &[&[u8]]) -> Vec<String> {
    chunks
        .iter()
        .map(|c| String::from_utf8_lossy(c).into_owned())
        .collect()
}

/// A governed call whose answer the filter edits, its response headers passed.
fn editing_call() -> Call {
    let mut call = dispatched_with_figures(per_call());
    call.on_response_headers(sse_head());
    call
}

/// A progress event then the answer's: as the upstream sends it, and as the client gets it.
fn progress_then_answer() -> (String, String) {
    let sent = format!("{PROGRESS}event: message\ndata: {ANSWER}\n\n");
    let got = format!(
        "{PROGRESS}event: message\ndata: {}\n\n",
        answer_with_figures()
    );
    (sent, got)
}

#[test]
fn an_answer_split_over_chunks_before_the_trailers_is_edited_and_nothing_is_lost() {
    let (stream, want) = progress_then_answer();
    for chunks in cuts(stream.as_bytes()) {
        let mut call = editing_call();
        let mut envoy = Envoy::default();
        for chunk in &chunks {
            envoy.data(&mut call, chunk, false);
        }
        envoy.trailers(&mut call);
        assert!(!envoy.client_trailers, "held while the report is out");
        assert_eq!(
            envoy.reported(),
            vec![Outcome::Completed {
                receipt: ANSWER.into()
            }],
            "{:?}",
            shown(&chunks)
        );
        envoy.ledger_answers(&mut call, &acked());
        assert_eq!(
            String::from_utf8_lossy(&envoy.client),
            want,
            "{:?}",
            shown(&chunks)
        );
        assert!(envoy.client_trailers, "{:?}", shown(&chunks));
        assert_eq!(call.on_log(LogProps::default()), Step::cont());
    }
}

/// `answer_release: at_once`: the answer's event, the figures written in, reaches the client
/// with the chunk that completes it, before the ledger has heard anything; the trailers
/// follow at once, and the report goes to the root's batch once.
#[test]
fn released_at_once_the_edited_answer_and_the_trailers_reach_the_client_before_any_report() {
    let (stream, want) = progress_then_answer();
    for chunks in cuts(stream.as_bytes()) {
        let mut call = dispatched_with_figures(cfg_with(json!({"answer_release": "at_once"})));
        call.on_response_headers(sse_head());
        let mut envoy = Envoy::default();
        for chunk in &chunks {
            envoy.data(&mut call, chunk, false);
        }
        assert_eq!(
            String::from_utf8_lossy(&envoy.client),
            want,
            "{:?}",
            shown(&chunks)
        );
        envoy.trailers(&mut call);
        assert!(envoy.client_trailers, "{:?}", shown(&chunks));
        assert!(envoy.callouts.is_empty(), "no callout of the request's own");
        assert_eq!(
            envoy.unwaited,
            vec![Outcome::Completed {
                receipt: ANSWER.into()
            }],
            "{:?}",
            shown(&chunks)
        );
        assert_eq!(call.on_log(LogProps::default()), Step::cont());
    }
}

#[test]
fn a_stream_whose_last_event_is_unfinished_at_the_trailers_reaches_the_client_whole() {
    // The answer's event lacks its closing blank line when the trailers end the stream: it
    // is no event (no client dispatches it), yet its bytes are the client's.
    let stream = format!("{PROGRESS}event: message\ndata: {ANSWER}\n");
    for chunks in cuts(stream.as_bytes()) {
        let mut call = editing_call();
        let mut envoy = Envoy::default();
        for chunk in &chunks {
            envoy.data(&mut call, chunk, false);
        }
        envoy.trailers(&mut call);
        assert_eq!(
            String::from_utf8_lossy(&envoy.client),
            stream,
            "{:?}",
            shown(&chunks)
        );
        assert!(envoy.client_trailers, "{:?}", shown(&chunks));
        assert!(envoy.reported().is_empty());
        // The trailers ended the stream without the answer.
        let s = call.on_log(LogProps {
            attempts: Some(1),
            flags: Some(0),
        });
        assert!(
            matches!(&enqueued(&s)[..], [r] if matches!(&r.outcome, Outcome::Uncertain { reason } if reason.starts_with("no_receipt"))),
            "{:?}: {s:?}",
            shown(&chunks)
        );
    }
}

#[test]
fn a_resumable_stream_closed_by_its_trailers_waits_for_the_resumed_get() {
    let stream = "id: ev-1\ndata: \n\nid: ev-2\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{}}\n\nid: ev-3\ndata: {\"jsonrpc\"";
    for chunks in cuts(stream.as_bytes()) {
        let mut call = editing_call();
        let mut envoy = Envoy::default();
        for chunk in &chunks {
            envoy.data(&mut call, chunk, false);
        }
        let step = match call.on_response_trailers() {
            BodyStep::Done(step) => step,
            BodyStep::Read { len } => {
                let bytes = envoy.body.get(..len).unwrap_or(&envoy.body).to_vec();
                call.on_response_body_data(&bytes, true)
            }
        };
        assert_eq!(step.flow, Flow::Continue);
        assert!(
            step.effects
                .iter()
                .any(|e| matches!(e, Effect::SaveResume(key, t)
                if *key == resume::key(None, "ev-2") && t.limits == Some(figures()))),
            "{:?}: {step:?}",
            shown(&chunks)
        );
        let s = call.on_log(LogProps {
            attempts: Some(1),
            flags: Some(0),
        });
        assert_eq!(
            counts(&s),
            vec![Stat::StreamAwaitingResume],
            "{:?}",
            shown(&chunks)
        );
    }
}

#[test]
fn an_edit_envoy_refuses_loses_nothing_it_held() {
    let stream = format!("{PROGRESS}event: message\ndata: {ANSWER}\n\n: done\n");
    for chunks in cuts(stream.as_bytes()) {
        let mut call = editing_call();
        let mut envoy = Envoy {
            refuse_body_edits: true,
            ..Envoy::default()
        };
        for chunk in &chunks {
            envoy.data(&mut call, chunk, false);
        }
        envoy.trailers(&mut call);
        envoy.ledger_answers(&mut call, &acked());
        assert_eq!(
            String::from_utf8_lossy(&envoy.client),
            stream,
            "{:?}",
            shown(&chunks)
        );
        assert!(envoy.client_trailers, "{:?}", shown(&chunks));
        assert_eq!(
            envoy.reported(),
            vec![Outcome::Completed {
                receipt: ANSWER.into()
            }]
        );
    }
}

#[test]
fn past_the_event_limit_the_stream_goes_on_as_it_comes() {
    let mut call = dispatched_with_figures(cfg_with(
        json!({"completion_reports": "per_call", "max_receipt_bytes": 64}),
    ));
    call.on_response_headers(sse_head());
    let mut envoy = Envoy::default();
    let stream = format!("{PROGRESS}event: message\ndata: {ANSWER}\n");
    let (a, b) = stream.as_bytes().split_at(PROGRESS.len() + 20);
    envoy.data(&mut call, a, false);
    envoy.data(&mut call, b, false);
    envoy.trailers(&mut call);
    assert_eq!(String::from_utf8_lossy(&envoy.client), stream);
    assert!(envoy.client_trailers);
}

#[test]
fn a_tools_list_answer_split_before_the_trailers_gains_the_figures_and_nothing_is_lost() {
    let stream = format!("{PROGRESS}event: message\ndata: {LISTED}\n\n");
    for chunks in cuts(stream.as_bytes()) {
        let (mut call, _) = list(listing_cfg(), &["tok"]);
        call.on_response_headers(sse_head());
        let mut envoy = Envoy::default();
        for chunk in &chunks {
            envoy.data(&mut call, chunk, false);
        }
        envoy.trailers(&mut call);
        assert!(!envoy.client_trailers, "held while the ledger is asked");
        assert_eq!(
            envoy
                .callouts
                .iter()
                .map(|c| c.endpoint)
                .collect::<Vec<_>>(),
            vec![Endpoint::Limits]
        );
        envoy.ledger_answers(&mut call, &limits_reply(&[("pay_invoice", figures())]));
        let text = String::from_utf8_lossy(&envoy.client).into_owned();
        let data = text
            .strip_prefix(&format!("{PROGRESS}event: message\ndata: "))
            .and_then(|t| t.strip_suffix("\n\n"))
            .unwrap_or_else(|| panic!("{:?}: not the stream: {text}", shown(&chunks)));
        let v: Value = serde_json::from_str(data).unwrap_or(Value::Null);
        assert_eq!(
            v["result"]["tools"][0]["_meta"]["dev.atmost/permit"],
            figures_json(),
            "{:?}",
            shown(&chunks)
        );
        assert!(envoy.client_trailers, "{:?}", shown(&chunks));
    }
}

#[test]
fn a_tools_list_stream_unfinished_at_the_trailers_reaches_the_client_whole() {
    let stream = format!("{PROGRESS}event: message\ndata: {LISTED}\n");
    for chunks in cuts(stream.as_bytes()) {
        let (mut call, _) = list(listing_cfg(), &["tok"]);
        call.on_response_headers(sse_head());
        let mut envoy = Envoy::default();
        for chunk in &chunks {
            envoy.data(&mut call, chunk, false);
        }
        envoy.trailers(&mut call);
        assert_eq!(
            String::from_utf8_lossy(&envoy.client),
            stream,
            "{:?}",
            shown(&chunks)
        );
        assert!(envoy.client_trailers, "{:?}", shown(&chunks));
        assert!(envoy.callouts.is_empty());
    }
}

#[test]
fn without_figures_the_stream_is_never_held_and_its_trailers_end_the_watch() {
    let stream = format!("{PROGRESS}event: message\ndata: {ANSWER}\n");
    let mut call = dispatched(per_call());
    call.on_response_headers(sse_head());
    let mut envoy = Envoy::default();
    let (a, b) = stream.split_at(PROGRESS.len() + 20);
    envoy.data(&mut call, a.as_bytes(), false);
    assert_eq!(envoy.client, a.as_bytes(), "nothing held");
    envoy.data(&mut call, b.as_bytes(), false);
    assert_eq!(read(call.on_response_trailers()), 0, "nothing to read");
    envoy.trailers(&mut call);
    assert_eq!(String::from_utf8_lossy(&envoy.client), stream);
    assert!(envoy.client_trailers);
    let s = call.on_log(LogProps {
        attempts: Some(1),
        flags: Some(0),
    });
    assert!(
        matches!(&enqueued(&s)[..], [r] if matches!(&r.outcome, Outcome::Uncertain { reason } if reason.starts_with("no_receipt"))),
        "{s:?}"
    );
}
