//! The keys a verifier at the tool proves its refusals with (`--tool-refusal-keys`), and their
//! check on each `refused_at_tool` report before the store decides it
//! (docs/signatures.md, "A refusal at the tool"). The rule itself (what a proven refusal moves
//! an attempt to) is the ledger's pure `decide`; this only says whether the HMAC verifies.

use std::path::Path;

use atmost_protocol::tool_refusal::{mac_input, ToolRefusal};
use atmost_protocol::{Outcome, OutcomeReport};
use ring::hmac;

/// Shortest key accepted, in bytes (as the verifier's `verify.refusal_key`).
pub const MIN_KEY_BYTES: usize = 32;

/// The HMAC keys refusals may be proven with: several during a rotation. Never shown.
#[derive(Default, Clone)]
pub struct RefusalKeys {
    keys: Vec<hmac::Key>,
}

impl std::fmt::Debug for RefusalKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RefusalKeys({} keys, redacted)", self.keys.len())
    }
}

impl RefusalKeys {
    /// The keys of a file's text: one per line, each the secret itself (as the verifier's
    /// `verify.refusal_key`), blank lines and lines starting with `#` skipped.
    pub fn parse(text: &str) -> Result<RefusalKeys, String> {
        let mut keys = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            if line.len() < MIN_KEY_BYTES {
                return Err(format!(
                    "line {}: a refusal key must be at least {MIN_KEY_BYTES} bytes",
                    i + 1
                ));
            }
            keys.push(hmac::Key::new(hmac::HMAC_SHA256, line.as_bytes()));
        }
        if keys.is_empty() {
            return Err("the file holds no key".into());
        }
        Ok(RefusalKeys { keys })
    }

    /// [`RefusalKeys::parse`] of a file.
    pub fn read(path: &Path) -> Result<RefusalKeys, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("--tool-refusal-keys {}: {e}", path.display()))?;
        RefusalKeys::parse(&text)
            .map_err(|e| format!("--tool-refusal-keys {}: {e}", path.display()))
    }

    /// How many keys are held.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Whether `refusal` carries an HMAC over its code and nonce that one of the keys made
    /// (compared in constant time by `ring`).
    pub fn verifies(&self, refusal: &str) -> bool {
        let Some(ToolRefusal {
            code,
            proof: Some(proof),
        }) = ToolRefusal::parse(refusal)
        else {
            return false;
        };
        let Ok(tag) = hex::decode(&proof.mac) else {
            return false;
        };
        let input = mac_input(code, &proof.nonce);
        self.keys
            .iter()
            .any(|key| hmac::verify(key, &input, &tag).is_ok())
    }

    /// Marks each `refused_at_tool` report whose HMAC verifies; any claim a report made is
    /// overwritten (the field is never read from the wire either).
    pub fn check_reports(&self, reports: &mut [OutcomeReport]) {
        for report in reports {
            if let Outcome::RefusedAtTool {
                refusal,
                mac_verified,
            } = &mut report.outcome
            {
                *mac_verified = self.verifies(refusal);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use atmost_protocol::tool_refusal::{hex, Proof};
    use atmost_protocol::DenialCode;

    const KEY: &str = "refusal-key-0123456789abcdef-0123456789";

    fn proven(key: &str, code: DenialCode, nonce: &str) -> String {
        let tag = hmac::sign(
            &hmac::Key::new(hmac::HMAC_SHA256, key.as_bytes()),
            &mac_input(code, nonce),
        );
        ToolRefusal {
            code,
            proof: Some(Proof {
                nonce: nonce.into(),
                mac: hex(tag.as_ref()),
            }),
        }
        .header_value()
    }

    #[test]
    fn only_a_key_of_the_file_proves_a_refusal() {
        let keys = RefusalKeys::parse(&format!("# rotation\n\nold-key-{KEY}\n{KEY}\n")).unwrap();
        assert_eq!(keys.len(), 2);
        let nonce = "att_1/1/pmt_2/pay";
        assert!(keys.verifies(&proven(KEY, DenialCode::SignatureKeyUnknown, nonce)));
        assert!(keys.verifies(&proven(
            &format!("old-key-{KEY}"),
            DenialCode::SignatureKeyUnknown,
            nonce
        )));
        // Another key, or the same HMAC moved to another code or nonce: no proof.
        assert!(!keys.verifies(&proven(
            "another-key-0123456789abcdef-012345",
            DenialCode::SignatureKeyUnknown,
            nonce
        )));
        let moved = proven(KEY, DenialCode::SignatureKeyUnknown, nonce).replacen(
            "signature_key_unknown",
            "signature_invalid",
            1,
        );
        assert!(!keys.verifies(&moved));
        let other_nonce =
            proven(KEY, DenialCode::SignatureKeyUnknown, nonce).replacen("att_1/", "att_9/", 1);
        assert!(!keys.verifies(&other_nonce));
        assert!(!keys.verifies("signature_key_unknown"));
    }

    #[test]
    fn reports_are_marked_by_the_check_alone() {
        let keys = RefusalKeys::parse(KEY).unwrap();
        let report = |refusal: String| OutcomeReport {
            attempt_id: "att_1".into(),
            round: 1,
            capability: "c".into(),
            outcome: Outcome::RefusedAtTool {
                refusal,
                mac_verified: true,
            },
        };
        let mut reports = vec![
            report(proven(KEY, DenialCode::SignatureInvalid, "n")),
            report("signature_invalid".into()),
        ];
        keys.check_reports(&mut reports);
        let verified: Vec<bool> = reports
            .iter()
            .map(|r| matches!(r.outcome, Outcome::RefusedAtTool { mac_verified, .. } if mac_verified))
            .collect();
        assert_eq!(verified, [true, false]);
    }

    #[test]
    fn a_bad_file_is_refused_naming_the_line() {
        assert!(RefusalKeys::parse("").unwrap_err().contains("no key"));
        assert!(RefusalKeys::parse("short\n")
            .unwrap_err()
            .contains("line 1"));
    }
}
