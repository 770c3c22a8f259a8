//! Carrying out a [`Step`] in order, the part of the adapter's work that decides anything:
//! a request edit the host refuses stops the step there. Nothing after it runs (above all
//! no `ResumeRequest`, nor the step's `Continue`, nor its callout); the machine answers
//! [`Call::on_rewrite_failed`] and that step is carried out instead. A refused response
//! edit does not stop the step: the machine hears it ([`Call::on_response_edit_refused`])
//! and the answer goes on as the upstream sent it. The adapter implements [`Host`] with
//! proxy-wasm hostcalls; tests implement it with a recorder.

use crate::call::{Call, Effect, Flow, Step};
use crate::ledger_client::Callout;

/// The host refused a request or response edit (header or body write).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EditRefused;

pub trait Host {
    /// Carries out one effect. Only the request edits (`RemoveRequestHeader`,
    /// `SetRequestHeader`, `SetRequestSecret`, `ReplaceRequestBody`) and the response edits
    /// ([`Effect::edits_response`]) may answer [`EditRefused`]; any other failure is the host's
    /// to log.
    fn effect(&mut self, effect: Effect) -> Result<(), EditRefused>;
    /// Dispatches a ledger callout; `false` when the host would not.
    fn dispatch(&mut self, callout: &Callout) -> bool;
}

/// Carries out `step` and whatever the machine answers to a refused edit or a callout
/// that could not be dispatched; returns what to give back to Envoy.
pub fn apply(call: &mut Call, step: Step, host: &mut impl Host) -> Flow {
    for effect in step.effects {
        let response_edit = effect.edits_response();
        if host.effect(effect).is_err() {
            if response_edit {
                for note in call.on_response_edit_refused().effects {
                    let _ = host.effect(note);
                }
                continue;
            }
            // The machine is `Answered` after this: its step holds no edit, so this ends.
            let next = call.on_rewrite_failed();
            return apply(call, next, host);
        }
    }
    if let Some(callout) = step.callout {
        if !host.dispatch(&callout) {
            let next = call.on_callout_failed();
            return apply(call, next, host);
        }
    }
    step.flow
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::call::tests::{signed, TOKEN};
    use crate::call::RequestHead;
    use crate::ledger_client::LedgerReply;
    use crate::test_config::{config_from, minimal};
    use atmost_protocol::{AuthorizeResponse, Outcome};
    use std::rc::Rc;

    /// Records what it was asked to do; refuses the first effect `refuse` matches.
    struct Recorder {
        done: Vec<Effect>,
        refuse: fn(&Effect) -> bool,
        refused: bool,
    }

    impl Host for Recorder {
        fn effect(&mut self, effect: Effect) -> Result<(), EditRefused> {
            if !self.refused && (self.refuse)(&effect) {
                self.refused = true;
                return Err(EditRefused);
            }
            self.done.push(effect);
            Ok(())
        }
        fn dispatch(&mut self, _callout: &Callout) -> bool {
            true
        }
    }

    const BODY: &str = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"pay","idempotencyKey":"raw-k"}}"#;

    /// A governed call up to the ledger's `dispatch` answer; returns the call and that step.
    fn dispatching() -> (Call, Step) {
        dispatching_with(None)
    }

    fn dispatching_with(limits: Option<atmost_protocol::PermitLimits>) -> (Call, Step) {
        let mut call = Call::new(Rc::new(config_from(&minimal())));
        call.on_request_headers(RequestHead {
            method: "POST".into(),
            permit: vec![TOKEN.as_bytes().to_vec()],
            idempotency_key: vec![b"raw-k".to_vec()],
            content_length: Some(BODY.len() as u64),
            ..RequestHead::default()
        });
        call.on_request_body(BODY.len(), true);
        let s = call.on_request_body_data(BODY.as_bytes());
        assert!(s.callout.is_some());
        let answer = AuthorizeResponse::Dispatch {
            attempt_id: "att_1".into(),
            permit_id: "pmt_1".into(),
            lease_ms: 1000,
            round: 1,
            capability: "cap-1".into(),
            limits,
            signature: None,
            credential: None,
        };
        let answer = signed(&call, answer);
        let step = call.on_ledger_reply(&LedgerReply {
            status: Some(200),
            body: serde_json::to_vec(&answer).unwrap_or_default(),
        });
        (call, step)
    }

    fn run(refuse: fn(&Effect) -> bool) -> (Flow, Vec<Effect>) {
        let (mut call, step) = dispatching();
        let mut host = Recorder {
            done: Vec::new(),
            refuse,
            refused: false,
        };
        let flow = apply(&mut call, step, &mut host);
        (flow, host.done)
    }

    fn released(done: &[Effect]) -> bool {
        done.iter().any(|e| {
            matches!(e, Effect::Enqueue(r) if r.attempt_id == "att_1"
                && matches!(&r.outcome, Outcome::Released { reason } if reason == "never_sent: request_rewrite_failed"))
        })
    }

    #[test]
    fn all_edits_done_then_resume() {
        let (flow, done) = run(|_| false);
        assert_eq!(flow, Flow::Continue);
        let resume = done.iter().position(|e| *e == Effect::ResumeRequest);
        let last_edit = done.iter().rposition(|e| {
            matches!(
                e,
                Effect::ReplaceRequestBody { .. }
                    | Effect::SetRequestHeader(..)
                    | Effect::RemoveRequestHeader(_)
            )
        });
        assert!(
            matches!((last_edit, resume), (Some(e), Some(r)) if e < r),
            "{done:?}"
        );
        assert!(!released(&done));
    }

    #[test]
    fn a_refused_edit_never_resumes_and_releases_the_attempt() {
        let refusals: [fn(&Effect) -> bool; 3] = [
            |e| matches!(e, Effect::ReplaceRequestBody { .. }),
            |e| matches!(e, Effect::SetRequestHeader(n, _) if n == "content-length"),
            |e| matches!(e, Effect::SetRequestHeader(n, _) if n == "idempotency-key"),
        ];
        for refuse in refusals {
            let (flow, done) = run(refuse);
            assert_eq!(flow, Flow::Pause);
            assert!(!done.contains(&Effect::ResumeRequest), "{done:?}");
            assert!(!done.contains(&Effect::Count(crate::stats::Stat::Dispatched)));
            assert!(
                done.iter().any(|e| matches!(e, Effect::LocalReply(r)
                    if String::from_utf8_lossy(&r.body).contains("gateway_unavailable"))),
                "{done:?}"
            );
            assert!(released(&done), "{done:?}");
        }
    }

    #[test]
    fn a_refused_edit_of_passing_traffic_stops_it() {
        let mut call = Call::new(Rc::new(config_from(&minimal())));
        let step = call.on_request_headers(RequestHead {
            method: "DELETE".into(),
            idempotency_key: vec![b"raw-k".to_vec()],
            ..RequestHead::default()
        });
        let mut host = Recorder {
            done: Vec::new(),
            refuse: |e| matches!(e, Effect::SetRequestHeader(..)),
            refused: false,
        };
        assert_eq!(apply(&mut call, step, &mut host), Flow::Pause);
        assert!(matches!(host.done.as_slice(), [Effect::LocalReply(r), ..] if r.status == 503));
    }

    #[test]
    fn a_refused_response_edit_lets_the_answer_go_on_unedited() {
        let limits = atmost_protocol::PermitLimits::until("2030-01-01T00:00:00.000Z")
            .with_calls_left(Some(1));
        let (mut call, step) = dispatching_with(Some(limits));
        let mut host = Recorder {
            done: Vec::new(),
            refuse: |e| matches!(e, Effect::RemoveResponseHeader(_)),
            refused: false,
        };
        assert_eq!(apply(&mut call, step, &mut host), Flow::Continue);
        let step = call.on_response_headers(crate::call::ResponseHead {
            content_type: Some("application/json".into()),
            end_of_stream: false,
            tool_refusal: None,
        });
        // The figure headers are set; the length could not be removed.
        assert_eq!(apply(&mut call, step, &mut host), Flow::Continue);
        assert!(host
            .done
            .iter()
            .any(|e| matches!(e, Effect::SetResponseHeader(n, _) if n == "atmost-calls-left")));
        assert!(host.done.iter().any(
            |e| matches!(e, Effect::Log(_, m) if m.contains("refused an edit of the response"))
        ));
        // So the body is not edited: it keeps the length the client was told.
        let answer = br#"{"jsonrpc":"2.0","id":7,"result":{}}"#;
        let step = call.on_response_body_data(answer, true);
        assert!(!step
            .effects
            .iter()
            .any(|e| matches!(e, Effect::ReplaceResponseBody { .. })));
        assert_eq!(step.flow, Flow::Pause, "still reported before release");
    }
}
