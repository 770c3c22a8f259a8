//! Traffic that needs no ledger answer: it passes, every idempotency key it carries in
//! its upstream form.

use crate::call::tests::*;

#[test]
fn other_methods_and_ungoverned_tools_pass_without_callout() {
    let c = cfg_with(json!({"governed_tools": ["pay_invoice"]}));
    for body in [
        r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}"#,
        r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
        r#"[{"jsonrpc":"2.0","id":1,"method":"tools/list"}]"#,
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"search"}}"#,
    ] {
        let mut call = Call::new(Rc::clone(&c));
        // No permit needed for traffic that is not governed.
        let s = send(&mut call, post(&[], &[]), body);
        assert_eq!(s, Step::cont(), "{body}");
        assert_eq!(call.state_name(), "passing");
        assert_eq!(
            call.on_log(LogProps {
                attempts: Some(1),
                flags: Some(0)
            }),
            Step::cont()
        );
    }
}

#[test]
fn a_refused_rewrite_of_traffic_that_is_not_governed_refuses_it() {
    let c = cfg_with(json!({"governed_tools": ["pay_invoice"]}));
    let search = PARAMS_PAY.replace("pay_invoice", "search");
    let mut call = Call::new(Rc::clone(&c));
    let s = send(&mut call, post(&[], &["\"raw-p\""]), &search);
    assert!(body_edit_of(&s).is_some());
    let s = call.on_rewrite_failed();
    assert_eq!(s.flow, Flow::Pause);
    assert!(enqueued(&s).is_empty());
    let reply = local_reply(&s).body_json().unwrap_or_default();
    assert_eq!(reply["id"], 7);
    assert_eq!(
        reply["result"]["structuredContent"]["error"]["code"],
        "gateway_unavailable"
    );
    assert_eq!(call.state_name(), "answered");
    // Not a tools/call: a JSON-RPC error with the request's id.
    let mut call = Call::new(Rc::clone(&c));
    send(
        &mut call,
        post(&[], &[]),
        r#"{"jsonrpc":"2.0","id":"l1","method":"tools/list","params":{"idempotencyKey":"raw-p"}}"#,
    );
    let r = local_reply(&call.on_rewrite_failed()).clone();
    assert_eq!(r.status, 503);
    let v = r.body_json().unwrap_or_default();
    assert_eq!(
        (v["id"].clone(), v["error"]["code"].clone()),
        (json!("l1"), json!(-32603))
    );
    // A bodiless request whose header could not be rewritten, or whose permit could not be
    // stripped.
    for head in [
        RequestHead {
            method: "DELETE".into(),
            idempotency_key: vec![b"raw-p".to_vec()],
            ..RequestHead::default()
        },
        RequestHead {
            method: "GET".into(),
            permit: vec![b"tok".to_vec()],
            ..RequestHead::default()
        },
    ] {
        let mut call = Call::new(Rc::clone(&c));
        assert_eq!(call.on_request_headers(head).flow, Flow::Continue);
        let s = call.on_rewrite_failed();
        assert_eq!((s.flow, local_reply(&s).status), (Flow::Pause, 503));
        assert_eq!(call.state_name(), "answered");
    }
}

#[test]
fn ungoverned_calls_forward_every_key_form_only_in_the_upstream_form() {
    let patch = |mode: Value| json!({"governed_tools": ["pay_invoice"], "upstream_key": mode});
    let hmac = cfg_with(patch(json!({"secret": "0123456789abcdef0123"})));
    let search = PARAMS_PAY.replace("pay_invoice", "search");
    let head = || RequestHead {
        content_length: Some(search.len() as u64),
        ..post(&[TOKEN], &["\"raw-p\""])
    };
    let mut call = Call::new(Rc::clone(&hmac));
    let s = send(&mut call, head(), &search);
    assert_eq!(s.flow, Flow::Continue);
    assert!(s.callout.is_none());
    // No ledger answer, no verified permit: the derivation uses the empty permit id.
    let want = derived(&hmac, "", "raw-p");
    assert_ne!(want, derived(&hmac, "pmt_1", "raw-p"));
    let body = search.replace("\"raw-p\"", &format!("\"{want}\""));
    assert_eq!(
        s.effects,
        vec![
            Effect::ReplaceRequestBody {
                original_len: search.len(),
                body: body.clone().into_bytes(),
            },
            Effect::SetRequestHeader("content-length".into(), body.len().to_string()),
            Effect::SetRequestHeader("idempotency-key".into(), want),
        ]
    );
    assert_eq!(call.state_name(), "passing");
    assert_eq!(call.on_log(LogProps::default()), Step::cont());
    // off: removed everywhere.
    let mut call = Call::new(cfg_with(patch(json!({"mode": "off"}))));
    let s = send(&mut call, head(), &search);
    let body = body_edit_of(&s).unwrap_or_default();
    assert!(
        !body.contains("raw-p") && !body.contains("idempotencyKey"),
        "{body}"
    );
    assert!(s
        .effects
        .contains(&Effect::RemoveRequestHeader("idempotency-key".into())));
    // raw: the request goes as sent.
    let mut call = Call::new(cfg_with(patch(json!({"mode": "raw"}))));
    assert_eq!(send(&mut call, head(), &search), Step::cont());
}

#[test]
fn every_message_carrying_a_key_forwards_it_only_in_the_upstream_form() {
    let c = cfg();
    let want = |k: &str| derived(&c, "", k);
    for body in [
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"_meta":{"dev.atmost/idempotency-key":"raw-a"}}}"#,
        r#"{"jsonrpc":"2.0","method":"notifications/progress","params":{"idempotencyKey":"raw-a","progress":1}}"#,
        r#"[{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"idempotencyKey":"raw-a"}},{"jsonrpc":"2.0","method":"x","params":{"_meta":{"dev.atmost/idempotency-key":"raw-b"}}}]"#,
    ] {
        let mut call = Call::new(Rc::clone(&c));
        let s = send(&mut call, post(&[], &[]), body);
        assert_eq!(s.flow, Flow::Continue, "{body}");
        let sent = body
            .replace("\"raw-a\"", &format!("\"{}\"", want("raw-a")))
            .replace("\"raw-b\"", &format!("\"{}\"", want("raw-b")));
        assert_eq!(body_edit_of(&s), Some(sent), "{body}");
        assert_eq!(call.state_name(), "passing");
    }
    // A key field atmost would not accept is dropped, never forwarded raw.
    let mut call = Call::new(Rc::clone(&c));
    let s = send(
        &mut call,
        post(&[], &[]),
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"idempotencyKey":{"raw":"x"},"cursor":"c"}}"#,
    );
    assert_eq!(
        body_edit_of(&s).as_deref(),
        Some(r#"{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"cursor":"c"}}"#)
    );
    // Only the header: no body edit.
    let mut call = Call::new(Rc::clone(&c));
    let s = send(
        &mut call,
        post(&[], &["raw-h"]),
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#,
    );
    assert_eq!(
        s.effects,
        vec![Effect::SetRequestHeader(
            "idempotency-key".into(),
            want("raw-h")
        )]
    );
    // No key anywhere: passes with nothing to do.
    let mut call = Call::new(Rc::clone(&c));
    let s = send(
        &mut call,
        post(&[], &[]),
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"_meta":{"k":"raw"}}}"#,
    );
    assert_eq!(s, Step::cont());
}
