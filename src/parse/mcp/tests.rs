use super::*;
use crate::parse::idempotency::KeyField;
use serde_json::json;

fn refused(body: &str) -> (u32, Value) {
    refused_with(body, &Mirrored::default())
}

fn refused_with(body: &str, m: &Mirrored) -> (u32, Value) {
    match parse(body.as_bytes(), m) {
        Ok(msg) => panic!("accepted {body}: {msg:?}"),
        Err(r) => (r.status, r.body_json().unwrap_or(Value::Null)),
    }
}

fn call(body: &str) -> ToolCall {
    match parse(body.as_bytes(), &Mirrored::default()) {
        Ok(Message::ToolCall(c)) => c,
        other => panic!("{body}: {other:?}"),
    }
}

/// What `params._meta["dev.atmost/idempotency-key"]` of the call holds.
fn meta_key(keys: &BodyKeys) -> KeyField {
    keys.named("dev.atmost/idempotency-key")
        .cloned()
        .unwrap_or_else(|| panic!("no such key source"))
}

/// What `params.idempotencyKey` of the call holds.
fn params_key(keys: &BodyKeys) -> KeyField {
    keys.named("idempotencyKey")
        .cloned()
        .unwrap_or_else(|| panic!("no such key source"))
}

fn passes(body: &str) {
    assert_eq!(
        parse(body.as_bytes(), &Mirrored::default()),
        Ok(Message::Other),
        "{body}"
    );
}

#[test]
fn not_json_is_a_parse_error() {
    for body in ["", "{", "nope", "{\"jsonrpc\":\"2.0\",}", "\u{0}"] {
        let (status, v) = refused(body);
        assert_eq!(status, 400);
        assert_eq!(v["error"]["code"], -32700);
        assert_eq!(v["id"], Value::Null);
    }
}

#[test]
fn json_but_not_jsonrpc_is_invalid_request() {
    for body in [
        "1",
        "\"x\"",
        "null",
        "{}",
        r#"{"method":"tools/list","id":1}"#,
        r#"{"jsonrpc":"1.0","method":"tools/list","id":1}"#,
        r#"{"jsonrpc":"2.0","id":1}"#,
        r#"{"jsonrpc":"2.0","method":5,"id":1}"#,
        r#"{"jsonrpc":"2.0","method":"x","id":{"a":1}}"#,
        r#"{"jsonrpc":"2.0","method":"x","params":3,"id":1}"#,
        r#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"t"}}"#,
        r#"{"jsonrpc":"2.0","method":"tools/call","params":{"name":"t"},"id":null}"#,
    ] {
        let (status, v) = refused(body);
        assert_eq!(status, 400, "{body}");
        assert_eq!(v["error"]["code"], -32600, "{body}");
    }
    let (_, v) = refused(r#"{"jsonrpc":"1.0","method":"tools/list","id":"abc"}"#);
    assert_eq!(v["id"], "abc");
}

#[test]
fn bad_tools_call_params_are_invalid_params_with_the_id() {
    for body in [
        r#"{"jsonrpc":"2.0","method":"tools/call","id":4}"#,
        r#"{"jsonrpc":"2.0","method":"tools/call","id":4,"params":[]}"#,
        r#"{"jsonrpc":"2.0","method":"tools/call","id":4,"params":{}}"#,
        r#"{"jsonrpc":"2.0","method":"tools/call","id":4,"params":{"name":7}}"#,
        r#"{"jsonrpc":"2.0","method":"tools/call","id":4,"params":{"name":"t","arguments":[1]}}"#,
        r#"{"jsonrpc":"2.0","method":"tools/call","id":4,"params":{"name":"t","arguments":null}}"#,
    ] {
        let (status, v) = refused(body);
        assert_eq!(status, 400, "{body}");
        assert_eq!(v["error"]["code"], -32602, "{body}");
        assert_eq!(v["id"], 4, "{body}");
    }
}

/// `case_variant` compares an ASCII key only with names of its length: true while every
/// name it is given is ASCII.
#[test]
fn the_member_names_read_by_name_are_ascii() {
    // Each name once per place it is read: of the message, of `params`, of `_meta`.
    let distinct = |names: &[&'static str]| {
        names
            .iter()
            .copied()
            .collect::<std::collections::BTreeSet<_>>()
    };
    let places = [
        distinct(&MESSAGE_MEMBERS),
        distinct(&PARAMS_READ),
        distinct(&META_READ),
    ];
    let names = places.iter().flatten();
    assert!(names.clone().count() == 15 && names.into_iter().all(|n| n.is_ascii()));
}

/// A key source's member is refused in another letter case only where the gateway looks
/// for misspellings: in `params` and in `params._meta`. A source in another object of
/// `params` needs that object read in `misspelled_member` too.
#[test]
fn every_key_source_sits_where_misspellings_are_looked_for() {
    for source in &BODY_KEY_SOURCES {
        assert!(
            source.within.is_none() || source.within == Some(META),
            "{source:?}"
        );
        assert!(PARAMS_READ.contains(&source.params_member()));
        assert_eq!(
            META_READ.contains(&source.name),
            source.within.is_some(),
            "{source:?}"
        );
    }
}

#[test]
fn a_member_spelled_in_another_case_is_refused_even_alone() {
    for body in [
        // Passes as a response to an exact reader; a Go server runs a tools/call.
        r#"{"jsonrpc":"2.0","id":1,"result":{},"Method":"tools/call","params":{"name":"pay","arguments":{}}}"#,
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/list","Params":{"name":"pay"}}"#,
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"echo","ARGUMENTS":{"amount":9}}}"#,
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"NAME":"pay"}}"#,
        "{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"tools/call\",\"params\":{\"name\":\"pay\",\"argument\\u017f\":{}}}",
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"pay","_meta":{"DEV.atmost/idempotency-key":"k"}}}"#,
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"pay","IdempotencyKey":"k"}}"#,
        r#"[{"jsonrpc":"2.0","method":"tools/list","id":1},{"jsonrpc":"2.0","id":2,"METHOD":"tools/call"}]"#,
    ] {
        let (status, v) = refused(body);
        assert_eq!((status, v["error"]["code"].clone()), (400, json!(-32600)), "{body}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("letter case")),
            "{v}"
        );
    }
    // Argument names are the tool's own: the gateway reads none of them by name.
    call(
        r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"pay","arguments":{"Method":1,"NAME":2}}}"#,
    );
}

/// Every key source of the table is read where it sits, and refused spelled in another
/// letter case, in a `tools/call` and in any other message.
#[test]
fn each_key_source_is_read_and_its_case_variants_refused() {
    let params_with = |source: &KeyMember, name: &str| match source.within {
        Some(object) => json!({"name": "pay", object: {name: "k1"}}),
        None => json!({"name": "pay", name: "k1"}),
    };
    let message = |method: &str, params: Value| {
        json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).to_string()
    };
    for source in &BODY_KEY_SOURCES {
        let c = call(&message("tools/call", params_with(source, source.name)));
        assert_eq!(
            c.keys.named(source.name),
            Some(&KeyField::Present("k1".into()))
        );
        assert_eq!(
            parse(
                message("resources/list", params_with(source, source.name)).as_bytes(),
                &Mirrored::default()
            ),
            Ok(Message::KeyedOther(json!(1)))
        );
        let upper = source.name.to_ascii_uppercase();
        for method in ["tools/call", "resources/list"] {
            let (status, v) = refused(&message(method, params_with(source, &upper)));
            assert_eq!((status, v["error"]["code"].clone()), (400, json!(-32600)));
            assert!(
                v["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains(source.name)),
                "{v}"
            );
        }
    }
}

#[test]
fn other_messages_pass() {
    passes(r#"{"jsonrpc":"2.0","method":"initialize","id":1,"params":{}}"#);
    passes(r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#);
    passes(r#"{"jsonrpc":"2.0","id":9,"result":{}}"#);
    passes(r#"{"jsonrpc":"2.0","id":9,"error":{"code":1,"message":"m"}}"#);
    passes(r#"[]"#);
    passes(
        r#"[{"jsonrpc":"2.0","method":"tools/list","id":1},{"jsonrpc":"2.0","method":"notifications/x"}]"#,
    );
}

#[test]
fn a_tools_list_request_is_told_apart_with_its_id() {
    let list = |body: &str| parse(body.as_bytes(), &Mirrored::default());
    assert_eq!(
        list(r#"{"jsonrpc":"2.0","method":"tools/list","id":"x"}"#),
        Ok(Message::ToolsList {
            id: json!("x"),
            keyed: false
        })
    );
    assert_eq!(
        list(
            r#"{"jsonrpc":"2.0","method":"tools/list","id":3,"params":{"_meta":{"dev.atmost/idempotency-key":"k"}}}"#
        ),
        Ok(Message::ToolsList {
            id: json!(3),
            keyed: true
        })
    );
    // Without a usable id there is no answer to find: it passes like any message.
    assert_eq!(
        list(r#"{"jsonrpc":"2.0","method":"tools/list"}"#),
        Ok(Message::Other)
    );
    assert_eq!(
        list(r#"{"jsonrpc":"2.0","method":"tools/list","id":null}"#),
        Ok(Message::Other)
    );
}

#[test]
fn batch_with_tools_call_is_refused_whole() {
    let (status, v) = refused(
        r#"[{"jsonrpc":"2.0","method":"tools/list","id":1},{"jsonrpc":"2.0","method":"tools/call","id":2,"params":{"name":"t"}}]"#,
    );
    assert_eq!(status, 400);
    assert_eq!(v["error"]["code"], -32600);
    assert_eq!(v["error"]["message"], BATCH_REFUSED);
    // Even a malformed tools/call inside a batch refuses the batch.
    let (_, v) = refused(r#"[{"method":"tools/call"}]"#);
    assert_eq!(v["error"]["message"], BATCH_REFUSED);
}

#[test]
fn tools_call_parts() {
    let c = call(
        r#"{"jsonrpc":"2.0","method":"tools/call","id":"r1","params":{"name":"pay","arguments":{"a":1},"_meta":{"dev.atmost/idempotency-key":"k1","progressToken":3}}}"#,
    );
    assert_eq!(c.id, json!("r1"));
    assert_eq!(c.name, "pay");
    assert_eq!(Value::Object(c.arguments), json!({"a":1}));
    assert_eq!(meta_key(&c.keys), KeyField::Present("k1".into()));
    let c = call(r#"{"jsonrpc":"2.0","method":"tools/call","id":0,"params":{"name":"pay"}}"#);
    assert!(c.arguments.is_empty());
    assert_eq!(meta_key(&c.keys), KeyField::Absent);
    let c = call(
        r#"{"jsonrpc":"2.0","method":"tools/call","id":0,"params":{"name":"pay","_meta":{"dev.atmost/idempotency-key":5}}}"#,
    );
    assert_eq!(meta_key(&c.keys), KeyField::NotAString);
}

#[test]
fn params_idempotency_key_is_read() {
    let c = call(
        r#"{"jsonrpc":"2.0","method":"tools/call","id":1,"params":{"name":"pay","idempotencyKey":"k9","arguments":{"idempotencyKey":"decoy"}}}"#,
    );
    assert_eq!(params_key(&c.keys), KeyField::Present("k9".into()));
    assert_eq!(meta_key(&c.keys), KeyField::Absent);
    assert_eq!(
        Value::Object(c.arguments),
        json!({"idempotencyKey":"decoy"})
    );
    let c = call(
        r#"{"jsonrpc":"2.0","method":"tools/call","id":1,"params":{"name":"pay","idempotencyKey":null}}"#,
    );
    assert_eq!(params_key(&c.keys), KeyField::NotAString);
    let c = call(r#"{"jsonrpc":"2.0","method":"tools/call","id":1,"params":{"name":"pay"}}"#);
    assert_eq!(params_key(&c.keys), KeyField::Absent);
}

#[test]
fn other_messages_carrying_a_key_are_told_apart() {
    for (body, id) in [
        (
            r#"{"jsonrpc":"2.0","method":"resources/list","id":1,"params":{"_meta":{"dev.atmost/idempotency-key":"k"}}}"#,
            json!(1),
        ),
        (
            r#"{"jsonrpc":"2.0","method":"notifications/x","params":{"idempotencyKey":5}}"#,
            Value::Null,
        ),
        (
            r#"[{"jsonrpc":"2.0","method":"tools/list","id":1},{"jsonrpc":"2.0","method":"x","params":{"idempotencyKey":"k"}}]"#,
            Value::Null,
        ),
    ] {
        assert_eq!(
            parse(body.as_bytes(), &Mirrored::default()),
            Ok(Message::KeyedOther(id.clone())),
            "{body}"
        );
    }
    // Keys elsewhere than params (or its _meta) are not idempotency keys.
    passes(
        r#"{"jsonrpc":"2.0","method":"resources/list","id":1,"params":{"cursor":{"idempotencyKey":"k"}}}"#,
    );
    passes(r#"{"jsonrpc":"2.0","id":9,"result":{"idempotencyKey":"k"}}"#);
    passes(
        r#"{"jsonrpc":"2.0","method":"resources/list","id":1,"params":[{"idempotencyKey":"k"}]}"#,
    );
}

#[test]
fn mirrored_headers_must_match() {
    let body = r#"{"jsonrpc":"2.0","method":"tools/call","id":3,"params":{"name":"pay"}}"#;
    let ok = Mirrored {
        method: Some("tools/call".into()),
        name: Some("pay".into()),
        ..Mirrored::default()
    };
    assert!(matches!(
        parse(body.as_bytes(), &ok),
        Ok(Message::ToolCall(_))
    ));
    for m in [
        Mirrored {
            method: Some("tools/list".into()),
            name: None,
            ..Mirrored::default()
        },
        Mirrored {
            method: None,
            name: Some("refund".into()),
            ..Mirrored::default()
        },
    ] {
        let (status, v) = refused_with(body, &m);
        assert_eq!(status, 400);
        assert_eq!(v["error"]["code"], -32020);
        assert_eq!(v["id"], 3);
    }
    // Duplicated mirrored headers are refused even when the first one matches.
    let (_, v) = refused_with(
        body,
        &Mirrored {
            duplicated: true,
            ..ok.clone()
        },
    );
    assert_eq!(v["error"]["code"], -32020);
    // A header claiming tools/list on a tools/call body cannot dodge governance.
    let (_, v) = refused_with(
        body,
        &Mirrored {
            method: Some("tools/list".into()),
            name: None,
            ..Mirrored::default()
        },
    );
    assert_eq!(v["error"]["code"], -32020);
}

#[test]
fn protocol_version_decides_whether_mirrored_headers_are_required() {
    let modern = r#"{"jsonrpc":"2.0","method":"tools/call","id":3,"params":{"name":"pay","_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28"}}}"#;
    let legacy = r#"{"jsonrpc":"2.0","method":"tools/call","id":3,"params":{"name":"pay"}}"#;
    let v2026 = |method: Option<&str>, name: Option<&str>| Mirrored {
        method: method.map(String::from),
        name: name.map(String::from),
        protocol_version: Some("2026-07-28".into()),
        duplicated: false,
    };
    // 2026-07-28 by header or by body: both headers required.
    for (body, m) in [
        (modern, Mirrored::default()),
        (legacy, v2026(None, None)),
        (legacy, v2026(Some("tools/call"), None)),
        (legacy, v2026(None, Some("pay"))),
    ] {
        let (status, v) = refused_with(body, &m);
        assert_eq!((status, v["error"]["code"].clone()), (400, json!(-32020)));
    }
    assert!(matches!(
        parse(modern.as_bytes(), &v2026(Some("tools/call"), Some("pay"))),
        Ok(Message::ToolCall(_))
    ));
    // Header and body disagreeing on the version is a mismatch.
    let mut m = v2026(Some("tools/call"), Some("pay"));
    m.protocol_version = Some("2025-11-25".into());
    let (_, v) = refused_with(modern, &m);
    assert_eq!(v["error"]["code"], -32020);
    // Older versions need no mirrored headers.
    for version in ["2025-03-26", "2025-06-18", "2025-11-25"] {
        let m = Mirrored {
            protocol_version: Some(version.into()),
            ..Mirrored::default()
        };
        assert!(
            matches!(parse(legacy.as_bytes(), &m), Ok(Message::ToolCall(_))),
            "{version}"
        );
    }
}

#[test]
fn continuations_are_recognised() {
    let c = call(
        r#"{"jsonrpc":"2.0","method":"tools/call","id":1,"params":{"name":"pay","arguments":{"a":1},"inputResponses":{"q":{"action":"accept"}},"requestState":"s"}}"#,
    );
    assert!(c.continuation);
    assert_eq!(Value::Object(c.arguments), json!({"a":1}));
    let c = call(
        r#"{"jsonrpc":"2.0","method":"tools/call","id":1,"params":{"name":"pay","requestState":"s"}}"#,
    );
    assert!(c.continuation);
    let c = call(r#"{"jsonrpc":"2.0","method":"tools/call","id":1,"params":{"name":"pay"}}"#);
    assert!(!c.continuation);
}
