//! A `tools/list` answer gaining the permit's figures (`tools_list_limits`).

use crate::call::tests::*;

#[test]
fn a_tools_list_answer_gains_each_governed_tools_figures() {
    let (mut call, s) = list(listing_cfg(), &["tok"]);
    assert_eq!(s, Step::cont(), "the request passes at once");
    assert!(call.watches_response_headers());
    let s = call.on_response_headers(json_head());
    assert_eq!(
        s.effects,
        vec![Effect::RemoveResponseHeader("content-length".into())]
    );
    assert_eq!(done(call.on_response_body(10, false)).flow, Flow::Pause);
    let len = read(call.on_response_body(LISTED.len(), true));
    let s = call.on_response_body_data(&LISTED.as_bytes()[..len], true);
    assert_eq!(s.flow, Flow::Pause);
    let c = s.callout.unwrap_or_else(|| panic!("no limits callout"));
    assert_eq!(c.endpoint, Endpoint::Limits);
    let asked: LimitsRequest = serde_json::from_slice(&c.body).unwrap_or(LimitsRequest {
        permit_token: String::new(),
        tools: vec![],
    });
    assert_eq!(
        asked,
        LimitsRequest {
            permit_token: "tok".into(),
            tools: vec!["pay_invoice".into(), "echo".into()]
        }
    );
    assert_eq!(call.state_name(), "listing_asking");
    assert_eq!(done(call.on_response_trailers()).flow, Flow::Pause);
    let mut open = figures();
    open.calls_left = None;
    let s = call.on_ledger_reply(&limits_reply(&[("pay_invoice", figures()), ("echo", open)]));
    assert_eq!(s.effects.last(), Some(&Effect::ResumeResponse));
    assert_eq!(counts(&s), vec![Stat::ToolsListFigures]);
    let bodies = replaced_bodies(&s);
    let v: Value = serde_json::from_slice(&bodies[0]).unwrap_or(Value::Null);
    let tools = &v["result"]["tools"];
    assert_eq!(tools[0]["_meta"]["dev.atmost/permit"], figures_json());
    assert_eq!(tools[1].get("_meta"), None, "search is not governed");
    assert_eq!(tools[2]["_meta"]["x"], 1);
    assert_eq!(
        tools[2]["_meta"]["dev.atmost/permit"]["calls_left"],
        Value::Null
    );
    assert!(matches!(
        s.effects.first(),
        Some(Effect::ReplaceResponseBody { original_len, .. }) if *original_len == LISTED.len()
    ));
    assert_eq!(call.on_log(LogProps::default()), Step::cont());
}

#[test]
fn a_tools_list_without_a_permit_or_the_option_passes_untouched() {
    for (c, permit) in [
        (listing_cfg(), &[][..]),
        (listing_cfg(), &["a", "b"][..]),
        (cfg(), &["tok"][..]),
    ] {
        let (mut call, s) = list(c, permit);
        assert_eq!(s, Step::cont());
        assert_eq!(call.state_name(), "passing");
        assert!(!call.watches_response_headers());
        assert_eq!(done(call.on_response_body(10, true)), Step::cont());
    }
}

#[test]
fn a_tools_list_answer_passes_unchanged_when_the_ledger_says_no_or_cannot_be_asked() {
    let answer_with = |reply: Option<LedgerReply>| {
        let (mut call, _) = list(listing_cfg(), &["tok"]);
        call.on_response_headers(json_head());
        let s = json_answer_body(&mut call, LISTED);
        assert!(s.callout.is_some());
        match reply {
            Some(r) => call.on_ledger_reply(&r),
            None => call.on_callout_failed(),
        }
    };
    let denied = LedgerReply {
        status: Some(403),
        body: br#"{"error":"permit_invalid"}"#.to_vec(),
    };
    for reply in [
        Some(denied),
        Some(LedgerReply::failed()),
        Some(LedgerReply {
            status: Some(200),
            body: b"{}".to_vec(),
        }),
    ] {
        let s = answer_with(reply);
        assert!(replaced_bodies(&s).is_empty());
        assert_eq!(counts(&s), vec![Stat::ToolsListUnchanged]);
        assert_eq!(s.effects.last(), Some(&Effect::ResumeResponse));
    }
    // The callout could not even leave: still in the body callback, the answer goes on.
    let s = answer_with(None);
    assert_eq!(s.flow, Flow::Continue);
    assert!(!s.effects.contains(&Effect::ResumeResponse));
    assert_eq!(counts(&s), vec![Stat::ToolsListUnchanged]);
}

#[test]
fn a_tools_list_answer_without_governed_tools_or_json_asks_nothing() {
    for body in [
        r#"{"jsonrpc":"2.0","id":"l1","result":{"tools":[{"name":"search"}]}}"#,
        r#"{"jsonrpc":"2.0","id":"other","result":{"tools":[{"name":"echo"}]}}"#,
        r#"{"jsonrpc":"2.0","id":"l1","error":{"code":1,"message":"m"}}"#,
        "not json",
    ] {
        let (mut call, _) = list(listing_cfg(), &["tok"]);
        call.on_response_headers(json_head());
        let s = json_answer_body(&mut call, body);
        assert_eq!(s, Step::cont(), "{body}");
    }
}

#[test]
fn a_tools_list_answer_in_an_sse_event_gains_the_figures_in_place() {
    let (mut call, _) = list(listing_cfg(), &["tok"]);
    call.on_response_headers(sse_head());
    let stream = format!("event: message\ndata: {LISTED}\n\n");
    let (a, _) = stream.as_bytes().split_at(30);
    let len = read(call.on_response_body(a.len(), false));
    let s = call.on_response_body_data(&a[..len], false);
    assert_eq!(s, Step::pause(), "Envoy keeps the partial event");
    // Envoy offers what it kept followed by the rest.
    let whole = stream.as_bytes();
    let len = read(call.on_response_body(whole.len(), false));
    let s = call.on_response_body_data(&whole[..len], false);
    assert_eq!(s.flow, Flow::Pause);
    assert!(s.callout.is_some());
    assert!(
        replaced_bodies(&s).is_empty(),
        "the answer waits for the ledger"
    );
    assert_eq!(done(call.on_response_body(5, false)).flow, Flow::Pause);
    let s = call.on_ledger_reply(&limits_reply(&[("pay_invoice", figures())]));
    let body = replaced_bodies(&s).pop().unwrap_or_default();
    let text = String::from_utf8_lossy(&body);
    let data = text
        .strip_prefix("event: message\ndata: ")
        .and_then(|t| t.strip_suffix("\n\n"))
        .unwrap_or_else(|| panic!("not one event: {text}"));
    let v: Value = serde_json::from_str(data).unwrap_or(Value::Null);
    assert_eq!(
        v["result"]["tools"][0]["_meta"]["dev.atmost/permit"],
        figures_json()
    );
    assert_eq!(s.effects.last(), Some(&Effect::ResumeResponse));
}
