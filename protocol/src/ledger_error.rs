//! The ledger's error answers: every HTTP answer of the ledger that is not a success carries
//! `{"error": CODE}` (and sometimes a `message` for people), CODE one of [`LedgerErrorCode`].
//! The ledger builds every such answer from this set, status included, and the filter reads
//! the code back from the body, so the two sides agree on a name instead of on a guess from
//! the status. docs/ledger.md's table of error answers lists each row (a test holds them
//! together).

use serde::{Deserialize, Serialize};

use crate::closed_set;

closed_set! {
    /// What went wrong, as the `error` of an error answer, and the HTTP status it is sent with.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum LedgerErrorCode: http_status -> u16 {
        /// A body, header or query the endpoint cannot take.
        BadRequest => "bad_request", 400;
        /// No bearer token, or the wrong one.
        Unauthorized => "unauthorized", 401;
        /// A permit token that does not authenticate (`/v1/limits`, `/v1/credential`).
        PermitInvalid => "permit_invalid", 403;
        /// The admin API names a permit the store does not hold.
        UnknownPermit => "unknown_permit", 404;
        /// The admin API names an attempt the store does not hold.
        UnknownAttempt => "unknown_attempt", 404;
        /// A request under `/admin` on the API listener: the admin listener serves it.
        AdminElsewhere => "admin_elsewhere", 404;
        /// A resolution of an attempt that is not uncertain.
        NotUncertain => "not_uncertain", 409;
        /// A decision on an approval whose attempt is not waiting for one (or lapsed).
        NotAwaitingApproval => "not_awaiting_approval", 409;
        /// A credential registered or named on a ledger started without a credential key.
        CredentialKeyUnset => "credential_key_unset", 409;
        /// Too many failed authentications from the caller's address (with `Retry-After`).
        TooManyFailures => "too_many_failures", 429;
        /// A broken invariant: retrying does not help.
        Internal => "internal", 500;
        /// The store cannot answer now (or the caller's deadline passed): it may pass.
        StoreUnavailable => "store_unavailable", 503;
        /// No signing key can sign the receipts an export asks for.
        NoSigningKey => "no_signing_key", 503;
        /// `/readyz` of a ledger draining before it stops.
        Draining => "draining", 503;
    }
}

/// The body of every error answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LedgerErrorBody {
    pub error: LedgerErrorCode,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/ledger.md's table of error answers, one `(code, status)` a row.
    fn doc_rows() -> Vec<(String, String)> {
        let doc = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/ledger.md"));
        doc.lines()
            .skip_while(|l| !l.starts_with("**Error answers.**"))
            .skip_while(|l| !l.starts_with("| `"))
            .take_while(|l| l.starts_with('|'))
            .filter_map(|l| {
                let mut cells = l.split('|').map(str::trim).skip(1);
                let code = cells.next()?.trim_matches('`').to_string();
                Some((code, cells.next()?.to_string()))
            })
            .collect()
    }

    #[test]
    fn the_docs_table_of_error_answers_is_the_set() {
        let rows = doc_rows();
        let set: Vec<(String, String)> = LedgerErrorCode::ALL
            .iter()
            .map(|c| (c.as_str().to_string(), c.http_status().to_string()))
            .collect();
        assert_eq!(
            rows, set,
            "docs/ledger.md's table of error answers, row by row"
        );
    }

    #[test]
    fn a_body_reads_back_as_written() {
        let body = LedgerErrorBody {
            error: LedgerErrorCode::NotUncertain,
            message: Some("attempt is completed".into()),
        };
        let text = serde_json::to_string(&body).unwrap();
        assert_eq!(
            text,
            r#"{"error":"not_uncertain","message":"attempt is completed"}"#
        );
        assert_eq!(
            serde_json::from_str::<LedgerErrorBody>(&text).unwrap(),
            body
        );
        let bare = LedgerErrorBody {
            error: LedgerErrorCode::Internal,
            message: None,
        };
        assert_eq!(
            serde_json::to_string(&bare).unwrap(),
            r#"{"error":"internal"}"#
        );
    }
}
