//! A verifier's refusal as the gateway receives it (docs/signatures.md, "A refusal at the
//! tool"): the verifier names its refusal in the response header [`HEADER`], and, when it
//! holds a refusal key, proves it with an HMAC over the code and the dispatch's nonce. The
//! gateway passes the value on in its report as it received it; the ledger checks the HMAC
//! with the keys it trusts before a refused dispatch gives its slot back.
//!
//! The value is `<code>`, or `<code> <nonce> <mac>` with `mac` the lowercase hex of
//! `HMAC-SHA256(refusal key, `[`mac_input`]`(code, nonce))`. No part holds a space (codes are
//! identifiers, nonces percent-encode their tool).

use crate::DenialCode;

/// The response header a verifier's refusal carries.
pub const HEADER: &str = "atmost-tool-refusal";

/// Longest value read: a longer one is no refusal of ours.
pub const MAX_LEN: usize = 1024;

/// The bytes the HMAC is made over: a domain label, the code, the nonce.
pub fn mac_input(code: DenialCode, nonce: &str) -> Vec<u8> {
    format!("atmost-tool-refusal/v1\n{code}\n{nonce}").into_bytes()
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// One refusal header's content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolRefusal {
    pub code: DenialCode,
    /// The nonce of the refused signature and the HMAC over it, when the verifier read a
    /// nonce and holds a key.
    pub proof: Option<Proof>,
}

/// The refused dispatch's nonce and the verifier's HMAC over it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proof {
    pub nonce: String,
    /// Lowercase hex, 64 digits.
    pub mac: String,
}

impl ToolRefusal {
    /// The header's value.
    pub fn header_value(&self) -> String {
        match &self.proof {
            None => self.code.as_str().to_string(),
            Some(p) => format!("{} {} {}", self.code, p.nonce, p.mac),
        }
    }

    /// Reads a header value; `None` unless it is one of the two forms with a known code.
    pub fn parse(value: &str) -> Option<ToolRefusal> {
        if value.len() > MAX_LEN {
            return None;
        }
        let mut parts = value.split(' ');
        let code = DenialCode::from_wire(parts.next()?)?;
        let proof = match (parts.next(), parts.next(), parts.next()) {
            (None, _, _) => None,
            (Some(nonce), Some(mac), None)
                if !nonce.is_empty()
                    && nonce.bytes().all(|b| (0x21..=0x7e).contains(&b))
                    && mac.len() == 64
                    && mac
                        .bytes()
                        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) =>
            {
                Some(Proof {
                    nonce: nonce.to_string(),
                    mac: mac.to_string(),
                })
            }
            _ => return None,
        };
        Some(ToolRefusal { code, proof })
    }
}

/// Whether a verifier's refusal with `code`, proven, shows that the tool did not run the
/// refused dispatch. Every refusal is made before the server gets the body, except that
/// `signature_replayed` says the same signature was let through before: the tool may have
/// run it.
pub fn gives_slot_back(code: DenialCode) -> bool {
    matches!(
        code,
        DenialCode::SignatureMalformed
            | DenialCode::SignatureKeyUnknown
            | DenialCode::SignatureOutsideValidity
            | DenialCode::ContentDigestMismatch
            | DenialCode::SignatureInvalid
            | DenialCode::ReplayCacheUnavailable
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_forms_read_back_and_anything_else_is_none() {
        let bare = ToolRefusal {
            code: DenialCode::SignatureMissing,
            proof: None,
        };
        assert_eq!(bare.header_value(), "signature_missing");
        assert_eq!(ToolRefusal::parse(&bare.header_value()), Some(bare));
        let proven = ToolRefusal {
            code: DenialCode::SignatureKeyUnknown,
            proof: Some(Proof {
                nonce: "att_1/1/pmt_2/pay%20it".into(),
                mac: "ab".repeat(32),
            }),
        };
        assert_eq!(ToolRefusal::parse(&proven.header_value()), Some(proven));
        for bad in [
            "",
            "not_a_code",
            "signature_invalid att_1/1/p/t",
            "signature_invalid att_1/1/p/t ABAB",
            "signature_invalid  ",
            &format!("signature_invalid n {} x", "a".repeat(64)),
            &format!("signature_invalid n {}", "A".repeat(64)),
            &"x".repeat(MAX_LEN + 1),
        ] {
            assert_eq!(ToolRefusal::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_mac_input_binds_code_and_nonce() {
        let a = mac_input(DenialCode::SignatureInvalid, "n1");
        assert_ne!(a, mac_input(DenialCode::SignatureKeyUnknown, "n1"));
        assert_ne!(a, mac_input(DenialCode::SignatureInvalid, "n2"));
        assert_eq!(a, b"atmost-tool-refusal/v1\nsignature_invalid\nn1".to_vec());
    }

    #[test]
    fn a_replayed_signature_gives_nothing_back() {
        assert!(!gives_slot_back(DenialCode::SignatureReplayed));
        assert!(!gives_slot_back(DenialCode::SignatureMissing));
        assert!(gives_slot_back(DenialCode::SignatureKeyUnknown));
        assert!(gives_slot_back(DenialCode::ReplayCacheUnavailable));
        assert!(!gives_slot_back(DenialCode::PermitInvalid));
    }
}
