//! What became of a dispatched call when the request ends without an acknowledged
//! `completed` report (`on_log`), decided from what Envoy recorded.
//!
//! | what Envoy saw | outcome |
//! |---|---|
//! | a receipt was captured (report not acknowledged) | `completed` |
//! | `upstream.request_attempt_count` = 0 | `released` (never sent) |
//! | exactly one attempt, and `response.flags` has UF, UH, UO, NR or NC and none of UT, UR, UC, DC | `released` (never delivered) |
//! | more than one attempt (a retry or a hedge), or the attempt count missing, whatever the flags | `uncertain` |
//! | UT, UR, UC or DC after an attempt; a response without a receipt; a receipt over `max_receipt_bytes`; properties missing; anything else | `uncertain` |
//!
//! The flags describe the request's last attempt only: after a retry or a hedge an earlier
//! attempt may have reached the upstream even when the last one never connected.
//! `uncertain` is the safe default: the slot and the budget stay taken until a person or
//! a reconciler checks the provider. Nothing here ever turns an unknown into `released`.

use atmost_protocol::{tool_refusal, Outcome};

/// UH: no healthy upstream.
pub const UH: u64 = 0x2;
/// UT: upstream request timeout.
pub const UT: u64 = 0x4;
/// UR: upstream remote reset.
pub const UR: u64 = 0x10;
/// UF: upstream connection failure.
pub const UF: u64 = 0x20;
/// UC: upstream connection termination.
pub const UC: u64 = 0x40;
/// UO: upstream overflow (circuit breaking).
pub const UO: u64 = 0x80;
/// NR: no route.
pub const NR: u64 = 0x100;
/// DC: downstream connection termination.
pub const DC: u64 = 0x4000;
/// NC: no cluster.
pub const NC: u64 = 0x100_0000;

/// Flags proving the request was never delivered upstream.
pub const NEVER_DELIVERED: u64 = UF | UH | UO | NR | NC;
/// Flags meaning it may have been delivered and the outcome is unknown.
pub const MAYBE_DELIVERED: u64 = UT | UR | UC | DC;

const NAMES: [(u64, &str); 9] = [
    (UH, "UH"),
    (UT, "UT"),
    (UR, "UR"),
    (UF, "UF"),
    (UC, "UC"),
    (UO, "UO"),
    (NR, "NR"),
    (DC, "DC"),
    (NC, "NC"),
];

/// Decodes an integer property as Envoy returns it (little-endian; 8 bytes for
/// int64/uint64, tolerating 4 or any 1..=8).
pub fn decode_int(bytes: Option<&[u8]>) -> Option<u64> {
    let b = bytes?;
    if b.is_empty() || b.len() > 8 {
        return None;
    }
    let mut buf = [0u8; 8];
    buf[..b.len()].copy_from_slice(b);
    Some(u64::from_le_bytes(buf))
}

/// `response_flags=0x44(UF,UC)`-style description.
pub fn describe_flags(flags: Option<u64>) -> String {
    match flags {
        None => "response_flags=unavailable".to_string(),
        Some(f) => {
            let names: Vec<&str> = NAMES
                .iter()
                .filter(|(bit, _)| f & bit != 0)
                .map(|(_, n)| *n)
                .collect();
            if names.is_empty() {
                format!("response_flags={f:#x}")
            } else {
                format!("response_flags={f:#x}({})", names.join(","))
            }
        }
    }
}

/// Why the filter holds no receipt for a dispatched call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoReceipt {
    /// No response (yet) when the request ended.
    NoResponse,
    /// The response was neither `application/json` nor `text/event-stream`, or empty.
    NotJsonRpc,
    /// The response held no JSON-RPC response with the request's id.
    NoMatchingResponse,
    /// The response was larger than `max_receipt_bytes`.
    TooLarge,
    /// A resumable SSE stream (its events had ids) ended without the answer: the client
    /// may get it on a resumed GET stream.
    StreamClosedResumable,
}

impl NoReceipt {
    pub fn reason(self) -> &'static str {
        match self {
            NoReceipt::NoResponse => "no_response",
            NoReceipt::NotJsonRpc => "no_receipt",
            NoReceipt::NoMatchingResponse => "no_receipt",
            NoReceipt::TooLarge => "receipt_too_large",
            NoReceipt::StreamClosedResumable => "stream_closed_before_answer",
        }
    }
}

/// The request reached upstream and its response ended normally: at least one attempt and
/// no flag at all (neither "never delivered" nor "outcome unknown").
pub fn closed_cleanly(attempts: Option<u64>, flags: Option<u64>) -> bool {
    attempts.is_some_and(|n| n >= 1) && flags == Some(0)
}

/// The outcome of a dispatched call whose completion was not acknowledged. Modelled in
/// `ledger/model/atmost.pml` (`Filter`: released only when the round never reached the
/// upstream, which Envoy proves only for a request it sent at most once).
pub fn classify(
    receipt: Option<&str>,
    no_receipt: NoReceipt,
    attempts: Option<u64>,
    flags: Option<u64>,
) -> Outcome {
    if let Some(r) = receipt {
        return Outcome::Completed {
            receipt: r.to_string(),
        };
    }
    if attempts == Some(0) {
        return Outcome::Released {
            reason: format!(
                "never_sent: upstream.request_attempt_count=0 {}",
                describe_flags(flags)
            ),
        };
    }
    let never_delivered =
        flags.is_some_and(|f| f & NEVER_DELIVERED != 0 && f & MAYBE_DELIVERED == 0);
    if never_delivered && attempts == Some(1) {
        return Outcome::Released {
            reason: format!("never_delivered: {}", describe_flags(flags)),
        };
    }
    let attempts_text = match attempts {
        Some(n) => n.to_string(),
        None => "unavailable".to_string(),
    };
    let reason = match (no_receipt, flags) {
        (NoReceipt::TooLarge, _) => "receipt_too_large",
        (_, Some(f)) if f & MAYBE_DELIVERED != 0 => "sent_outcome_unknown",
        _ if attempts.is_some_and(|n| n > 1) => "more_than_one_attempt",
        _ if never_delivered => "attempt_count_unavailable",
        (other, _) => other.reason(),
    };
    Outcome::Uncertain {
        reason: format!(
            "{reason}: upstream.request_attempt_count={attempts_text} {}",
            describe_flags(flags)
        ),
    }
}

/// The outcome of a dispatch a verifier at the tool refused (its `atmost-tool-refusal`
/// header, `refusal`). Reported as such only when Envoy made exactly one attempt: after a
/// retry an earlier attempt may have reached the tool, whatever the last one was told.
pub fn refused_at_tool(refusal: String, attempts: Option<u64>) -> Outcome {
    match attempts {
        Some(1) => Outcome::RefusedAtTool {
            refusal: refusal.chars().take(tool_refusal::MAX_LEN + 1).collect(),
            mac_verified: false,
        },
        _ => Outcome::Uncertain {
            reason: format!(
                "more_than_one_attempt: refused at the tool on the last; upstream.request_attempt_count={}",
                attempts.map_or("unavailable".to_string(), |n| n.to_string())
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_at_the_tool_is_reported_only_after_one_attempt() {
        let refusal = || "signature_key_unknown att_1/1/p/t ab".to_string();
        assert_eq!(
            refused_at_tool(refusal(), Some(1)),
            Outcome::RefusedAtTool {
                refusal: refusal(),
                mac_verified: false
            }
        );
        for attempts in [None, Some(0), Some(2)] {
            assert!(
                uncertain(&refused_at_tool(refusal(), attempts)),
                "{attempts:?}"
            );
        }
        // A refusal longer than any the ledger reads is cut, not sent whole.
        let long = refused_at_tool("x".repeat(10_000), Some(1));
        assert!(
            matches!(long, Outcome::RefusedAtTool { refusal, .. } if refusal.len() == tool_refusal::MAX_LEN + 1)
        );
    }

    fn released(o: &Outcome) -> bool {
        matches!(o, Outcome::Released { .. })
    }
    fn uncertain(o: &Outcome) -> bool {
        matches!(o, Outcome::Uncertain { .. })
    }

    #[test]
    fn decoding_properties() {
        assert_eq!(decode_int(Some(&[0x20, 0, 0, 0, 0, 0, 0, 0])), Some(0x20));
        assert_eq!(decode_int(Some(&[0x00, 0x40, 0, 0])), Some(0x4000));
        assert_eq!(decode_int(Some(&[1])), Some(1));
        assert_eq!(decode_int(Some(&[])), None);
        assert_eq!(decode_int(Some(&[0; 9])), None);
        assert_eq!(decode_int(None), None);
    }

    #[test]
    fn documented_envoy_cases() {
        // Connection refused: attempts 1, UF, 503 → never delivered.
        let o = classify(None, NoReceipt::NotJsonRpc, Some(1), Some(UF));
        assert!(released(&o), "{o:?}");
        // Response cut after the tool ran: UC → unknown.
        let o = classify(None, NoReceipt::NotJsonRpc, Some(1), Some(UC));
        assert!(uncertain(&o), "{o:?}");
        // Upstream timeout: UT, 504.
        let o = classify(None, NoReceipt::NotJsonRpc, Some(1), Some(UT));
        assert!(uncertain(&o), "{o:?}");
        // Client hung up: DC.
        let o = classify(None, NoReceipt::NoResponse, Some(1), Some(DC));
        assert!(uncertain(&o), "{o:?}");
        if let Outcome::Uncertain { reason } = o {
            assert!(reason.contains("DC"), "{reason}");
            assert!(reason.contains("0x4000"), "{reason}");
        }
    }

    #[test]
    fn other_cases() {
        // Never attempted at all, even if the client also hung up.
        assert!(released(&classify(
            None,
            NoReceipt::NoResponse,
            Some(0),
            Some(DC)
        )));
        assert!(released(&classify(
            None,
            NoReceipt::NoResponse,
            Some(0),
            None
        )));
        for f in [UH, UO, NR, NC] {
            assert!(released(&classify(
                None,
                NoReceipt::NotJsonRpc,
                Some(1),
                Some(f)
            )));
        }
        // One attempt only: a retry or a hedge may have delivered an earlier one, whatever
        // the last one's flags say; without the count nothing is proven.
        for attempts in [Some(2), Some(3), None] {
            for f in [UF, UH, UO, NR, NC, UF | UH] {
                let o = classify(None, NoReceipt::NotJsonRpc, attempts, Some(f));
                assert!(uncertain(&o), "{attempts:?} {f:#x}: {o:?}");
            }
        }
        assert_eq!(
            classify(None, NoReceipt::NotJsonRpc, Some(2), Some(UF)),
            Outcome::Uncertain {
                reason: "more_than_one_attempt: upstream.request_attempt_count=2 response_flags=0x20(UF)"
                    .into()
            }
        );
        assert_eq!(
            classify(None, NoReceipt::NotJsonRpc, None, Some(UH)),
            Outcome::Uncertain {
                reason: "attempt_count_unavailable: upstream.request_attempt_count=unavailable response_flags=0x2(UH)"
                    .into()
            }
        );
        // Two attempts with a response that holds no receipt.
        assert_eq!(
            classify(None, NoReceipt::NotJsonRpc, Some(2), Some(0)),
            Outcome::Uncertain {
                reason:
                    "more_than_one_attempt: upstream.request_attempt_count=2 response_flags=0x0"
                        .into()
            }
        );
        // Still: nothing attempted at all is never sent, and a receipt wins after a retry.
        assert!(released(&classify(
            None,
            NoReceipt::NoResponse,
            Some(0),
            Some(UF)
        )));
        assert!(matches!(
            classify(Some("{}"), NoReceipt::NoResponse, Some(2), Some(UF)),
            Outcome::Completed { .. }
        ));
        // A never-delivered flag together with an unknown one stays uncertain.
        assert!(uncertain(&classify(
            None,
            NoReceipt::NotJsonRpc,
            Some(1),
            Some(UF | UC)
        )));
        assert!(uncertain(&classify(
            None,
            NoReceipt::NotJsonRpc,
            Some(1),
            Some(UR)
        )));
        // A plain response without a receipt, or properties missing.
        assert!(uncertain(&classify(
            None,
            NoReceipt::NoMatchingResponse,
            Some(1),
            Some(0)
        )));
        assert!(uncertain(&classify(
            None,
            NoReceipt::NoResponse,
            None,
            None
        )));
        let o = classify(None, NoReceipt::TooLarge, Some(1), Some(0));
        assert_eq!(
            o,
            Outcome::Uncertain {
                reason: "receipt_too_large: upstream.request_attempt_count=1 response_flags=0x0"
                    .into()
            }
        );
        // A captured receipt wins.
        assert_eq!(
            classify(Some("{}"), NoReceipt::NoResponse, Some(1), Some(DC)),
            Outcome::Completed {
                receipt: "{}".into()
            }
        );
    }
}
