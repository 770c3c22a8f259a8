//! The request's headers, in `Start`: what passes at once, and what is read first.

use crate::call::tests::*;

#[test]
fn non_post_passes_without_reading() {
    for method in ["GET", "DELETE", "OPTIONS", "PUT"] {
        let mut call = Call::new(cfg());
        let s = call.on_request_headers(RequestHead {
            method: method.into(),
            permit: vec![b"tok".to_vec()],
            ..RequestHead::default()
        });
        assert_eq!(s.flow, Flow::Continue);
        assert_eq!(
            s.effects,
            vec![Effect::RemoveRequestHeader("atmost-permit".into())]
        );
        // Without a permit header there is nothing to strip.
        let s = Call::new(cfg()).on_request_headers(RequestHead {
            method: method.into(),
            ..RequestHead::default()
        });
        assert!(s.effects.is_empty());
        assert!(s.callout.is_none());
        assert_eq!(call.state_name(), "passing");
        assert_eq!(done(call.on_request_body(10, true)).flow, Flow::Continue);
        assert_eq!(call.on_response_headers(sse_head()).flow, Flow::Continue);
        assert_eq!(done(call.on_response_body(10, false)), Step::cont());
        assert_eq!(call.on_log(LogProps::default()), Step::cont());
    }
}

#[test]
fn bodiless_post_passes() {
    let mut call = Call::new(cfg());
    let mut head = post(&[], &[]);
    head.end_of_stream = true;
    let s = call.on_request_headers(head);
    assert_eq!(s.flow, Flow::Continue);
    assert_eq!(call.state_name(), "passing");
}

#[test]
fn bodiless_requests_forward_the_key_header_only_in_the_upstream_form() {
    let c = cfg();
    let head = |method: &str, keys: &[&str]| RequestHead {
        method: method.into(),
        idempotency_key: keys.iter().map(|k| k.as_bytes().to_vec()).collect(),
        ..RequestHead::default()
    };
    for method in ["GET", "DELETE"] {
        let s = Call::new(Rc::clone(&c)).on_request_headers(head(method, &["\"raw-g\""]));
        assert_eq!(s.flow, Flow::Continue);
        assert_eq!(
            s.effects,
            vec![Effect::SetRequestHeader(
                "idempotency-key".into(),
                derived(&c, "", "raw-g")
            )]
        );
    }
    // A header atmost cannot read as one key is removed rather than forwarded.
    for keys in [&["a", "b"][..], &["\"unterminated"][..]] {
        let s = Call::new(Rc::clone(&c)).on_request_headers(head("DELETE", keys));
        assert_eq!(
            s.effects,
            vec![Effect::RemoveRequestHeader("idempotency-key".into())]
        );
    }
    let raw = cfg_with(json!({"upstream_key": {"mode": "raw"}}));
    assert_eq!(
        Call::new(raw).on_request_headers(head("GET", &["\"raw-g\""])),
        Step::cont()
    );
}
