//! A dispatched call's response: the receipt found, reported and held, and what `on_log`
//! concludes without it.

use crate::call::tests::*;

#[test]
fn json_response_is_held_and_reported_before_release() {
    let mut call = dispatched(per_call());
    assert_eq!(call.on_response_headers(json_head()), Step::cont());
    assert_eq!(done(call.on_response_body(10, false)).flow, Flow::Pause);
    let len = read(call.on_response_body(RECEIPT.len(), true));
    let s = call.on_response_body_data(&RECEIPT.as_bytes()[..len], true);
    assert_eq!(s.flow, Flow::Pause);
    assert_eq!(counts(&s), vec![Stat::Completed]);
    let c = s.callout.unwrap_or_else(|| panic!("no report"));
    assert_eq!(c.endpoint, Endpoint::Outcomes);
    let req: OutcomesRequest =
        serde_json::from_slice(&c.body).unwrap_or(OutcomesRequest { reports: vec![] });
    assert_eq!(
        req.reports,
        vec![grant().report(Outcome::Completed {
            receipt: RECEIPT.into()
        })]
    );
    assert_eq!(call.state_name(), "reporting");
    // Acknowledged: resume, nothing left for on_log.
    let s = call.on_ledger_reply(&LedgerReply {
        status: Some(200),
        body: br#"{"acks":["applied"]}"#.to_vec(),
    });
    assert_eq!(s.effects, vec![Effect::ResumeResponse]);
    assert_eq!(call.state_name(), "settled");
    assert_eq!(
        call.on_log(LogProps {
            attempts: Some(1),
            flags: Some(0)
        }),
        Step::cont()
    );
}

#[test]
fn failed_completion_report_is_queued_and_response_resumed() {
    let mut call = dispatched(per_call());
    call.on_response_headers(json_head());
    read(call.on_response_body(RECEIPT.len(), true));
    call.on_response_body_data(RECEIPT.as_bytes(), true);
    let s = call.on_ledger_reply(&LedgerReply::failed());
    assert_eq!(s.effects.last(), Some(&Effect::ResumeResponse));
    assert_eq!(
        enqueued(&s),
        vec![grant().report(Outcome::Completed {
            receipt: RECEIPT.into()
        })]
    );
    assert_eq!(call.on_log(LogProps::default()), Step::cont());

    // Dispatch of the report itself failed: queue, let the chunk go.
    let mut call = dispatched(per_call());
    call.on_response_headers(json_head());
    read(call.on_response_body(RECEIPT.len(), true));
    call.on_response_body_data(RECEIPT.as_bytes(), true);
    let s = call.on_callout_failed();
    assert_eq!(s.flow, Flow::Continue);
    assert_eq!(enqueued(&s).len(), 1);
    assert!(!s.effects.contains(&Effect::ResumeResponse));
    assert_eq!(call.on_log(LogProps::default()), Step::cont());
}

#[test]
fn client_gone_while_reporting_queues_completed() {
    let mut call = dispatched(cfg());
    call.on_response_headers(json_head());
    read(call.on_response_body(RECEIPT.len(), true));
    call.on_response_body_data(RECEIPT.as_bytes(), true);
    let s = call.on_log(LogProps {
        attempts: Some(1),
        flags: Some(outcome::DC),
    });
    assert_eq!(
        enqueued(&s),
        vec![grant().report(Outcome::Completed {
            receipt: RECEIPT.into()
        })]
    );
}

#[test]
fn sse_streams_through_and_holds_the_chunk_with_the_response() {
    let mut call = dispatched(per_call());
    call.on_response_headers(sse_head());
    let chunks: [&[u8]; 3] = [
        b"event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{}}\n\ndata: {\"jsonrpc\":\"2.0\",",
        b"\"id\":7,\"result\":{\"content\":[]}}\n",
        b"\n",
    ];
    for (i, chunk) in chunks.iter().enumerate() {
        let len = read(call.on_response_body(chunk.len(), false));
        let s = call.on_response_body_data(&chunk[..len], false);
        if i < 2 {
            assert_eq!(s, Step::cont(), "chunk {i} passes");
        } else {
            assert_eq!(s.flow, Flow::Pause);
            let c = s.callout.unwrap_or_else(|| panic!("no report"));
            let req: OutcomesRequest =
                serde_json::from_slice(&c.body).unwrap_or(OutcomesRequest { reports: vec![] });
            assert_eq!(
                req.reports[0].outcome,
                Outcome::Completed {
                    receipt: r#"{"jsonrpc":"2.0","id":7,"result":{"content":[]}}"#.into()
                }
            );
        }
    }
    // More data while the report is out stays held; the end passes after the ack.
    assert_eq!(done(call.on_response_body(5, true)).flow, Flow::Pause);
    let s = call.on_ledger_reply(&LedgerReply {
        status: Some(200),
        body: br#"{"acks":["already_recorded"]}"#.to_vec(),
    });
    assert_eq!(s.effects, vec![Effect::ResumeResponse]);
    assert_eq!(done(call.on_response_body(5, true)).flow, Flow::Continue);
}

#[test]
fn batched_completion_is_handed_to_the_root_and_held() {
    let mut call = dispatched(cfg());
    assert!(call.watches_response_headers());
    assert!(call.needs_log_props());
    call.on_response_headers(json_head());
    assert!(!call.watches_response_headers());
    let len = read(call.on_response_body(RECEIPT.len(), true));
    let s = call.on_response_body_data(&RECEIPT.as_bytes()[..len], true);
    assert_eq!(s.flow, Flow::Pause);
    assert!(s.callout.is_none(), "no callout of its own");
    assert_eq!(
        s.effects,
        vec![
            Effect::Count(Stat::Completed),
            Effect::Complete(grant().report(Outcome::Completed {
                receipt: RECEIPT.into()
            }))
        ]
    );
    assert!(call.is_reporting());
    assert!(!call.needs_log_props());
    // Trailers or more data while the batch is out stay held.
    assert_eq!(done(call.on_response_trailers()).flow, Flow::Pause);
    // The root finished the batch (acked, or failed and queued by the root): nothing left.
    call.on_completion_settled();
    assert!(!call.is_reporting());
    assert_eq!(call.state_name(), "settled");
    assert_eq!(done(call.on_response_body(5, true)).flow, Flow::Continue);
    assert_eq!(call.on_log(LogProps::default()), Step::cont());
}

#[test]
fn the_root_is_asked_about_the_batch_only_while_the_report_is_in_it() {
    let asked = std::cell::Cell::new(0);
    let ask = |waiting: bool| {
        asked.set(asked.get() + 1);
        waiting
    };
    let mut call = dispatched(cfg());
    // Nothing handed to the root yet: nothing to ask.
    call.check_completion_batch(|| ask(false));
    assert_eq!((asked.get(), call.state_name()), (0, "dispatched"));
    json_answer(&mut call, RECEIPT);
    assert!(call.is_reporting());
    // Still waiting in the batch: the response stays held.
    call.check_completion_batch(|| ask(true));
    assert_eq!(asked.get(), 1);
    assert!(call.is_reporting());
    assert_eq!(done(call.on_response_body(5, true)).flow, Flow::Pause);
    // The batch is done: settled, and the root is not asked again.
    call.check_completion_batch(|| ask(false));
    assert_eq!((asked.get(), call.state_name()), (2, "settled"));
    call.check_completion_batch(|| ask(false));
    assert_eq!(asked.get(), 2);
    assert_eq!(done(call.on_response_body(5, true)).flow, Flow::Continue);
    // A call reporting per call is never in the root's batch.
    let mut per_call = dispatched(cfg_with(json!({"completion_reports": "per_call"})));
    json_answer(&mut per_call, RECEIPT);
    per_call.check_completion_batch(|| ask(false));
    assert_eq!(asked.get(), 2);
    assert!(per_call.is_reporting());
}

#[test]
fn batched_completion_client_gone_queues_from_on_log() {
    let mut call = dispatched(cfg());
    json_answer(&mut call, RECEIPT);
    assert!(call.is_reporting());
    // The client hung up before the batch was answered: on_log queues the report for the
    // after-the-fact queue (a repeat of the batch's report is acked `already_recorded`).
    let s = call.on_log(LogProps::default());
    assert_eq!(
        enqueued(&s),
        vec![grant().report(Outcome::Completed {
            receipt: RECEIPT.into()
        })]
    );
}

#[test]
fn batched_sse_answer_chunk_is_held_then_stream_passes() {
    let mut call = dispatched(cfg());
    call.on_response_headers(sse_head());
    let chunk = b"data: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{\"content\":[]}}\n\n";
    let len = read(call.on_response_body(chunk.len(), false));
    let s = call.on_response_body_data(&chunk[..len], false);
    assert_eq!(s.flow, Flow::Pause);
    assert!(matches!(reported(&s), Outcome::Completed { .. }));
    assert_eq!(done(call.on_response_body(5, false)).flow, Flow::Pause);
    call.on_completion_settled();
    assert_eq!(done(call.on_response_body(5, true)).flow, Flow::Continue);
}

#[test]
fn log_props_and_response_headers_only_matter_for_dispatched_calls() {
    let mut call = Call::new(cfg());
    assert!(!call.needs_log_props() && !call.watches_response_headers());
    call.on_request_headers(RequestHead {
        method: "GET".into(),
        ..RequestHead::default()
    });
    assert_eq!(call.state_name(), "passing");
    assert!(!call.needs_log_props() && !call.watches_response_headers());
}

#[test]
fn oversized_receipts_become_uncertain() {
    let c = cfg_with(json!({"max_receipt_bytes": 16}));
    let mut call = dispatched(Rc::clone(&c));
    call.on_response_headers(json_head());
    let s = done(call.on_response_body(17, false));
    assert_eq!(s.flow, Flow::Continue);
    assert_eq!(counts(&s), vec![Stat::ReceiptTooLarge]);
    assert_eq!(done(call.on_response_body(100, true)).flow, Flow::Continue);
    let s = call.on_log(LogProps {
        attempts: Some(1),
        flags: Some(0),
    });
    assert!(
        matches!(&enqueued(&s)[0].outcome, Outcome::Uncertain { reason } if reason.starts_with("receipt_too_large"))
    );

    let mut call = dispatched(c);
    call.on_response_headers(sse_head());
    let chunk = b"data: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{}}\n\n";
    let len = read(call.on_response_body(chunk.len(), false));
    let s = call.on_response_body_data(&chunk[..len], false);
    assert_eq!(s.flow, Flow::Continue);
    assert_eq!(counts(&s), vec![Stat::ReceiptTooLarge]);
}

#[test]
fn on_log_classifies_unreported_attempts() {
    let table: Vec<(Option<ResponseHead>, LogProps, &str)> = vec![
        // connection refused: Envoy's own 503 text/plain, UF
        (
            Some(ResponseHead {
                content_type: Some("text/plain".into()),
                end_of_stream: false,
                tool_refusal: None,
            }),
            LogProps {
                attempts: Some(1),
                flags: Some(outcome::UF),
            },
            "released",
        ),
        // never attempted
        (
            None,
            LogProps {
                attempts: Some(0),
                flags: Some(outcome::DC),
            },
            "released",
        ),
        // cut after the tool ran
        (
            Some(json_head()),
            LogProps {
                attempts: Some(1),
                flags: Some(outcome::UC),
            },
            "uncertain",
        ),
        // timeout
        (
            Some(ResponseHead {
                content_type: Some("text/plain".into()),
                end_of_stream: false,
                tool_refusal: None,
            }),
            LogProps {
                attempts: Some(1),
                flags: Some(outcome::UT),
            },
            "uncertain",
        ),
        // client hung up while upstream worked
        (
            None,
            LogProps {
                attempts: Some(1),
                flags: Some(outcome::DC),
            },
            "uncertain",
        ),
        // a 200 without a receipt
        (
            Some(ResponseHead {
                content_type: Some("text/html".into()),
                end_of_stream: false,
                tool_refusal: None,
            }),
            LogProps {
                attempts: Some(1),
                flags: Some(0),
            },
            "uncertain",
        ),
        // properties unavailable
        (None, LogProps::default(), "uncertain"),
    ];
    for (resp, props, want) in table {
        let mut call = dispatched(cfg());
        if let Some(h) = resp.clone() {
            call.on_response_headers(h);
        }
        let s = call.on_log(props);
        let q = enqueued(&s);
        assert_eq!(q.len(), 1);
        assert_eq!(q[0].attempt_id, "att_1");
        let got = match &q[0].outcome {
            Outcome::Completed { .. } => "completed",
            Outcome::Released { .. } => "released",
            Outcome::Uncertain { .. } => "uncertain",
            Outcome::InputRequired { .. } | Outcome::Accepted { .. } => "interim",
            Outcome::RefusedAtTool { .. } => "refused_at_tool",
        };
        assert_eq!(got, want, "{resp:?} {props:?}");
        let want_stat = if want == "released" {
            Stat::Released
        } else {
            Stat::Uncertain
        };
        assert_eq!(counts(&s), vec![want_stat]);
        // on_log happens once.
        assert_eq!(call.on_log(props), Step::cont());
    }
}

#[test]
fn json_without_matching_response_is_not_a_receipt() {
    let mut call = dispatched(cfg());
    call.on_response_headers(json_head());
    let body = br#"{"jsonrpc":"2.0","id":8,"result":{}}"#;
    read(call.on_response_body(body.len(), true));
    let s = call.on_response_body_data(body, true);
    assert_eq!(s, Step::cont());
    assert_eq!(call.state_name(), "no_receipt");
}

#[test]
fn input_required_and_task_handles_are_reported_as_such() {
    let ask = r#"{"jsonrpc":"2.0","id":7,"result":{"resultType":"input_required","inputRequests":{"q":{"method":"elicitation/create","params":{}}},"requestState":"s1"}}"#;
    let mut call = dispatched(cfg());
    let s = json_answer(&mut call, ask);
    assert_eq!(s.flow, Flow::Pause);
    assert_eq!(counts(&s), vec![Stat::InputRequired]);
    assert_eq!(
        reported(&s),
        Outcome::InputRequired {
            receipt: ask.into()
        }
    );
    // Unacknowledged: on_log queues the same outcome (never `completed`).
    let s = call.on_log(LogProps {
        attempts: Some(1),
        flags: Some(0x4000),
    });
    assert_eq!(
        enqueued(&s)[0].outcome,
        Outcome::InputRequired {
            receipt: ask.into()
        }
    );

    let task = r#"{"jsonrpc":"2.0","id":7,"result":{"task":{"taskId":"t-1","status":"working","createdAt":"2025-11-25T00:00:00Z","lastUpdatedAt":"2025-11-25T00:00:00Z","ttl":60000}}}"#;
    let mut call = dispatched(cfg());
    let s = json_answer(&mut call, task);
    assert_eq!(counts(&s), vec![Stat::Accepted]);
    assert_eq!(
        reported(&s),
        Outcome::Accepted {
            receipt: task.into()
        }
    );
}

const PRIMING: &[u8] = b"id: ev-1\nretry: 100\ndata: \n\n";

#[test]
fn resumable_stream_closed_early_stays_in_flight_and_the_resumed_get_brings_the_receipt() {
    let mut head = post(&[TOKEN], &["\"k1\""]);
    head.session_id = Some("sess-1".into());
    let mut call = Call::new(cfg());
    let s = send(&mut call, head, PAY);
    assert!(s.callout.is_some());
    call.on_ledger_reply(&ledger(&signed(&call, dispatch())));
    call.on_response_headers(sse_head());
    let progress = b"id: ev-2\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{}}\n\n";
    let mut chunk = PRIMING.to_vec();
    chunk.extend_from_slice(progress);
    let len = read(call.on_response_body(chunk.len(), false));
    assert_eq!(
        call.on_response_body_data(&chunk[..len], false),
        Step::cont()
    );
    // The server ends the stream cleanly: a ticket under the last event id, no report.
    read(call.on_response_body(0, true));
    let s = call.on_response_body_data(b"", true);
    let ticket = Ticket {
        grant: grant(),
        id: json!(7),
        tool: "pay_invoice".into(),
        permit_hash: resume::permit_hash(TOKEN.as_bytes()),
        path: "/mcp".into(),
        limits: None,
    };
    assert_eq!(s.flow, Flow::Continue);
    assert_eq!(
        s.effects,
        vec![Effect::SaveResume(
            resume::key(Some("sess-1"), "ev-2"),
            ticket.clone()
        )]
    );
    let s = call.on_log(LogProps {
        attempts: Some(1),
        flags: Some(0),
    });
    assert!(enqueued(&s).is_empty(), "{s:?}");
    assert_eq!(counts(&s), vec![Stat::StreamAwaitingResume]);

    // The same stream cut with a reset flag is uncertain as before.
    let mut cut = dispatched(cfg());
    cut.on_response_headers(sse_head());
    read(cut.on_response_body(PRIMING.len(), true));
    cut.on_response_body_data(PRIMING, true);
    let s = cut.on_log(LogProps {
        attempts: Some(1),
        flags: Some(0x40),
    });
    assert!(matches!(enqueued(&s)[0].outcome, Outcome::Uncertain { .. }));

    // The resumed GET: watched, and its answer is the receipt.
    let mut get = Call::new(cfg());
    let s = get.on_request_headers(RequestHead {
        method: "GET".into(),
        session_id: Some("sess-1".into()),
        resume: Some(ticket.clone()),
        end_of_stream: true,
        ..RequestHead::default()
    });
    assert_eq!(s.flow, Flow::Continue);
    assert_eq!(get.state_name(), "dispatched");
    get.on_response_headers(sse_head());
    let answer = b"id: ev-3\ndata: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{\"content\":[]}}\n\n";
    let len = read(get.on_response_body(answer.len(), false));
    let s = get.on_response_body_data(&answer[..len], false);
    assert_eq!(s.flow, Flow::Pause);
    assert_eq!(counts(&s), vec![Stat::Completed, Stat::ResumedReceipt]);
    assert!(matches!(reported(&s), Outcome::Completed { .. }));

    // A resumed GET that fails reports nothing: the call's fate is the lease's.
    let mut get = Call::new(cfg());
    get.on_request_headers(RequestHead {
        method: "GET".into(),
        resume: Some(ticket),
        end_of_stream: true,
        ..RequestHead::default()
    });
    let s = get.on_log(LogProps {
        attempts: Some(1),
        flags: Some(0x4000),
    });
    assert!(enqueued(&s).is_empty());
    // A GET without a ticket just passes.
    let mut plain = Call::new(cfg());
    plain.on_request_headers(RequestHead {
        method: "GET".into(),
        end_of_stream: true,
        ..RequestHead::default()
    });
    assert_eq!(plain.state_name(), "passing");
}

#[test]
fn sse_stream_without_event_ids_ending_early_is_uncertain() {
    let mut call = dispatched(cfg());
    call.on_response_headers(sse_head());
    let chunk =
        b"data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{}}\n\n";
    read(call.on_response_body(chunk.len(), true));
    let s = call.on_response_body_data(chunk, true);
    assert_eq!(s, Step::cont());
    let s = call.on_log(LogProps {
        attempts: Some(1),
        flags: Some(0),
    });
    assert!(matches!(enqueued(&s)[0].outcome, Outcome::Uncertain { .. }));
}

#[test]
fn a_refused_rewrite_of_a_dispatched_call_denies_it_and_releases_the_attempt() {
    let mut call = Call::new(cfg());
    send(&mut call, post(&[TOKEN], &["\"raw-p\""]), PARAMS_PAY);
    let s = call.on_ledger_reply(&ledger(&signed(&call, dispatch())));
    assert!(body_edit_of(&s).is_some());
    // The host refused the body (or a header) write: the adapter calls this instead of
    // carrying out the rest of the step.
    let s = call.on_rewrite_failed();
    assert_eq!(s.flow, Flow::Pause);
    assert!(!s.effects.contains(&Effect::ResumeRequest));
    assert!(s.callout.is_none());
    let reply = local_reply(&s).body_json().unwrap_or_default();
    assert_eq!(reply["id"], 7);
    assert_eq!(
        reply["result"]["structuredContent"]["error"]["code"],
        "gateway_unavailable"
    );
    assert!(!reply.to_string().contains("raw-p"));
    assert_eq!(
        enqueued(&s),
        vec![grant().report(Outcome::Released {
            reason: "never_sent: request_rewrite_failed".into()
        })]
    );
    assert!(counts(&s).contains(&Stat::Released));
    assert_eq!(call.state_name(), "answered");
    // Nothing more happens for this request: no second report, no resume.
    assert_eq!(call.on_rewrite_failed(), Step::pause());
    assert_eq!(
        call.on_log(LogProps {
            attempts: Some(0),
            flags: Some(0)
        }),
        Step::cont()
    );
}

fn figure_headers() -> Vec<Effect> {
    vec![
        Effect::SetResponseHeader("atmost-calls-left".into(), "0".into()),
        Effect::SetResponseHeader("atmost-budget-left".into(), "48750".into()),
        Effect::SetResponseHeader(
            "atmost-permit-expires".into(),
            "2030-01-01T00:00:00.000Z".into(),
        ),
    ]
}

#[test]
fn a_dispatched_json_answer_carries_the_figures_and_the_receipt_stays_the_upstreams() {
    let mut call = dispatched_with_figures(cfg());
    let s = call.on_response_headers(json_head());
    let mut want = figure_headers();
    want.push(Effect::RemoveResponseHeader("content-length".into()));
    assert_eq!(s.effects, want);
    let len = read(call.on_response_body(RECEIPT.len(), true));
    let s = call.on_response_body_data(&RECEIPT.as_bytes()[..len], true);
    assert_eq!(s.flow, Flow::Pause);
    // The edit comes before the answer is released (it is held until the report is done).
    assert!(matches!(
        s.effects.first(),
        Some(Effect::ReplaceResponseBody { original_len, .. }) if *original_len == RECEIPT.len()
    ));
    let bodies = replaced_bodies(&s);
    let v: Value = serde_json::from_slice(&bodies[0]).unwrap_or(Value::Null);
    assert_eq!(v["result"]["_meta"]["dev.atmost/permit"], figures_json());
    assert_eq!(v["result"]["content"][0]["text"], "paid");
    assert_eq!(
        reported(&s),
        Outcome::Completed {
            receipt: RECEIPT.into()
        }
    );
}

#[test]
fn an_answer_that_is_neither_json_nor_sse_keeps_its_length_but_gets_the_headers() {
    let mut call = dispatched_with_figures(cfg());
    let s = call.on_response_headers(ResponseHead {
        content_type: Some("text/plain".into()),
        end_of_stream: false,
        tool_refusal: None,
    });
    assert_eq!(s.effects, figure_headers());
    assert_eq!(done(call.on_response_body(4, true)), Step::cont());
    // Without figures from the ledger nothing is set or edited.
    let mut call = dispatched(cfg());
    assert!(call.on_response_headers(json_head()).effects.is_empty());
    let s = json_answer_body(&mut call, RECEIPT);
    assert!(replaced_bodies(&s).is_empty());
}

#[test]
fn an_sse_answer_split_over_chunks_is_held_whole_and_carries_the_figures() {
    let stream = "event: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{}}\n\n\
                  event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{\"content\":[]}}\n\n";
    let bytes = stream.as_bytes();
    let answer_at = stream
        .find("event: message\ndata: {\"jsonrpc\":\"2.0\",\"id\"")
        .unwrap_or(0);
    for cut in 1..bytes.len() {
        let mut call = dispatched_with_figures(cfg());
        call.on_response_headers(sse_head());
        let mut out: Vec<u8> = Vec::new();
        let mut answered = None;
        // What Envoy holds: a buffer the filter paused comes back with the next chunk.
        let mut buffer = Vec::new();
        for (i, chunk) in [&bytes[..cut], &bytes[cut..]].into_iter().enumerate() {
            buffer.extend_from_slice(chunk);
            let len = read(call.on_response_body(buffer.len(), false));
            let s = call.on_response_body_data(&buffer[..len], false);
            if let Some(body) = replaced_bodies(&s).pop() {
                buffer = body;
            }
            if s.flow == Flow::Continue {
                out.append(&mut buffer);
            } else if s != Step::pause() {
                // Held until the report is done, then released.
                out.append(&mut buffer);
                answered = Some((i, reported(&s)));
            }
        }
        let (i, outcome) = answered.unwrap_or_else(|| panic!("no answer, cut at {cut}"));
        assert_eq!(i, 1, "the answer is whole with its last byte, cut at {cut}");
        assert_eq!(
            outcome,
            Outcome::Completed {
                receipt: r#"{"jsonrpc":"2.0","id":7,"result":{"content":[]}}"#.into()
            }
        );
        let want = format!(
            "{}event: message\ndata: {{\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{{\"_meta\":{{\"dev.atmost/permit\":{}}},\"content\":[]}}}}\n\n",
            &stream[..answer_at],
            figures_json()
        );
        assert_eq!(String::from_utf8_lossy(&out), want, "cut at {cut}");
    }
}

#[test]
fn a_resumable_stream_leaves_the_figures_to_the_resumed_get() {
    let mut call = dispatched_with_figures(cfg());
    call.on_response_headers(sse_head());
    let chunk = b"id: ev-1\ndata: \n\n";
    read(call.on_response_body(chunk.len(), false));
    call.on_response_body_data(chunk, false);
    read(call.on_response_body(0, true));
    let s = call.on_response_body_data(b"", true);
    let ticket = s.effects.iter().find_map(|e| match e {
        Effect::SaveResume(_, t) => Some(t.clone()),
        _ => None,
    });
    assert_eq!(ticket.and_then(|t| t.limits), Some(figures()));
}
