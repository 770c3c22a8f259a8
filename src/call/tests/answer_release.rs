//! `answer_release`: with `after_receipt` (the default) the answer of a dispatched call
//! waits for the ledger's acknowledgement of its report; with `at_once` a `completed` or
//! `accepted` answer goes on in the step that found it, its report handed to the root's
//! batch, and an `input_required` answer still waits
//! (docs/design.md#releasing-the-answer-before-its-report).

use super::*;

fn at_once() -> Rc<Config> {
    cfg_with(json!({"answer_release": "at_once"}))
}

/// The reports a step hands to the root without holding anything for them.
fn unwaited(step: &Step) -> Vec<OutcomeReport> {
    picked(step, |e| match e {
        Effect::CompleteUnwaited(r) => Some(r.clone()),
        _ => None,
    })
}

/// Every report a step makes, whichever way it goes (root batch, queue, own callout).
fn all_reports(step: &Step) -> usize {
    let own = step
        .callout
        .as_ref()
        .filter(|c| c.endpoint == Endpoint::Outcomes)
        .map_or(0, |_| 1);
    let handed = picked(step, |e| match e {
        Effect::Complete(r) | Effect::CompleteUnwaited(r) | Effect::Enqueue(r) => {
            Some(r.attempt_id.clone())
        }
        _ => None,
    });
    own + handed.len()
}

fn completed() -> OutcomeReport {
    grant().report(Outcome::Completed {
        receipt: RECEIPT.into(),
    })
}

#[test]
fn at_once_releases_the_json_answer_before_the_ledger_acknowledges() {
    let mut call = dispatched(at_once());
    let s = json_answer(&mut call, RECEIPT);
    assert_eq!(s.flow, Flow::Continue, "the answer goes on in this step");
    assert!(s.callout.is_none(), "no callout of the request's own");
    assert_eq!(
        s.effects,
        vec![
            Effect::Count(Stat::Completed),
            Effect::CompleteUnwaited(completed())
        ]
    );
    // Nothing is held, nothing waits on the root: later callbacks pass, and the root is
    // never asked about a batch.
    assert_eq!(call.state_name(), "settled");
    assert!(!call.is_reporting() && !call.needs_log_props());
    call.check_completion_batch(|| panic!("the root was asked about a report nothing waits on"));
    assert_eq!(done(call.on_response_trailers()), Step::cont());
    // The client hangs up afterwards: the report is the root's, and is not made twice.
    let s = call.on_log(LogProps {
        attempts: Some(1),
        flags: Some(outcome::DC),
    });
    assert_eq!(s, Step::cont());
}

#[test]
fn after_receipt_holds_the_answer_until_the_batch_is_done() {
    for c in [cfg(), cfg_with(json!({"answer_release": "after_receipt"}))] {
        let mut call = dispatched(c);
        let s = json_answer(&mut call, RECEIPT);
        assert_eq!(s.flow, Flow::Pause, "held for the ledger");
        assert!(unwaited(&s).is_empty());
        assert_eq!(
            s.effects.last(),
            Some(&Effect::Complete(completed())),
            "{s:?}"
        );
        assert!(call.is_reporting());
        assert_eq!(done(call.on_response_trailers()).flow, Flow::Pause);
        call.on_completion_settled();
        assert_eq!(done(call.on_response_trailers()), Step::cont());
    }
}

#[test]
fn at_once_lets_the_sse_chunk_with_the_answer_and_the_rest_of_the_stream_go_on() {
    let mut call = dispatched(at_once());
    call.on_response_headers(sse_head());
    let progress =
        b"data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{}}\n\n";
    let len = read(call.on_response_body(progress.len(), false));
    assert_eq!(
        call.on_response_body_data(&progress[..len], false),
        Step::cont()
    );
    let answer = b"data: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{\"content\":[]}}\n\n";
    let len = read(call.on_response_body(answer.len(), false));
    let s = call.on_response_body_data(&answer[..len], false);
    assert_eq!(s.flow, Flow::Continue);
    assert_eq!(
        unwaited(&s),
        vec![grant().report(Outcome::Completed {
            receipt: r#"{"jsonrpc":"2.0","id":7,"result":{"content":[]}}"#.into()
        })]
    );
    assert_eq!(all_reports(&s), 1);
    assert_eq!(done(call.on_response_body(5, false)), Step::cont());
    assert_eq!(done(call.on_response_body(5, true)), Step::cont());
    assert_eq!(call.on_log(LogProps::default()), Step::cont());
}

#[test]
fn at_once_writes_the_figures_into_the_answer_it_releases_and_reports_the_upstreams_text() {
    let mut call = dispatched_with_figures(at_once());
    call.on_response_headers(json_head());
    let s = json_answer_body(&mut call, RECEIPT);
    assert_eq!(s.flow, Flow::Continue);
    // The figures are the Dispatch answer's, written before the answer goes on.
    assert!(matches!(
        s.effects.first(),
        Some(Effect::ReplaceResponseBody { .. })
    ));
    let bodies = replaced_bodies(&s);
    let v: Value = serde_json::from_slice(&bodies[0]).unwrap_or(Value::Null);
    assert_eq!(v["result"]["_meta"]["dev.atmost/permit"], figures_json());
    assert_eq!(
        unwaited(&s),
        vec![completed()],
        "the receipt is the upstream's"
    );
}

#[test]
fn at_once_releases_a_task_handle_but_holds_an_input_required_answer() {
    let task = r#"{"jsonrpc":"2.0","id":7,"result":{"task":{"taskId":"t-1","status":"working","createdAt":"2025-11-25T00:00:00Z","lastUpdatedAt":"2025-11-25T00:00:00Z","ttl":60000}}}"#;
    let mut call = dispatched(at_once());
    let s = json_answer(&mut call, task);
    assert_eq!(s.flow, Flow::Continue);
    assert_eq!(
        unwaited(&s),
        vec![grant().report(Outcome::Accepted {
            receipt: task.into()
        })]
    );

    // The continuation is the client's very next request, and the ledger dispatches it only
    // once the attempt is `awaiting_input`: this answer waits for its report.
    let ask = r#"{"jsonrpc":"2.0","id":7,"result":{"resultType":"input_required","inputRequests":{"q":{"method":"elicitation/create","params":{}}},"requestState":"s1"}}"#;
    let mut call = dispatched(at_once());
    let s = json_answer(&mut call, ask);
    assert_eq!(s.flow, Flow::Pause);
    assert!(unwaited(&s).is_empty());
    assert_eq!(
        reported(&s),
        Outcome::InputRequired {
            receipt: ask.into()
        }
    );
    assert!(call.is_reporting());
}

/// Across a whole call in each mode (dispatch, answer, more body, trailers, the end), the
/// request is resumed once and one report is made.
#[test]
fn each_mode_sends_the_call_once_and_reports_it_once() {
    for (c, held) in [(cfg(), true), (at_once(), false)] {
        let mut call = Call::new(c);
        let mut steps = vec![send(&mut call, post(&[TOKEN], &["\"k1\""]), PAY)];
        steps.push(call.on_ledger_reply(&ledger(&signed(&call, dispatch()))));
        steps.push(call.on_response_headers(json_head()));
        steps.push(done(call.on_response_body(10, false)));
        let len = read(call.on_response_body(RECEIPT.len(), true));
        steps.push(call.on_response_body_data(&RECEIPT.as_bytes()[..len], true));
        if held {
            call.on_completion_settled();
        }
        steps.push(done(call.on_response_trailers()));
        steps.push(call.on_log(LogProps {
            attempts: Some(1),
            flags: Some(0),
        }));
        let resumes = steps
            .iter()
            .flat_map(|s| &s.effects)
            .filter(|e| **e == Effect::ResumeRequest)
            .count();
        assert_eq!(resumes, 1, "held={held}");
        let authorize = steps
            .iter()
            .filter(|s| matches!(&s.callout, Some(c) if c.endpoint == Endpoint::Authorize))
            .count();
        assert_eq!(authorize, 1, "held={held}");
        assert_eq!(
            steps.iter().map(all_reports).sum::<usize>(),
            1,
            "held={held}"
        );
    }
}
