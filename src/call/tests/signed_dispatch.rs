//! `request_hold: headers`: every governed call asks the ledger to sign what will leave, and
//! leaves only with that signature (docs/signatures.md#the-gateway).

use super::*;
use sha2::{Digest, Sha256};

fn hex_sha256(bytes: &[u8]) -> String {
    crate::parse::fingerprint::hex(&Sha256::digest(bytes))
}

/// A POST as an HTTP/1.1 client sends it, with a `Host` and a query.
fn hosted(key: &[&str], body: &str) -> RequestHead {
    RequestHead {
        authority: "MCP.Example:8000".into(),
        path: "/mcp?tenant=a".into(),
        content_length: Some(body.len() as u64),
        ..post(&[TOKEN], key)
    }
}

/// What leaves for a dispatched call: the body Envoy sends (the replacement, or the body as
/// received) and the request headers the step sets.
fn sent(received: &str, step: &Step) -> (Vec<u8>, Vec<(String, String)>) {
    let body = step
        .effects
        .iter()
        .find_map(|e| match e {
            Effect::ReplaceRequestBody { original_len, body } => {
                assert_eq!(*original_len, received.len());
                Some(body.clone())
            }
            _ => None,
        })
        .unwrap_or_else(|| received.as_bytes().to_vec());
    let headers = step
        .effects
        .iter()
        .filter_map(|e| match e {
            Effect::SetRequestHeader(n, v) => Some((n.clone(), v.clone())),
            _ => None,
        })
        .collect();
    (body, headers)
}

fn target_of(asked: &AuthorizeRequest) -> DispatchTarget {
    asked
        .dispatch
        .clone()
        .unwrap_or_else(|| panic!("no dispatch asked: {asked:?}"))
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    let mut values = headers.iter().filter(|(n, _)| n == name);
    let value = values.next().map(|(_, v)| v.as_str());
    assert!(values.next().is_none(), "{name} set twice");
    value
}

#[test]
fn authorize_names_the_request_as_it_will_leave() {
    let c = cfg_with(json!({"signature_validity_s": 12}));
    let mut call = Call::new(Rc::clone(&c));
    let asked = authorize_body(&send(&mut call, hosted(&["\"k1\""], PAY), PAY));
    let target = target_of(&asked);
    assert_eq!(
        target,
        DispatchTarget {
            method: "POST".into(),
            authority: "mcp.example:8000".into(),
            path: "/mcp".into(),
            body_sha256: hex_sha256(PAY.as_bytes()),
            idempotency_key: Some(derived(&c, "pmt_1", "k1")),
            validity_s: 12,
        }
    );
    // The key named is the one the ledger records as forwarded.
    assert_eq!(asked.forwarded_key, target.idempotency_key);
    // The default validity is Envoy's default route timeout; no key, no key header.
    let mut call = Call::new(cfg());
    let asked = authorize_body(&send(&mut call, hosted(&[], PAY), PAY));
    let target = target_of(&asked);
    assert_eq!((target.validity_s, target.idempotency_key), (15, None));
}

/// In every place a key can sit and every `upstream_key` mode, the digest the ledger signs
/// is the SHA-256 of the exact bytes that leave, and `Content-Digest` says the same.
#[test]
fn the_signed_digest_is_of_the_bytes_that_leave() {
    const META: &str = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"pay_invoice","arguments":{"amount":10.50},"_meta":{"dev.atmost/idempotency-key":"raw-k1","x":1}}}"#;
    const PARAMS: &str = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"idempotencyKey":"raw-k1","name":"pay_invoice","arguments":{}}}"#;
    const BOTH: &str = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"idempotencyKey":"raw-k1", "name":"pay_invoice","arguments":{},"_meta":{ "dev.atmost/idempotency-key" : "raw-k1" }}}"#;
    let modes = [
        json!({"mode": "hmac", "secret": "0123456789abcdef0123"}),
        json!({"mode": "raw"}),
        json!({"mode": "off"}),
    ];
    let cases: [(&[&str], &str, bool); 6] = [
        (&[], PAY, false),
        (&["\"raw-k1\""], PAY, false),
        (&[], META, true),
        (&[], PARAMS, true),
        (&["raw-k1"], BOTH, true),
        (&["\"raw-k1\""], META, true),
    ];
    let mut rewritten = 0;
    for mode in modes {
        let c = cfg_with(json!({ "upstream_key": mode }));
        for (key, body, in_body) in cases {
            let mut call = Call::new(Rc::clone(&c));
            let asked = authorize_body(&send(&mut call, hosted(key, body), body));
            let target = target_of(&asked);
            let step = call.on_ledger_reply(&ledger(&signed(&call, dispatch())));
            assert_eq!(
                step.effects.last(),
                Some(&Effect::ResumeRequest),
                "{step:?}"
            );
            let (bytes, headers) = sent(body, &step);
            let what = format!("{mode} {key:?} {body}");
            assert_eq!(target.body_sha256, hex_sha256(&bytes), "{what}");
            assert_eq!(
                header(&headers, "content-digest"),
                Some(signature::content_digest_of(&bytes).as_str()),
                "{what}"
            );
            assert_eq!(
                header(&headers, "idempotency-key"),
                target.idempotency_key.as_deref(),
                "{what}"
            );
            // The body changes exactly when it carries a key the mode rewrites, and then
            // carries the upstream form (or nothing) in place of the client's key.
            let raw = c.upstream_key == UpstreamKey::Raw;
            assert_eq!(bytes != body.as_bytes(), in_body && !raw, "{what}");
            if bytes != body.as_bytes() {
                rewritten += 1;
                let text = String::from_utf8_lossy(&bytes);
                assert!(!text.contains("raw-k1"), "{what}");
                if let Some(v) = &target.idempotency_key {
                    assert!(text.contains(v.as_str()), "{what}");
                }
                assert_eq!(
                    header(&headers, "content-length"),
                    Some(bytes.len().to_string().as_str())
                );
            }
        }
    }
    assert_eq!(rewritten, 8);
}

#[test]
fn a_signed_dispatch_carries_the_ledgers_headers_as_given() {
    let mut call = Call::new(cfg());
    let asked = authorize_body(&send(&mut call, hosted(&["\"k1\""], PAY), PAY));
    let answer = signed(&call, dispatch());
    let AuthorizeResponse::Dispatch {
        signature: Some(sig),
        ..
    } = &answer
    else {
        panic!("{answer:?}")
    };
    let sig = sig.clone();
    let s = call.on_ledger_reply(&ledger(&answer));
    let (_, headers) = sent(PAY, &s);
    assert_eq!(
        header(&headers, "signature-input"),
        Some(sig.signature_input.as_str())
    );
    assert_eq!(header(&headers, "signature"), Some(sig.signature.as_str()));
    let input =
        signature::SignatureInput::parse(&sig.signature_input).unwrap_or_else(|e| panic!("{e:?}"));
    assert_eq!(
        input.components,
        [
            "@method",
            "@authority",
            "@path",
            "content-digest",
            "idempotency-key"
        ]
    );
    assert_eq!(
        input.string("nonce"),
        Some("att_1/1/pmt_1/pay_invoice"),
        "{asked:?}"
    );
    assert_eq!(counts(&s), vec![Stat::Dispatched]);
    assert!(enqueued(&s).is_empty());
    assert_eq!(call.state_name(), "dispatched");
}

#[test]
fn replays_and_denials_carry_no_signature_and_send_nothing() {
    let answers = [
        AuthorizeResponse::Replay {
            attempt_id: "att_0".into(),
            receipt: RECEIPT.into(),
            limits: None,
        },
        AuthorizeResponse::Deny(Denial::new(DenialCode::PermitMaxCallsExceeded, "cap")),
    ];
    for answer in answers {
        let mut call = Call::new(cfg());
        send(&mut call, hosted(&["\"k1\""], PAY), PAY);
        let s = call.on_ledger_reply(&ledger(&signed(&call, answer)));
        assert_eq!(s.flow, Flow::Pause);
        local_reply(&s);
        assert!(
            !s.effects.iter().any(|e| matches!(
                e,
                Effect::SetRequestHeader(..)
                    | Effect::RemoveRequestHeader(_)
                    | Effect::ReplaceRequestBody { .. }
                    | Effect::ResumeRequest
            )),
            "{s:?}"
        );
        assert!(local_reply(&s)
            .headers
            .iter()
            .all(|(n, _)| !signing::SIGNATURE_HEADERS.contains(&n.as_str())));
    }
}

/// An answer that cannot go out signed is a call never sent: the client is denied
/// `gateway_unavailable`, nothing is edited or resumed, and the round is reported released.
#[test]
fn a_dispatch_without_a_usable_signature_is_not_sent_and_released() {
    let sign = |call: &Call, edit: fn(&mut DispatchSignature)| {
        let mut answer = signed(call, dispatch());
        if let AuthorizeResponse::Dispatch {
            signature: Some(s), ..
        } = &mut answer
        {
            edit(s);
        }
        answer
    };
    // `None`: a Dispatch without any signature.
    let edits: [Option<fn(&mut DispatchSignature)>; 7] = [
        None,
        Some(|s| s.signature.clear()),
        Some(|s| s.signature_input.clear()),
        Some(|s| s.signature = "atmost=:AAAA:".into()),
        Some(|s| s.signature_input = s.signature_input.replace("\"idempotency-key\"", "")),
        Some(|s| s.signature_input = s.signature_input.replace("att_1/1/", "att_1/2/")),
        Some(|s| s.signature_input = format!("{}\r\nx-injected: 1", s.signature_input)),
    ];
    for edit in edits {
        let mut call = Call::new(cfg());
        send(&mut call, hosted(&["\"k1\""], PAY), PAY);
        let answer = edit.map_or_else(dispatch, |e| sign(&call, e));
        let s = call.on_ledger_reply(&ledger(&answer));
        assert_eq!(s.flow, Flow::Pause);
        assert_eq!(
            local_reply(&s).header("atmost-denial"),
            Some("gateway_unavailable")
        );
        assert!(
            !s.effects.iter().any(|e| matches!(
                e,
                Effect::SetRequestHeader(..)
                    | Effect::RemoveRequestHeader(_)
                    | Effect::ReplaceRequestBody { .. }
                    | Effect::ResumeRequest
            )),
            "{s:?}"
        );
        assert_eq!(
            enqueued(&s),
            vec![grant().report(Outcome::Released {
                reason: "never_sent: dispatch_unsigned".into()
            })]
        );
        let c = counts(&s);
        for stat in [
            Stat::GatewayUnavailable,
            Stat::Released,
            Stat::DispatchUnsigned,
        ] {
            assert!(c.contains(&stat), "{stat:?} {c:?}");
        }
        assert!(!c.contains(&Stat::Dispatched));
        assert_eq!(call.state_name(), "answered");
        assert!(!call.needs_log_props());
    }
}

/// A Dispatch whose signature is not even the two strings: the answer as a whole cannot be
/// read, but its round can still be reported never sent.
#[test]
fn a_dispatch_answer_with_an_unreadable_signature_is_released() {
    let mut call = Call::new(cfg());
    send(&mut call, hosted(&["\"k1\""], PAY), PAY);
    let body = br#"{"decision":"dispatch","attempt_id":"att_1","permit_id":"pmt_1","lease_ms":1,"round":1,"capability":"cap-1","signature":{"signature_input":7}}"#;
    let s = call.on_ledger_reply(&LedgerReply {
        status: Some(200),
        body: body.to_vec(),
    });
    assert_eq!(
        local_reply(&s).header("atmost-denial"),
        Some("gateway_unavailable")
    );
    assert!(!s.effects.contains(&Effect::ResumeRequest));
    assert_eq!(
        enqueued(&s),
        vec![grant().report(Outcome::Released {
            reason: "never_sent: dispatch_unreadable".into()
        })]
    );
}

#[test]
fn a_continuation_is_signed_for_its_own_round() {
    let body = r#"{"jsonrpc":"2.0","id":8,"method":"tools/call","params":{"name":"pay_invoice","arguments":{"invoice":"INV-1","amount":1250},"inputResponses":{"q":{"action":"accept","content":{}}},"requestState":"s1"}}"#;
    let mut call = Call::new(cfg());
    let asked = authorize_body(&send(&mut call, hosted(&["\"k1\""], body), body));
    assert!(asked.continuation);
    let target = target_of(&asked);
    assert_eq!(target.body_sha256, hex_sha256(body.as_bytes()));
    let mut answer = dispatch();
    if let AuthorizeResponse::Dispatch { round, .. } = &mut answer {
        *round = 2;
    }
    // Round 1's signature does not carry round 2.
    let round_one = signed(&call, dispatch());
    let mut stale = answer.clone();
    if let (
        AuthorizeResponse::Dispatch { signature, .. },
        AuthorizeResponse::Dispatch { signature: one, .. },
    ) = (&mut stale, &round_one)
    {
        signature.clone_from(one);
    }
    let mut again = Call::new(cfg());
    send(&mut again, hosted(&["\"k1\""], body), body);
    let s = again.on_ledger_reply(&ledger(&stale));
    assert!(counts(&s).contains(&Stat::DispatchUnsigned));
    let s = call.on_ledger_reply(&ledger(&signed(&call, answer)));
    assert_eq!(s.effects.last(), Some(&Effect::ResumeRequest));
    let (_, headers) = sent(body, &s);
    assert!(header(&headers, "signature-input").is_some_and(|v| v.contains("att_1/2/pmt_1/")));
}

#[test]
fn a_refused_signature_header_stops_the_dispatch_and_releases_it() {
    let mut call = Call::new(cfg());
    send(&mut call, hosted(&["\"k1\""], PAY), PAY);
    call.on_ledger_reply(&ledger(&signed(&call, dispatch())));
    // The adapter could not set one of the signature headers: nothing was resumed.
    let s = call.on_rewrite_failed();
    assert_eq!(
        enqueued(&s),
        vec![grant().report(Outcome::Released {
            reason: "never_sent: request_rewrite_failed".into()
        })]
    );
}

/// A client's own `Signature`, `Signature-Input` and `Content-Digest` never go upstream:
/// removed from every request before anything of it leaves, in both hold modes, so
/// whatever an upstream receives under these names is the ledger's.
#[test]
fn a_clients_signature_headers_are_removed_from_every_request() {
    let head = |method: &str| {
        RequestHead::from_headers(
            [
                (":method", method),
                (":path", "/mcp"),
                ("Signature", "atmost=:AAAA:"),
                ("signature-input", "atmost=();created=1"),
                ("Content-Digest", "sha-256=:AAAA:"),
                ("signature", "again=:AAAA:"),
                ("content-type", "application/json"),
            ],
            "atmost-permit",
            method != "POST",
        )
    };
    let removed: Vec<Effect> = ["signature", "signature-input", "content-digest"]
        .into_iter()
        .map(|h| Effect::RemoveRequestHeader(h.into()))
        .collect();
    assert_eq!(
        head("POST").signature_headers,
        vec!["signature", "signature-input", "content-digest"]
    );
    for hold in ["headers", "body"] {
        for method in ["POST", "GET", "DELETE"] {
            let mut call = Call::new(cfg_with(json!({ "request_hold": hold })));
            let s = call.on_request_headers(head(method));
            for r in &removed {
                assert!(s.effects.contains(r), "{hold} {method}: {s:?}");
            }
        }
    }
    // Their `_` spellings are refused, as for every header atmost reads or writes.
    for alias in ["signature_input", "content_digest"] {
        let head = RequestHead::from_headers([(":method", "POST"), (alias, "x")], "p", false);
        assert_eq!(head.alias.as_deref(), Some(alias));
    }
}
