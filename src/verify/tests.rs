//! The verifier as a tool's operator sees it: which calls reach the tool, which are refused
//! with which code and status. Requests are signed here with the same crate and the
//! protocol's one signature-base builder, as the ledger signs.

use super::*;
use crate::call::reply::LocalReply;
use crate::call::{BodyStep, Flow};
use atmost_config::{PluginConfig, VerifyConfig};
use atmost_protocol::signature::{
    content_digest_of, signature_header, DispatchNonce, Jwk, SignatureParams, SignedRequest,
};
use ed25519_compact::{KeyPair, Seed};
use replay::MemorySlots;
use serde_json::json;

const NOW_S: u64 = 1_764_680_000;
const NOW_MS: u64 = NOW_S * 1000;
const AUTHORITY: &str = "tool.example:8000";
const PAY: &str = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"pay_invoice","arguments":{"amount":5}}}"#;

struct Signer {
    pair: KeyPair,
    kid: String,
}

impl Signer {
    fn new(seed: u8) -> Signer {
        let pair = KeyPair::from_seed(Seed::new([seed; 32]));
        let kid = Jwk::ed25519(pair.pk.as_ref()).kid;
        Signer { pair, kid }
    }

    fn jwk(&self) -> serde_json::Value {
        serde_json::to_value(Jwk::ed25519(self.pair.pk.as_ref())).unwrap_or_default()
    }
}

/// An edit of the signature input before signing.
type Edit = fn(&mut SignatureInput);

/// One request as the gateway would send it, and how to sign it.
#[derive(Clone)]
struct Req {
    body: String,
    key: Option<String>,
    path: String,
    authority: String,
    created: u64,
    expires: u64,
    nonce: String,
    /// Extra or replacing header lines, after signing.
    extra: Vec<(String, String)>,
    /// Edits of the signature input before signing (a form the ledger does not write).
    edit: Edit,
    /// The body sent, when it differs from the one signed.
    sent_body: Option<String>,
}

use atmost_protocol::signature::SignatureInput;

fn nonce(round: u32, tool: &str) -> String {
    DispatchNonce {
        attempt_id: "att_01".into(),
        round,
        permit_id: "pmt_01".into(),
        tool: tool.into(),
    }
    .encode()
}

fn req() -> Req {
    Req {
        body: PAY.into(),
        key: None,
        path: "/mcp".into(),
        authority: AUTHORITY.into(),
        created: NOW_S - 1,
        expires: NOW_S + 30,
        nonce: nonce(1, "pay_invoice"),
        extra: Vec::new(),
        edit: |_| {},
        sent_body: None,
    }
}

impl Req {
    /// The header lines of the request, signed by `signer`.
    fn headers(&self, signer: &Signer) -> Vec<(String, Vec<u8>)> {
        let digest = content_digest_of(self.body.as_bytes());
        let request = SignedRequest {
            method: "POST",
            authority: &self.authority.to_ascii_lowercase(),
            path: self.path.split('?').next().unwrap_or_default(),
            content_digest: &digest,
            idempotency_key: self.key.as_deref(),
        };
        let mut input = request.signature_params(&SignatureParams {
            created: self.created,
            expires: self.expires,
            keyid: signer.kid.clone(),
            nonce: self.nonce.clone(),
        });
        (self.edit)(&mut input);
        let base = request.signature_base(&input).unwrap_or_default();
        let signature = signer.pair.sk.sign(base.as_bytes(), None);
        let mut headers: Vec<(String, String)> = vec![
            (":method".into(), "POST".into()),
            (":path".into(), self.path.clone()),
            (":authority".into(), self.authority.clone()),
            ("content-type".into(), "application/json".into()),
            ("content-digest".into(), digest),
            ("signature-input".into(), input.header_value()),
            ("signature".into(), signature_header(signature.as_ref())),
        ];
        if let Some(k) = &self.key {
            headers.push(("idempotency-key".into(), k.clone()));
        }
        for (name, _) in &self.extra {
            headers.retain(|(n, _)| n != name);
        }
        headers.extend(self.extra.iter().cloned());
        headers
            .into_iter()
            .filter(|(_, v)| !v.is_empty())
            .map(|(n, v)| (n, v.into_bytes()))
            .collect()
    }
}

/// A verifier's configuration; it serves [`AUTHORITY`] unless `verify.authorities` says.
fn config(mut v: serde_json::Value) -> Rc<VerifyConfig> {
    if v["verify"].get("authorities").is_none() {
        v["verify"]["authorities"] = json!([AUTHORITY]);
    }
    match PluginConfig::parse(v.to_string().as_bytes()) {
        Ok(PluginConfig::Verify(c)) => Rc::new(c),
        other => panic!("{other:?}"),
    }
}

/// A verifier trusting `trusted` inline, with `governed_tools: ["pay_invoice"]`.
fn inline(trusted: &[&Signer]) -> Rc<VerifyConfig> {
    let keys: Vec<_> = trusted.iter().map(|s| s.jwk()).collect();
    config(json!({
        "role": "verify",
        "verify": {"keys": {"keys": keys}},
        "governed_tools": ["pay_invoice"],
        "denial_format": "error",
        "max_body_bytes": 4096
    }))
}

struct Tool {
    verifier: Verifier,
    store: MemorySlots,
    next_context: u32,
    /// What the last request's headers were answered, when its body was read.
    headers_flow: Option<Flow>,
}

impl Tool {
    fn new(config: Rc<VerifyConfig>) -> Tool {
        let verifier = Verifier::new(config);
        let mut store = MemorySlots::default();
        verifier.cache().create_slots(&mut store);
        Tool {
            verifier,
            store,
            next_context: 1,
            headers_flow: None,
        }
    }

    /// Sends one request through a fresh machine; returns the verdict of its body (or of
    /// its headers, when they decided).
    fn send_at(&mut self, headers: &[(String, Vec<u8>)], body: &str, now_ms: u64) -> Verdict {
        self.next_context += 1;
        let mut call = VerifyCall::new(Rc::clone(self.verifier.config()));
        let head = RequestHead::from_headers(headers.iter().cloned(), "", body.is_empty());
        let step = call.on_request_headers(head, SignedHead::from_headers(headers.iter().cloned()));
        if call.state_name() != "reading_body" {
            return Verdict::Now(step);
        }
        self.headers_flow = Some(step.flow);
        match call.on_request_body(body.len(), true) {
            BodyStep::Read { .. } => {}
            BodyStep::Done(step) => return Verdict::Now(step),
        }
        call.on_request_body_data(
            body.as_bytes(),
            &mut self.verifier,
            self.next_context,
            now_ms,
            &mut self.store,
        )
    }

    fn send(&mut self, r: &Req, signer: &Signer) -> Verdict {
        let body = r.sent_body.clone().unwrap_or_else(|| r.body.clone());
        self.send_at(&r.headers(signer), &body, NOW_MS)
    }
}

fn step_reply(step: &Step) -> Option<&LocalReply> {
    step.effects.iter().find_map(|e| match e {
        Effect::LocalReply(r) => Some(r),
        _ => None,
    })
}

/// The step of a verdict that was decided at once.
fn now(v: Verdict) -> Step {
    match v {
        Verdict::Now(step) => step,
        other => panic!("expected a decision, got {other:?}"),
    }
}

fn passes(v: Verdict) {
    let step = now(v);
    assert_eq!(step.flow, Flow::Continue, "{step:?}");
    assert!(step_reply(&step).is_none(), "{step:?}");
}

fn verified(v: Verdict) {
    let step = now(v);
    assert_eq!(step.flow, Flow::Continue, "{step:?}");
    assert!(
        step.effects.contains(&Effect::Count(Stat::Verified)),
        "{step:?}"
    );
}

/// The refusal's HTTP status and denial code; checks the counters and the JSON-RPC body.
fn refused(v: Verdict) -> (u32, String) {
    let step = now(v);
    assert_eq!(step.flow, Flow::Pause);
    let reply = step_reply(&step)
        .unwrap_or_else(|| panic!("no reply: {step:?}"))
        .clone();
    let code = reply
        .header("atmost-denial")
        .unwrap_or_default()
        .to_string();
    let body = reply.body_json().unwrap_or_default();
    let denial = DenialCode::from_wire(&code).unwrap_or_else(|| panic!("{code}"));
    assert!(step.effects.contains(&Effect::Count(Stat::Denied)));
    assert!(step
        .effects
        .contains(&Effect::Count(Stat::DeniedCode(denial))));
    assert_eq!(body["error"]["code"], denial.json_rpc_code(), "{body}");
    assert_eq!(body["error"]["data"]["code"], code.as_str());
    assert_eq!(body["id"], 7);
    assert_eq!(reply.status, http_status(denial));
    (reply.status, code)
}

#[test]
fn a_call_signed_by_a_trusted_key_reaches_the_tool_once() {
    let s = Signer::new(1);
    let mut tool = Tool::new(inline(&[&s]));
    verified(tool.send(&req(), &s));
    // The same signed request again: a replay.
    assert_eq!(
        refused(tool.send(&req(), &s)),
        (409, "signature_replayed".into())
    );
    // The next round of the same attempt is another dispatch.
    verified(tool.send(
        &Req {
            nonce: nonce(2, "pay_invoice"),
            ..req()
        },
        &s,
    ));
}

#[test]
fn the_forwarded_key_is_covered_whenever_the_request_carries_one() {
    let s = Signer::new(1);
    let mut tool = Tool::new(inline(&[&s]));
    let keyed = Req {
        key: Some("a1b2".into()),
        ..req()
    };
    verified(tool.send(&keyed, &s));
    // A key header added to a request signed without one: the signature does not cover it.
    let added = Req {
        nonce: nonce(3, "pay_invoice"),
        extra: vec![("idempotency-key".into(), "other".into())],
        ..req()
    };
    assert_eq!(refused(tool.send(&added, &s)).1, "signature_malformed");
    // The key changed on the way: the signature no longer verifies.
    let changed = Req {
        nonce: nonce(4, "pay_invoice"),
        key: Some("a1b2".into()),
        extra: vec![("idempotency-key".into(), "a1b3".into())],
        ..req()
    };
    assert_eq!(
        refused(tool.send(&changed, &s)),
        (403, "signature_invalid".into())
    );
}

#[test]
fn without_a_signature_a_governed_call_is_refused() {
    let s = Signer::new(1);
    let mut tool = Tool::new(inline(&[&s]));
    let unsigned = Req {
        extra: vec![
            ("signature-input".into(), String::new()),
            ("signature".into(), String::new()),
        ],
        ..req()
    };
    assert_eq!(
        refused(tool.send(&unsigned, &s)),
        (403, "signature_missing".into())
    );
    // Another label's signature is no `atmost` signature.
    let other_label = Req {
        extra: vec![
            (
                "signature-input".into(),
                "sig1=(\"@method\");created=1".into(),
            ),
            ("signature".into(), "sig1=:AAAA:".into()),
        ],
        ..req()
    };
    assert_eq!(refused(tool.send(&other_label, &s)).1, "signature_missing");
    // Only one of the two headers.
    let half = Req {
        extra: vec![("signature".into(), String::new())],
        ..req()
    };
    assert_eq!(refused(tool.send(&half, &s)).1, "signature_missing");
}

#[test]
fn a_signature_of_another_form_is_malformed() {
    let s = Signer::new(1);
    let edits: [(&str, Edit); 8] = [
        ("a private parameter", |i| {
            i.params.push(("x-extra".into(), Param::String("1".into())))
        }),
        ("another tag", |i| {
            set(i, "tag", Param::String("other".into()))
        }),
        ("another alg", |i| {
            set(i, "alg", Param::String("rsa-pss-sha512".into()))
        }),
        ("no tag", |i| i.params.retain(|(n, _)| n != "tag")),
        ("no keyid", |i| i.params.retain(|(n, _)| n != "keyid")),
        ("content-digest not covered", |i| {
            i.components.retain(|c| c != "content-digest")
        }),
        ("@authority not covered", |i| {
            i.components.retain(|c| c != "@authority")
        }),
        ("a component the request lacks", |i| {
            i.components.push("@query".into())
        }),
    ];
    for (what, edit) in edits {
        let mut tool = Tool::new(inline(&[&s]));
        let r = Req { edit, ..req() };
        assert_eq!(
            refused(tool.send(&r, &s)),
            (400, "signature_malformed".into()),
            "{what}"
        );
    }
    // Without `alg` the form is still the ledger's (the parameter is optional in RFC 9421).
    let mut tool = Tool::new(inline(&[&s]));
    verified(tool.send(
        &Req {
            edit: |i| i.params.retain(|(n, _)| n != "alg"),
            ..req()
        },
        &s,
    ));
    let others = [
        Req {
            nonce: "not-our-form".into(),
            ..req()
        },
        Req {
            expires: NOW_S + 300,
            created: NOW_S - 1,
            ..req()
        },
        Req {
            expires: NOW_S - 1,
            created: NOW_S - 1,
            ..req()
        },
        Req {
            extra: vec![("content-digest".into(), String::new())],
            ..req()
        },
        Req {
            extra: vec![("content-digest".into(), "sha-512=:AAAA:".into())],
            ..req()
        },
        Req {
            extra: vec![("signature".into(), "atmost=:AAAA:".into())],
            ..req()
        },
        Req {
            extra: vec![("signature-input".into(), "atmost=(\"@method\"".into())],
            ..req()
        },
    ];
    for r in others {
        let mut tool = Tool::new(inline(&[&s]));
        assert_eq!(
            refused(tool.send(&r, &s)).1,
            "signature_malformed",
            "{:?}",
            r.extra
        );
    }
}

use atmost_protocol::signature::Param;

fn set(input: &mut SignatureInput, name: &str, value: Param) {
    for (n, v) in input.params.iter_mut() {
        if n == name {
            *v = value.clone();
        }
    }
}

#[test]
fn an_unknown_key_is_refused_without_a_key_set_to_fetch() {
    let trusted = Signer::new(1);
    let stranger = Signer::new(2);
    let mut tool = Tool::new(inline(&[&trusted]));
    assert_eq!(
        refused(tool.send(&req(), &stranger)),
        (403, "signature_key_unknown".into())
    );
}

#[test]
fn a_signature_outside_its_window_is_refused_beyond_the_skew() {
    let s = Signer::new(1);
    let mut tool = Tool::new(inline(&[&s]));
    let expired = Req {
        created: NOW_S - 60,
        expires: NOW_S - 6,
        ..req()
    };
    assert_eq!(
        refused(tool.send(&expired, &s)),
        (403, "signature_outside_validity".into())
    );
    let future = Req {
        created: NOW_S + 6,
        expires: NOW_S + 30,
        ..req()
    };
    assert_eq!(
        refused(tool.send(&future, &s)).1,
        "signature_outside_validity"
    );
    // Within the default 5 s of skew, either way.
    verified(tool.send(
        &Req {
            created: NOW_S - 60,
            expires: NOW_S - 5,
            ..req()
        },
        &s,
    ));
    let ahead = Req {
        created: NOW_S + 5,
        expires: NOW_S + 30,
        nonce: nonce(2, "pay_invoice"),
        ..req()
    };
    verified(tool.send(&ahead, &s));
}

#[test]
fn a_changed_body_no_longer_matches_its_digest() {
    let s = Signer::new(1);
    let mut tool = Tool::new(inline(&[&s]));
    let changed = Req {
        sent_body: Some(PAY.replace("\"amount\":5", "\"amount\":500")),
        ..req()
    };
    assert_eq!(
        refused(tool.send(&changed, &s)),
        (400, "content_digest_mismatch".into())
    );
    // Body and digest both changed: the signature no longer verifies.
    let new_body = PAY.replace("\"amount\":5", "\"amount\":500");
    let both = Req {
        extra: vec![(
            "content-digest".into(),
            content_digest_of(new_body.as_bytes()),
        )],
        sent_body: Some(new_body),
        ..req()
    };
    assert_eq!(refused(tool.send(&both, &s)).1, "signature_invalid");
}

#[test]
fn a_signature_by_another_key_or_over_another_request_does_not_verify() {
    let trusted = Signer::new(1);
    let forger = Signer::new(2);
    let mut tool = Tool::new(inline(&[&trusted]));
    // The forger names the trusted key.
    let forged = Signer {
        pair: KeyPair::from_seed(Seed::new([2; 32])),
        kid: trusted.kid.clone(),
    };
    assert_eq!(
        refused(tool.send(&req(), &forged)),
        (403, "signature_invalid".into())
    );
    drop(forger);
    // Signed for another path than the one received.
    let mut elsewhere = req().headers(&trusted);
    for (n, v) in elsewhere.iter_mut() {
        if n == ":path" {
            *v = b"/other".to_vec();
        }
    }
    assert_eq!(
        refused(tool.send_at(&elsewhere, PAY, NOW_MS)).1,
        "signature_invalid"
    );
    // The nonce names another tool than the body's.
    let other_tool = Req {
        nonce: nonce(1, "refund"),
        ..req()
    };
    assert_eq!(
        refused(tool.send(&other_tool, &trusted)).1,
        "signature_invalid"
    );
}

#[test]
fn what_the_signature_does_not_cover_may_differ() {
    let s = Signer::new(1);
    let mut tool = Tool::new(inline(&[&s]));
    // The query, the authority's letter case, other signatures beside ours.
    let mut headers = Req {
        path: "/mcp?session=1".into(),
        ..req()
    }
    .headers(&s);
    for (n, v) in headers.iter_mut() {
        if n == ":authority" {
            *v = b"TOOL.example:8000".to_vec();
        }
    }
    headers.push((
        "signature-input".into(),
        b"proxy=(\"@method\");created=1".to_vec(),
    ));
    headers.push(("signature".into(), b"proxy=:AAAA:".to_vec()));
    verified(tool.send_at(&headers, PAY, NOW_MS));
}

#[test]
fn a_full_replay_cache_refuses_rather_than_forgets() {
    let s = Signer::new(1);
    let mut tool = Tool::new(config(json!({
        "role": "verify",
        "verify": {"keys": {"keys": [s.jwk()]}, "replay_cache_entries": 32},
        "governed_tools": ["pay_invoice"],
        "denial_format": "error"
    })));
    for round in 1..=32 {
        verified(tool.send(
            &Req {
                nonce: nonce(round, "pay_invoice"),
                ..req()
            },
            &s,
        ));
    }
    assert_eq!(
        refused(tool.send(
            &Req {
                nonce: nonce(33, "pay_invoice"),
                ..req()
            },
            &s
        )),
        (503, "replay_cache_unavailable".into())
    );
    // Once those signatures expire (plus the skew), there is room again.
    let later = Req {
        nonce: nonce(33, "pay_invoice"),
        created: NOW_S + 36,
        expires: NOW_S + 60,
        ..req()
    };
    verified(tool.send_at(&later.headers(&s), PAY, NOW_MS + 36_000));
}

#[test]
fn traffic_that_is_not_a_governed_call_passes_untouched() {
    let s = Signer::new(1);
    let mut tool = Tool::new(inline(&[&s]));
    let unsigned = |_: &str| {
        vec![
            (":method".to_string(), b"POST".to_vec()),
            (":path".to_string(), b"/mcp".to_vec()),
            ("content-type".to_string(), b"application/json".to_vec()),
        ]
    };
    for body in [
        r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}"#,
        r#"{"jsonrpc":"2.0","id":2,"method":"tools/list"}"#,
        r#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#,
        r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"search","arguments":{}}}"#,
        r#"{"jsonrpc":"2.0","id":4,"result":{}}"#,
    ] {
        let v = tool.send_at(&unsigned(body), body, NOW_MS);
        let step = now(v);
        assert_eq!(step, Step::cont(), "{body}");
    }
    let get = vec![(":method".to_string(), b"GET".to_vec())];
    passes(tool.send_at(&get, "", NOW_MS));
}

#[test]
fn a_body_the_gateway_refuses_is_refused_alike() {
    let s = Signer::new(1);
    let mut tool = Tool::new(inline(&[&s]));
    let bad = |headers: Vec<(String, Vec<u8>)>, body: &str, tool: &mut Tool| {
        let step = now(tool.send_at(&headers, body, NOW_MS));
        let reply = step_reply(&step)
            .cloned()
            .unwrap_or_else(|| panic!("{step:?}"));
        assert!(step.effects.contains(&Effect::Count(Stat::BadRequest)));
        (
            reply.status,
            reply.body_json().unwrap_or_default()["error"]["code"].clone(),
        )
    };
    let signed = req().headers(&s);
    assert_eq!(bad(signed.clone(), "{", &mut tool), (400, json!(-32700)));
    let batch = format!("[{PAY}]");
    assert_eq!(bad(signed.clone(), &batch, &mut tool), (400, json!(-32600)));
    let mut alias = signed.clone();
    alias.push(("idempotency_key".into(), b"k".to_vec()));
    assert_eq!(bad(alias, PAY, &mut tool), (400, json!(-32600)));
    let mut encoded = signed.clone();
    encoded.push(("content-encoding".into(), b"gzip".to_vec()));
    assert_eq!(bad(encoded, PAY, &mut tool), (400, json!(-32600)));
    let mut large = signed;
    large.push(("content-length".into(), b"5000".to_vec()));
    assert_eq!(bad(large, PAY, &mut tool), (413, json!(-32600)));
}

fn fetched(trusted: &[&Signer]) -> Rc<VerifyConfig> {
    let keys: Vec<_> = trusted.iter().map(|s| s.jwk()).collect();
    config(json!({
        "role": "verify",
        "verify": {"keys": {"keys": keys}, "jwks": {"cluster": "atmost_ledger"}},
        "governed_tools": ["pay_invoice"],
        "denial_format": "error"
    }))
}

fn jwks(signers: &[&Signer]) -> Vec<u8> {
    let keys: Vec<_> = signers.iter().map(|s| s.jwk()).collect();
    json!({ "keys": keys }).to_string().into_bytes()
}

#[test]
fn an_unknown_keyid_waits_for_one_fetch_of_the_key_set() {
    let old = Signer::new(1);
    let new = Signer::new(2);
    let mut tool = Tool::new(fetched(&[]));
    // The timed fetch at start brings the old key.
    assert!(tool.verifier.begin_refresh(NOW_MS - 10_000));
    let (stat, done) = tool
        .verifier
        .on_keys(Some(&jwks(&[&old])), NOW_MS - 9_990, &mut tool.store);
    assert_eq!((stat, done.len()), (Stat::KeysRefreshed, 0));
    verified(tool.send(&req(), &old));
    // The ledger rotated: the first call with the new keyid asks for a fetch, the next waits.
    let first = Req {
        nonce: nonce(2, "pay_invoice"),
        ..req()
    };
    let second = Req {
        nonce: nonce(3, "pay_invoice"),
        ..req()
    };
    assert_eq!(tool.send(&first, &new), Verdict::Wait { ring: true });
    let first_context = tool.next_context;
    assert_eq!(tool.send(&second, &new), Verdict::Wait { ring: false });
    assert_eq!(tool.verifier.waiting(), 2);
    assert!(tool.verifier.begin_refresh(NOW_MS + 1));
    assert!(
        !tool.verifier.begin_refresh(NOW_MS + 2),
        "one fetch at a time"
    );
    let (stat, done) =
        tool.verifier
            .on_keys(Some(&jwks(&[&old, &new])), NOW_MS + 20, &mut tool.store);
    assert_eq!(stat, Stat::KeysRefreshed);
    assert_eq!(done.len(), 2);
    assert_eq!(done[0].0, first_context);
    for (_, step) in done {
        verified(Verdict::Now(step));
    }
    assert_eq!(tool.verifier.waiting(), 0);
    // A keyid the fetched set lacks is refused after the fetch.
    let stranger = Signer::new(3);
    let mut tool = Tool::new(fetched(&[]));
    assert_eq!(tool.send(&req(), &stranger), Verdict::Wait { ring: true });
    assert!(tool.verifier.begin_refresh(NOW_MS));
    let (_, done) = tool
        .verifier
        .on_keys(Some(&jwks(&[&old])), NOW_MS + 5, &mut tool.store);
    assert_eq!(
        refused(Verdict::Now(done[0].1.clone())).1,
        "signature_key_unknown"
    );
    // And at once while the last fetch is less than a second old.
    assert_eq!(
        refused(tool.send(&req(), &stranger)).1,
        "signature_key_unknown"
    );
}

#[test]
fn a_failed_fetch_refuses_the_waiting_calls_and_keeps_the_last_keys() {
    let old = Signer::new(1);
    let new = Signer::new(2);
    let mut tool = Tool::new(fetched(&[]));
    assert!(tool.verifier.begin_refresh(NOW_MS - 10_000));
    tool.verifier
        .on_keys(Some(&jwks(&[&old])), NOW_MS - 10_000, &mut tool.store);
    assert_eq!(tool.send(&req(), &new), Verdict::Wait { ring: true });
    assert!(tool.verifier.begin_refresh(NOW_MS));
    let (stat, done) = tool.verifier.on_keys(None, NOW_MS + 1000, &mut tool.store);
    assert_eq!(stat, Stat::KeysRefreshFailed);
    assert_eq!(
        refused(Verdict::Now(done[0].1.clone())).1,
        "signature_key_unknown"
    );
    assert_eq!(tool.verifier.fetched_keys(), 1);
    let (stat, _) = tool
        .verifier
        .on_keys(Some(b"<html>"), NOW_MS + 2000, &mut tool.store);
    assert_eq!(stat, Stat::KeysRefreshFailed);
    verified(tool.send_at(&req().headers(&old), PAY, NOW_MS + 2000));
}

#[test]
fn a_call_that_waited_past_its_expiry_is_refused_and_a_gone_one_forgotten() {
    let s = Signer::new(1);
    let mut tool = Tool::new(fetched(&[]));
    let short = Req {
        expires: NOW_S + 1,
        ..req()
    };
    assert_eq!(tool.send(&short, &s), Verdict::Wait { ring: true });
    let gone = Req {
        nonce: nonce(2, "pay_invoice"),
        ..req()
    };
    assert_eq!(tool.send(&gone, &s), Verdict::Wait { ring: false });
    tool.verifier.forget(tool.next_context);
    assert!(tool.verifier.begin_refresh(NOW_MS));
    let (_, done) = tool
        .verifier
        .on_keys(Some(&jwks(&[&s])), NOW_MS + 7_000, &mut tool.store);
    assert_eq!(done.len(), 1);
    assert_eq!(
        refused(Verdict::Now(done[0].1.clone())).1,
        "signature_outside_validity"
    );
}

#[test]
fn refusals_render_in_the_result_format_too() {
    let s = Signer::new(1);
    let mut tool = Tool::new(config(json!({
        "role": "verify",
        "verify": {"keys": {"keys": [s.jwk()]}}
    })));
    let step = now(tool.send(
        &Req {
            extra: vec![("signature".into(), String::new())],
            ..req()
        },
        &s,
    ));
    let reply = step_reply(&step)
        .cloned()
        .unwrap_or_else(|| panic!("{step:?}"));
    assert_eq!(reply.status, 403);
    let body = reply.body_json().unwrap_or_default();
    assert_eq!(body["result"]["isError"], true);
    assert_eq!(
        body["result"]["structuredContent"]["error"]["code"],
        "signature_missing"
    );
}

#[test]
fn every_verifier_code_has_a_refusal_status() {
    for code in [
        DenialCode::SignatureMissing,
        DenialCode::SignatureMalformed,
        DenialCode::SignatureKeyUnknown,
        DenialCode::SignatureOutsideValidity,
        DenialCode::ContentDigestMismatch,
        DenialCode::SignatureInvalid,
        DenialCode::SignatureReplayed,
        DenialCode::ReplayCacheUnavailable,
    ] {
        assert!((400..600).contains(&http_status(code)), "{code}");
    }
}

#[test]
fn with_request_hold_body_the_headers_go_on_and_the_body_waits_for_the_check() {
    let s = Signer::new(1);
    let hold = |mode: &str| {
        config(json!({
            "role": "verify",
            "request_hold": mode,
            "verify": {"keys": {"keys": [s.jwk()]}},
            "governed_tools": ["pay_invoice"],
            "denial_format": "error"
        }))
    };
    let mut tool = Tool::new(hold("body"));
    verified(tool.send(&req(), &s));
    assert_eq!(tool.headers_flow, Some(Flow::Continue));
    assert_eq!(refused(tool.send(&req(), &s)).1, "signature_replayed");
    let mut tool = Tool::new(hold("headers"));
    verified(tool.send(&req(), &s));
    assert_eq!(tool.headers_flow, Some(Flow::Pause));
}

#[test]
fn an_upgrade_is_refused_unless_its_route_is_listed_even_signed() {
    let s = Signer::new(1);
    for hold in ["headers", "body"] {
        let c = config(json!({
            "role": "verify",
            "request_hold": hold,
            "verify": {"keys": {"keys": [s.jwk()]}},
            "upgrade_routes": ["chat-ws"]
        }));
        let websocket = |route: Option<&str>| {
            let mut call = VerifyCall::new(Rc::clone(&c));
            let mut headers = req().headers(&s);
            headers.push(("upgrade".into(), b"websocket".to_vec()));
            let mut head = RequestHead::from_headers(headers.iter().cloned(), "", false);
            head.route = route.map(str::to_string);
            let step = call.on_request_headers(head, SignedHead::from_headers(headers));
            (step, call.state_name())
        };
        // A signature does not make the upgraded bytes verified: refused before the tool.
        for route in [Some("mcp"), None] {
            let (step, state) = websocket(route);
            let reply = step_reply(&step)
                .cloned()
                .unwrap_or_else(|| panic!("{step:?}"));
            assert_eq!((reply.status, state), (400, "done"), "{hold} {route:?}");
            assert_eq!(
                reply.body_json().unwrap_or_default()["error"]["code"],
                json!(-32600)
            );
            assert!(step.effects.contains(&Effect::Count(Stat::UpgradeRefused)));
        }
        // The listed route lets it through, unread.
        let (step, state) = websocket(Some("chat-ws"));
        assert_eq!((step, state), (Step::cont(), "passing"), "{hold}");
    }
}

/// [`inline`], serving `authorities`.
fn serving(trusted: &Signer, authorities: &[&str]) -> Tool {
    Tool::new(config(json!({
        "role": "verify",
        "verify": {"keys": {"keys": [trusted.jwk()]}, "authorities": authorities},
        "governed_tools": ["pay_invoice"],
        "denial_format": "error"
    })))
}

#[test]
fn a_signature_made_for_another_server_is_refused_whatever_authority_it_arrives_with() {
    let s = Signer::new(1);
    // Signed for `other.example:8000`, and sent on as it was signed.
    let theirs = Req {
        authority: "other.example:8000".into(),
        ..req()
    };
    let headers = theirs.headers(&s);
    // At a verifier serving tool.example:8000 it is refused, with its own Host or with
    // this server's: the signature names the other server.
    let mut here = serving(&s, &[AUTHORITY]);
    assert_eq!(
        refused(here.send_at(&headers, PAY, NOW_MS)),
        (403, "signature_invalid".into())
    );
    let mut as_ours = headers.clone();
    for (n, v) in as_ours.iter_mut() {
        if n == ":authority" {
            *v = AUTHORITY.as_bytes().to_vec();
        }
    }
    assert_eq!(
        refused(here.send_at(&as_ours, PAY, NOW_MS)).1,
        "signature_invalid"
    );
    // The control: the same signature at a verifier serving the name it was made for.
    let mut there = serving(&s, &["other.example:8000"]);
    verified(there.send_at(&headers, PAY, NOW_MS));
}

#[test]
fn a_rewritten_host_is_checked_against_each_name_served_and_a_named_one_alone() {
    let s = Signer::new(1);
    let names = [AUTHORITY, "tool.internal:8000"];
    // Signed for tool.internal, delivered with a host the route rewrote: one of the names.
    let signed_internal = Req {
        authority: "tool.internal:8000".into(),
        ..req()
    };
    let mut rewritten = signed_internal.headers(&s);
    for (n, v) in rewritten.iter_mut() {
        if n == ":authority" {
            *v = b"api.provider.example".to_vec();
        }
    }
    verified(serving(&s, &names).send_at(&rewritten, PAY, NOW_MS));
    // Delivered naming the other name this verifier serves: checked against that one only.
    let mut renamed = signed_internal.headers(&s);
    for (n, v) in renamed.iter_mut() {
        if n == ":authority" {
            *v = AUTHORITY.as_bytes().to_vec();
        }
    }
    assert_eq!(
        refused(serving(&s, &names).send_at(&renamed, PAY, NOW_MS)).1,
        "signature_invalid"
    );
}

/// The `atmost-tool-refusal` header of a refusal.
fn refusal_of(v: Verdict) -> ToolRefusal {
    let step = now(v);
    let reply = step_reply(&step).unwrap_or_else(|| panic!("no reply: {step:?}"));
    let value = reply
        .header(tool_refusal::HEADER)
        .unwrap_or_else(|| panic!("no refusal header: {reply:?}"));
    ToolRefusal::parse(value).unwrap_or_else(|| panic!("unreadable: {value}"))
}

const REFUSAL_KEY: &str = "verifier-refusal-key-0123456789abcdef";

fn mac_of(code: DenialCode, nonce: &str) -> String {
    let key =
        atmost_config::UpstreamSecret::new(REFUSAL_KEY.into()).unwrap_or_else(|| panic!("key"));
    tool_refusal::hex(&key.mac(&[&tool_refusal::mac_input(code, nonce)]))
}

#[test]
fn a_refusal_that_read_a_nonce_proves_it_with_the_refusal_key() {
    let trusted = Signer::new(1);
    let stranger = Signer::new(2);
    let keyed = |extra: serde_json::Value| {
        let mut v = json!({
            "role": "verify",
            "verify": {"keys": {"keys": [trusted.jwk()]}, "refusal_key": REFUSAL_KEY,
                       "replay_cache_entries": 32},
            "governed_tools": ["pay_invoice"],
            "denial_format": "error"
        });
        for (k, val) in extra.as_object().cloned().unwrap_or_default() {
            v["verify"][k] = val;
        }
        Tool::new(config(v))
    };
    let mut tool = keyed(json!({}));
    let at = |n: u32| Req {
        nonce: nonce(n, "pay_invoice"),
        ..req()
    };
    let expired = Req {
        created: NOW_S - 100,
        expires: NOW_S - 60,
        ..at(2)
    };
    let changed = Req {
        sent_body: Some(PAY.replace("5", "6")),
        ..at(3)
    };
    let cases = [
        (
            tool.send(&at(1), &stranger),
            DenialCode::SignatureKeyUnknown,
            1,
        ),
        (
            tool.send(&expired, &trusted),
            DenialCode::SignatureOutsideValidity,
            2,
        ),
        (
            tool.send(&changed, &trusted),
            DenialCode::ContentDigestMismatch,
            3,
        ),
    ];
    for (verdict, code, n) in cases {
        let r = refusal_of(verdict);
        assert_eq!(r.code, code);
        let proof = r.proof.unwrap_or_else(|| panic!("{code}: no proof"));
        assert_eq!(proof.nonce, nonce(n, "pay_invoice"));
        assert_eq!(proof.mac, mac_of(code, &proof.nonce), "{code}");
    }
    // A full replay cache proves its refusal too.
    for n in 10..42 {
        verified(tool.send(&at(n), &trusted));
    }
    let full = refusal_of(tool.send(&at(42), &trusted));
    assert_eq!(full.code, DenialCode::ReplayCacheUnavailable);
    assert!(full.proof.is_some());
    // No nonce read, no proof: the code alone.
    let unsigned = Req {
        extra: vec![
            ("signature-input".into(), String::new()),
            ("signature".into(), String::new()),
        ],
        ..req()
    };
    let bare = refusal_of(tool.send(&unsigned, &trusted));
    assert_eq!(
        (bare.code, bare.proof),
        (DenialCode::SignatureMissing, None)
    );
    // Without a refusal key, a refusal says its code and proves nothing.
    let mut unkeyed = Tool::new(inline(&[&trusted]));
    let plain = refusal_of(unkeyed.send(&at(1), &stranger));
    assert_eq!(
        (plain.code, plain.proof),
        (DenialCode::SignatureKeyUnknown, None)
    );
}
