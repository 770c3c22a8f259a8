//! The dispatch signature: its base, its parsing and its checks.

use super::*;

fn request(key: Option<&'static str>) -> SignedRequest<'static> {
    SignedRequest {
        method: "POST",
        authority: "mcp.example:8000",
        path: "/mcp",
        content_digest: "sha-256=:X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE=:",
        idempotency_key: key,
    }
}

fn params() -> SignatureParams {
    SignatureParams {
        created: 1_764_680_000,
        expires: 1_764_680_015,
        keyid: "kid-1".into(),
        nonce: DispatchNonce {
            attempt_id: "att_0123".into(),
            round: 2,
            permit_id: "pmt_abc".into(),
            tool: "pay invoice/\"x\"".into(),
        }
        .encode(),
    }
}

#[test]
fn the_signature_base_is_rfc_9421s_form() {
    let req = request(Some("k-1"));
    let input = req.signature_params(&params());
    let base = req.signature_base(&input).unwrap();
    assert_eq!(
        base,
        "\"@method\": POST\n\"@authority\": mcp.example:8000\n\"@path\": /mcp\n\
         \"content-digest\": sha-256=:X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE=:\n\
         \"idempotency-key\": k-1\n\
         \"@signature-params\": (\"@method\" \"@authority\" \"@path\" \"content-digest\" \"idempotency-key\");\
         created=1764680000;expires=1764680015;keyid=\"kid-1\";alg=\"ed25519\";\
         nonce=\"att_0123/2/pmt_abc/pay%20invoice%2F%22x%22\";tag=\"atmost\""
    );
}

#[test]
fn without_a_forwarded_key_the_header_is_not_covered() {
    let req = request(None);
    let input = req.signature_params(&params());
    assert_eq!(input.components, COMPONENTS.map(String::from).to_vec());
    // A verifier handed a request that now carries a key still rebuilds the base the
    // signer made: the key is simply not covered.
    let with_key = request(Some("k"));
    assert!(!with_key
        .signature_base(&input)
        .unwrap()
        .contains("idempotency-key"));
}

#[test]
fn a_signature_input_reads_back_as_written() {
    let input = request(Some("k")).signature_params(&params());
    let header = format!("other=(\"@path\");created=1, {}", input.header_value());
    let parsed = SignatureInput::parse(&header).unwrap();
    assert_eq!(parsed, input);
    assert_eq!(parsed.integer("created"), Some(1_764_680_000));
    assert_eq!(parsed.string("tag"), Some(TAG));
    let nonce = DispatchNonce::parse(parsed.string("nonce").unwrap()).unwrap();
    assert_eq!(nonce.tool, "pay invoice/\"x\"");
    assert_eq!(nonce.round, 2);
}

#[test]
fn malformed_and_missing_signature_headers_are_told_apart() {
    assert_eq!(
        SignatureInput::parse("other=(\"@path\")"),
        Err(SignatureHeaderError::Missing)
    );
    for bad in [
        "atmost=(\"@path\"",
        "atmost=(@path)",
        "atmost=(\"@path\");created=x",
        "atmost=(\"@path\");created=1;created=2",
        "atmost=(\"@path\"), atmost=(\"@method\")",
        "atmost=(\"a\\x\")",
    ] {
        assert_eq!(
            SignatureInput::parse(bad),
            Err(SignatureHeaderError::Malformed),
            "{bad}"
        );
    }
    assert_eq!(parse_signature("atmost=:AAAA:"), Ok(vec![0, 0, 0]));
    assert_eq!(
        parse_signature("atmost=:!!:"),
        Err(SignatureHeaderError::Malformed)
    );
    assert_eq!(
        parse_signature("x=:AAAA:"),
        Err(SignatureHeaderError::Missing)
    );
}

#[test]
fn a_base_is_refused_for_unknown_or_repeated_components() {
    let req = request(None);
    let mut input = req.signature_params(&params());
    input.components.push("@query".into());
    assert_eq!(req.signature_base(&input), None);
    let mut twice = req.signature_params(&params());
    twice.components.push("@path".into());
    assert_eq!(req.signature_base(&twice), None);
}

#[test]
fn content_digest_is_rfc_9530s_sha_256_member() {
    // RFC 9530 §B.1: the digest of `{"hello": "world"}`.
    let d = content_digest_of(b"{\"hello\": \"world\"}");
    assert_eq!(d, "sha-256=:X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE=:");
    let hex = "5f8f04f6a3a892aaabbddb6cf273894493773960d4a325b105fee46eef4304f1";
    assert_eq!(content_digest_from_hex(hex).as_deref(), Some(d.as_str()));
    assert_eq!(
        parse_content_digest(&format!("sha-512=:AA==:, {d}"))
            .unwrap()
            .len(),
        32
    );
    assert_eq!(content_digest_from_hex("zz"), None);
}

#[test]
fn a_jwk_names_itself_by_its_rfc_7638_thumbprint() {
    // RFC 8037 §A.3: the thumbprint of the example Ed25519 key.
    let x = "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo";
    assert_eq!(
        jwk_thumbprint(x),
        "kPrK_qmxVWaYVA9wwBF6Iuo3vVzz7TxHCTwXBygrS4k"
    );
    let jwk = Jwk::ed25519(&b64url_decode(x).unwrap());
    assert_eq!(jwk.kid, "kPrK_qmxVWaYVA9wwBF6Iuo3vVzz7TxHCTwXBygrS4k");
    assert!(jwk.ed25519_public_key().is_some());
    let forged = Jwk {
        kid: "other".into(),
        ..jwk
    };
    assert_eq!(forged.ed25519_public_key(), None);
}

#[test]
fn nonces_of_other_forms_are_refused() {
    for bad in [
        "",
        "att/1/pmt",
        "att/x/pmt/t",
        "a-b/1/pmt/t",
        "att/1/pmt/t t",
        "att/1/pmt/%zz",
    ] {
        assert_eq!(DispatchNonce::parse(bad), None, "{bad}");
    }
}
