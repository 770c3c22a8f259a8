//! Reading a POST's body: what is refused before any decision.

use crate::call::tests::*;

#[test]
fn too_large_by_content_length_or_by_body() {
    let c = cfg_with(json!({"max_body_bytes": 100}));
    let mut call = Call::new(Rc::clone(&c));
    let mut head = post(&[TOKEN], &[]);
    head.content_length = Some(101);
    let s = call.on_request_headers(head);
    assert_eq!(s.flow, Flow::Pause);
    let r = local_reply(&s);
    assert_eq!(r.status, 413);
    assert_eq!(
        r.body_json(),
        Some(
            json!({"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"request body exceeds max_body_bytes (100)"}})
        )
    );
    assert_eq!(call.state_name(), "answered");

    let mut call = Call::new(c);
    call.on_request_headers(post(&[TOKEN], &[]));
    assert_eq!(done(call.on_request_body(60, false)).flow, Flow::Pause);
    let s = done(call.on_request_body(101, false));
    assert_eq!(local_reply(&s).status, 413);
    assert_eq!(s.flow, Flow::Pause);
    assert_eq!(counts(&s), vec![Stat::BadRequest]);
}

#[test]
fn a_body_in_another_charset_or_encoding_is_refused_before_it_is_read() {
    for (content_type, content_encoding) in [
        (&["application/json; charset=utf-7"][..], &[][..]),
        (&["application/json; charset=iso-8859-1"], &[]),
        (
            &["application/json", "application/json; charset=utf-16"],
            &[],
        ),
        (&["application/json"], &["gzip"]),
        (&[], &["identity", "br"]),
    ] {
        let mut call = Call::new(cfg());
        let mut head = post(&[TOKEN], &[]);
        head.content_type = content_type.iter().map(|v| v.as_bytes().to_vec()).collect();
        head.content_encoding = content_encoding
            .iter()
            .map(|v| v.as_bytes().to_vec())
            .collect();
        let s = call.on_request_headers(head);
        assert_eq!(s.flow, Flow::Pause);
        assert!(s.callout.is_none());
        let r = local_reply(&s);
        assert_eq!(r.status, 400, "{content_type:?} {content_encoding:?}");
        assert_eq!(
            r.body_json().map(|b| b["error"]["code"].clone()),
            Some(json!(-32600))
        );
        assert_eq!(counts(&s), vec![Stat::BadRequest]);
        assert_eq!(call.state_name(), "answered");
        // Nothing of the body is read or let through afterwards.
        assert_eq!(
            done(call.on_request_body(PAY.len(), true)).flow,
            Flow::Pause
        );
    }
    // UTF-8 declared in any spelling, and identity, are read as usual.
    let mut call = Call::new(cfg());
    let mut head = post(&[TOKEN], &["\"k1\""]);
    head.content_type = vec![b"application/json; charset=\"UTF-8\"".to_vec()];
    head.content_encoding = vec![b"identity".to_vec()];
    assert_eq!(call.on_request_headers(head).flow, Flow::Pause);
    assert_eq!(call.state_name(), "reading_body");
    let len = read(call.on_request_body(PAY.len(), true));
    let s = call.on_request_body_data(&PAY.as_bytes()[..len]);
    assert!(s.callout.is_some(), "{s:?}");
}

#[test]
fn keys_equal_under_case_folding_are_refused_before_any_decision() {
    for body in [
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/list","Method":"tools/call","params":{"name":"pay_invoice"}}"#,
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"echo","Name":"pay_invoice"}}"#,
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"pay_invoice","arguments":{"amount":1,"Amount":99999}}}"#,
        "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"tools/call\",\"params\":{\"name\":\"pay_invoice\",\"arguments\":{},\"argument\u{17F}\":{\"amount\":9}}}",
        r#"[{"jsonrpc":"2.0","id":1,"method":"tools/list","METHOD":"tools/call"}]"#,
    ] {
        let mut call = Call::new(cfg());
        call.on_request_headers(post(&[TOKEN], &["\"k1\""]));
        let len = read(call.on_request_body(body.len(), true));
        let s = call.on_request_body_data(&body.as_bytes()[..len]);
        assert!(s.callout.is_none(), "{body}");
        let r = local_reply(&s);
        assert_eq!(r.status, 400);
        let reply = r.body_json().unwrap_or_default();
        assert_eq!(reply["error"]["code"], json!(-32700), "{body}");
        assert!(reply["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("letter case")));
    }
}

#[test]
fn bad_bodies_are_local_replies() {
    for (body, status, code) in [
        ("nope", 400, -32700),
        ("{}", 400, -32600),
        (
            r#"[{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x"}}]"#,
            400,
            -32600,
        ),
        (
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":1}}"#,
            400,
            -32602,
        ),
    ] {
        let mut call = Call::new(cfg());
        let s = send(&mut call, post(&[TOKEN], &[]), body);
        assert_eq!(s.flow, Flow::Pause);
        assert!(s.callout.is_none());
        let r = local_reply(&s);
        assert_eq!(r.status, status);
        assert_eq!(
            r.body_json().map(|v| v["error"]["code"].clone()),
            Some(json!(code))
        );
        assert_eq!(call.state_name(), "answered");
    }
}

#[test]
fn request_trailers_while_reading_are_refused() {
    let mut call = Call::new(cfg());
    call.on_request_headers(post(&[TOKEN], &[]));
    let s = call.on_request_trailers();
    assert_eq!(local_reply(&s).status, 400);
}
