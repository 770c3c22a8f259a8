//! The wire types' shapes, as both sides read and write them.

use super::*;
use serde_json::json;

/// Every row of a closed set goes on the wire as its name (`Display` writes `as_str`).
fn assert_serialized_as_names<T: serde::Serialize + std::fmt::Display>(rows: &[T]) {
    for row in rows {
        let json = serde_json::to_value(row).unwrap_or_default();
        assert_eq!(json, Value::String(row.to_string()));
    }
}

#[test]
fn denial_code_serializes_as_its_documented_name() {
    assert_serialized_as_names(&DenialCode::ALL);
}

#[test]
fn json_rpc_codes_are_unique_and_outside_the_reserved_range() {
    let mut seen = std::collections::HashSet::new();
    for code in DenialCode::ALL {
        let n = code.json_rpc_code();
        assert!(!(-32768..=-32000).contains(&n), "{code} uses reserved {n}");
        assert!(seen.insert(n), "{code} reuses {n}");
    }
}

#[test]
fn every_denial_code_has_its_row_in_the_readme_error_table() {
    let readme = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"));
    for code in DenialCode::ALL {
        let row = format!("| `{code}` | {} |", code.json_rpc_code());
        assert!(
            readme.lines().any(|l| l.starts_with(&row)),
            "README.md's error table has no row starting {row:?}"
        );
    }
}

#[test]
fn an_outcomes_kind_is_its_serde_tag() {
    let reason = || "r".to_string();
    for outcome in [
        Outcome::Completed { receipt: reason() },
        Outcome::Released { reason: reason() },
        Outcome::Uncertain { reason: reason() },
        Outcome::InputRequired { receipt: reason() },
        Outcome::Accepted { receipt: reason() },
        Outcome::RefusedAtTool {
            refusal: reason(),
            mac_verified: false,
        },
    ] {
        let json = serde_json::to_value(&outcome).unwrap_or_default();
        assert_eq!(json["outcome"], outcome.kind());
    }
}

#[test]
fn no_report_can_claim_its_refusal_verified() {
    let claimed = json!({"attempt_id": "att_1", "round": 1, "capability": "c",
        "outcome": "refused_at_tool", "refusal": "signature_key_unknown", "mac_verified": true});
    let report: OutcomeReport = serde_json::from_value(claimed).unwrap();
    assert_eq!(
        report.outcome,
        Outcome::RefusedAtTool {
            refusal: "signature_key_unknown".into(),
            mac_verified: false
        }
    );
    let sent = serde_json::to_value(&report).unwrap_or_default();
    assert!(sent.get("mac_verified").is_none(), "{sent}");
}

#[test]
fn acks_serialize_as_their_names() {
    assert_serialized_as_names(&OutcomeAck::ALL);
}

#[test]
fn authorize_response_is_tagged_by_decision() {
    let deny = AuthorizeResponse::Deny(
        Denial::new(DenialCode::PermitMaxCallsExceeded, "cap reached")
            .with("tool", "pay_invoice")
            .with("limit", 1)
            .with("calls_made", 1),
    );
    let json = serde_json::to_value(&deny).unwrap_or_default();
    assert_eq!(json["decision"], "deny");
    assert_eq!(json["code"], "permit_max_calls_exceeded");
    assert_eq!(json["data"]["limit"], 1);
    let back: AuthorizeResponse =
        serde_json::from_value(json).unwrap_or(AuthorizeResponse::Replay {
            attempt_id: String::new(),
            receipt: String::new(),
            limits: None,
        });
    assert_eq!(back, deny);
}

#[test]
fn outcome_report_flattens_the_outcome() {
    let report = OutcomeReport {
        attempt_id: "a1".into(),
        round: 2,
        capability: "c".into(),
        outcome: Outcome::Uncertain {
            reason: "upstream_reset".into(),
        },
    };
    let json = serde_json::to_value(&report).unwrap_or_default();
    assert_eq!(json["outcome"], "uncertain");
    assert_eq!(json["reason"], "upstream_reset");
    assert_eq!(json["attempt_id"], "a1");
    assert_eq!(json["round"], 2);
    assert_eq!(json["capability"], "c");
    for (outcome, tag) in [
        (
            Outcome::InputRequired {
                receipt: "r".into(),
            },
            "input_required",
        ),
        (
            Outcome::Accepted {
                receipt: "r".into(),
            },
            "accepted",
        ),
    ] {
        let json = serde_json::to_value(&outcome).unwrap_or_default();
        assert_eq!(json["outcome"], tag);
        assert_eq!(outcome.kind(), tag);
        assert_eq!(json["receipt"], "r");
    }
}

#[test]
fn continuation_defaults_to_false_and_is_omitted_when_false() {
    let v = serde_json::json!({"permit_token": "t", "tool": "x", "fingerprint": "f"});
    let r: Option<AuthorizeRequest> = serde_json::from_value(v).ok();
    assert_eq!(r.as_ref().map(|r| r.continuation), Some(false));
    let json = r.map(|r| serde_json::to_value(&r).unwrap_or_default());
    assert_eq!(json.as_ref().and_then(|j| j.get("continuation")), None);
}

#[test]
fn key_carriers_travel_as_names_in_table_order_and_are_left_out_when_empty() {
    let both: KeyCarriers = [KeyCarrier::IdempotencyKeyParam, KeyCarrier::Header]
        .into_iter()
        .collect();
    assert_eq!(
        serde_json::to_value(both).unwrap_or_default(),
        serde_json::json!(["header", "params.idempotencyKey"])
    );
    let read: Option<KeyCarriers> =
        serde_json::from_value(serde_json::json!(["params._meta", "header", "header"])).ok();
    assert_eq!(
        read.map(|c| c.iter().collect::<Vec<_>>()),
        Some(vec![KeyCarrier::Header, KeyCarrier::Meta])
    );
    assert!(serde_json::from_value::<KeyCarriers>(serde_json::json!(["body"])).is_err());
    assert_eq!(KeyCarriers::from_list(&both.to_list()), Ok(both));
    assert_eq!(KeyCarriers::from_list(""), Ok(KeyCarriers::NONE));
    assert!(KeyCarriers::from_list("header,cookie").is_err());

    let v = serde_json::json!({"permit_token": "t", "tool": "x", "fingerprint": "f",
                               "forwarded_key": "k"});
    let old: Option<AuthorizeRequest> = serde_json::from_value(v).ok();
    assert_eq!(
        old.as_ref().map(|r| r.forwarded_key_carriers),
        Some(KeyCarriers::NONE)
    );
    let json = old.map(|r| serde_json::to_value(r).unwrap_or_default());
    assert_eq!(
        json.as_ref().and_then(|j| j.get("forwarded_key_carriers")),
        None
    );
}

fn limits() -> PermitLimits {
    PermitLimits::until("2030-01-01T00:00:00Z").with_calls_left(Some(2))
}

#[test]
fn limits_ride_beside_each_decision_and_show_unlimited_as_null() {
    let dispatch = AuthorizeResponse::Dispatch {
        attempt_id: "a".into(),
        permit_id: "p".into(),
        lease_ms: 1,
        round: 1,
        capability: "c".into(),
        limits: Some(limits()),
        signature: None,
        credential: None,
    };
    let json = serde_json::to_value(&dispatch).unwrap_or_default();
    assert_eq!(
        json["limits"],
        serde_json::json!({"calls_left": 2, "budget_left": null, "expires_at": "2030-01-01T00:00:00Z"})
    );
    let mut denial = Denial::new(DenialCode::PermitExpired, "m");
    denial.limits = Some(limits());
    let json = serde_json::to_value(AuthorizeResponse::Deny(denial)).unwrap_or_default();
    assert_eq!(json["decision"], "deny");
    assert_eq!(json["limits"]["calls_left"], 2);
}

#[test]
fn answers_without_limits_still_read_and_omit_the_field() {
    // What a ledger without figures answers: read as `limits: None`.
    let old = serde_json::json!({"decision": "replay", "attempt_id": "a", "receipt": "{}"});
    let r: Option<AuthorizeResponse> = serde_json::from_value(old.clone()).ok();
    assert_eq!(
        r,
        Some(AuthorizeResponse::Replay {
            attempt_id: "a".into(),
            receipt: "{}".into(),
            limits: None
        })
    );
    assert_eq!(
        r.map(|r| serde_json::to_value(r).unwrap_or_default()),
        Some(old)
    );
    let deny = serde_json::json!({"decision": "deny", "code": "permit_invalid", "message": "m"});
    let d: Option<AuthorizeResponse> = serde_json::from_value(deny).ok();
    assert!(matches!(
        d,
        Some(AuthorizeResponse::Deny(Denial { limits: None, .. }))
    ));
}

#[test]
fn limits_response_names_each_tool() {
    let r = LimitsResponse {
        tools: [("pay".to_string(), limits())].into_iter().collect(),
    };
    let json = serde_json::to_value(&r).unwrap_or_default();
    assert_eq!(
        json,
        serde_json::json!({"tools": {"pay": {"calls_left": 2, "budget_left": null,
                                             "expires_at": "2030-01-01T00:00:00Z"}}})
    );
}

fn report(attempt: &str) -> OutcomeReport {
    OutcomeReport {
        attempt_id: attempt.into(),
        round: 1,
        capability: "cap".into(),
        outcome: Outcome::Completed {
            receipt: r#"{"jsonrpc":"2.0","id":1,"result":{}}"#.into(),
        },
    }
}

fn call() -> AuthorizeRequest {
    AuthorizeRequest {
        permit_token: "atm_p_x".into(),
        tool: "pay".into(),
        idempotency_key: Some("k".into()),
        fingerprint: "f".into(),
        arguments: serde_json::json!({"amount": 1}),
        key_required: false,
        continuation: false,
        forwarded_key: None,
        forwarded_key_carriers: KeyCarriers::NONE,
        dispatch: None,
        reports: Vec::new(),
    }
}

#[test]
fn reports_added_to_a_written_request_read_back_as_its_reports() {
    let mut text = serde_json::to_vec(&call()).unwrap_or_default();
    assert!(!String::from_utf8_lossy(&text).contains("reports"));
    let riders = vec![report("a1"), report("a2")];
    assert!(add_riding_reports(&mut text, &riders));
    let read: Option<AuthorizeRequest> = serde_json::from_slice(&text).ok();
    assert_eq!(
        read,
        Some(AuthorizeRequest {
            reports: riders.clone(),
            ..call()
        })
    );
    // Written whole, the same request has the same text.
    let whole = serde_json::to_vec(&AuthorizeRequest {
        reports: riders.clone(),
        ..call()
    })
    .unwrap_or_default();
    assert_eq!(text, whole);
    for mut not_an_object in [
        b"".to_vec(),
        b"{}".to_vec(),
        b"[1]".to_vec(),
        b"{\"a\":1".to_vec(),
    ] {
        let before = not_an_object.clone();
        assert!(!add_riding_reports(&mut not_an_object, &riders));
        assert_eq!(not_an_object, before);
    }
    let mut unchanged = serde_json::to_vec(&call()).unwrap_or_default();
    assert!(!add_riding_reports(&mut unchanged, &[]));
    assert_eq!(unchanged, serde_json::to_vec(&call()).unwrap_or_default());
}

#[test]
fn an_answer_without_acks_is_written_as_the_bare_decision() {
    let decisions = [
        AuthorizeResponse::Replay {
            attempt_id: "a".into(),
            receipt: "{}".into(),
            limits: Some(limits()),
        },
        AuthorizeResponse::Deny(Denial::new(DenialCode::PermitInvalid, "m").with("x", 1)),
    ];
    for decision in decisions {
        let bare = serde_json::to_vec(&decision).unwrap_or_default();
        let answer = AuthorizeAnswer {
            decision: decision.clone(),
            report_acks: None,
        };
        assert_eq!(serde_json::to_vec(&answer).unwrap_or_default(), bare);
        let acked = AuthorizeAnswer {
            decision: decision.clone(),
            report_acks: Some(vec![OutcomeAck::Applied, OutcomeAck::Refused]),
        };
        let text = serde_json::to_value(&acked).unwrap_or_default();
        assert_eq!(
            text["report_acks"],
            serde_json::json!(["applied", "refused"])
        );
        // Read either way: the decision as a bare answer (a filter that sent no reports
        // ignores the member), and the whole answer.
        let as_decision: Option<AuthorizeResponse> = serde_json::from_value(text.clone()).ok();
        assert_eq!(as_decision, Some(decision));
        let as_answer: Option<AuthorizeAnswer> = serde_json::from_value(text).ok();
        assert_eq!(as_answer, Some(acked));
    }
}
