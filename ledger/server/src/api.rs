//! JSON shapes of the admin API, shared by the server and the CLI.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::redact::Redaction;
use atmost_ledger::clock::{self, Millis};
use atmost_ledger::credentials::CredentialUse;
use atmost_ledger::keys::PublicSigningKey;
use atmost_ledger::model::{
    ApprovalView, Attempt, AttemptState, CallRules, KeyCarriers, Permit, PermitDetail, Resolution,
    ResolutionSource,
};

pub const ADMIN_PERMITS_PATH: &str = "/admin/v1/permits";
pub const ADMIN_ATTEMPTS_PATH: &str = "/admin/v1/attempts";
pub const ADMIN_ATTEMPTS_EXPORT_PATH: &str = "/admin/v1/attempts/export";
pub const ADMIN_KEYS_PATH: &str = "/admin/v1/keys";
pub const ADMIN_CREDENTIALS_PATH: &str = "/admin/v1/credentials";
pub const ADMIN_KEYS_ROTATE_PATH: &str = "/admin/v1/keys/rotate";
pub const ADMIN_INBOX_SESSIONS_REVOKE_PATH: &str = "/admin/v1/inbox/sessions/revoke";

/// Body of `POST /admin/v1/permits`: a label, an expiry and the policy (the call rules as
/// [`PermitView`] shows them, the retention as a duration); checked and issued by the
/// library ([`atmost_ledger::policy::PermitRequest::issue`]).
pub use atmost_ledger::policy::PermitRequest as CreatePermitRequest;

/// A permit as the admin API shows it: its record, its call rules as stored, and its
/// retention in seconds. The token never appears here.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PermitView {
    pub id: String,
    pub label: String,
    /// `active`, `expired` or `revoked`.
    pub status: String,
    pub created_at: String,
    pub expires_at: String,
    pub revoked_at: Option<String>,
    #[serde(flatten)]
    pub rules: CallRules,
    pub retention_secs: u64,
}

impl PermitView {
    pub fn new(p: &Permit, now: Millis) -> Self {
        PermitView {
            id: p.id.clone(),
            label: p.label.clone(),
            status: p.status(now).to_string(),
            created_at: clock::rfc3339(p.created_at_ms),
            expires_at: clock::rfc3339(p.expires_at_ms),
            revoked_at: p.revoked_at_ms.map(clock::rfc3339),
            rules: p.policy.rules.clone(),
            retention_secs: u64::try_from(p.policy.retention_ms / 1000).unwrap_or(0),
        }
    }
}

/// Answer of `POST /admin/v1/permits`: the permit's fields plus `token`, the only time
/// the token is shown.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreatePermitResponse {
    #[serde(flatten)]
    pub permit: PermitView,
    pub token: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PermitResponse {
    pub permit: PermitView,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PermitListResponse {
    pub permits: Vec<PermitView>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolUsageView {
    pub calls_made: u64,
    pub limit: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetView {
    pub budget: Option<u64>,
    pub spent: u64,
    pub reserved: u64,
    pub left: Option<u64>,
}

/// Answer of `GET /admin/v1/permits/{id}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PermitShowResponse {
    pub permit: PermitView,
    pub usage: BTreeMap<String, ToolUsageView>,
    pub budget: BudgetView,
    /// Count of attempts per state (every state present).
    pub attempts: BTreeMap<String, u64>,
}

impl PermitShowResponse {
    pub fn new(d: &PermitDetail, now: Millis) -> Self {
        let rules = &d.permit.policy.rules;
        let usage = d
            .usage
            .iter()
            .map(|(tool, u)| {
                (
                    tool.clone(),
                    ToolUsageView {
                        calls_made: u.calls_made,
                        limit: rules.limit_for(tool),
                    },
                )
            })
            .collect();
        let budget = BudgetView {
            budget: rules.budget,
            spent: d.budget.spent,
            reserved: d.budget.reserved,
            left: rules
                .budget
                .map(|b| b.saturating_sub(d.budget.spent.saturating_add(d.budget.reserved))),
        };
        let attempts = AttemptState::ALL
            .iter()
            .map(|s| {
                (
                    s.as_str().to_string(),
                    d.attempts_by_state.get(s).copied().unwrap_or(0),
                )
            })
            .collect();
        PermitShowResponse {
            permit: PermitView::new(&d.permit, now),
            usage,
            budget,
            attempts,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResolutionView {
    pub executed: bool,
    pub by: String,
    pub at: String,
    pub note: Option<String>,
    /// `person` or `reconciler`.
    #[serde(default = "person")]
    pub source: String,
    /// What the provider's lookup answered (JSON text), for a reconciler's resolution.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_answer: Option<String>,
}

fn person() -> String {
    ResolutionSource::Person.as_str().to_string()
}

impl From<&Resolution> for ResolutionView {
    fn from(r: &Resolution) -> Self {
        ResolutionView {
            executed: r.executed,
            by: r.by.clone(),
            at: clock::rfc3339(r.at_ms),
            note: r.note.clone(),
            source: r.source.as_str().to_string(),
            provider_answer: r.source.provider_answer().map(str::to_string),
        }
    }
}

/// An attempt as the admin API shows it: no key, no fingerprint, no receipt body; the
/// arguments with the configured fields redacted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttemptView {
    pub id: String,
    pub permit_id: String,
    pub tool: String,
    pub state: AttemptState,
    pub cost: u64,
    pub has_key: bool,
    pub created_at: String,
    pub updated_at: String,
    pub lease_expires_at: String,
    pub finished_at: Option<String>,
    pub reason: Option<String>,
    pub has_receipt: bool,
    pub replay_count: u64,
    pub pruned_at: Option<String>,
    pub resolution: Option<ResolutionView>,
    /// The key's value the upstream received (search the provider for it, in the form
    /// [`forwarded_key_carriers`](Self::forwarded_key_carriers) names).
    #[serde(default)]
    pub forwarded_key: Option<String>,
    /// Where the upstream received the forwarded key (`header`, `params._meta`,
    /// `params.idempotencyKey`), as the filter said. Empty: it reached no carrier, or the
    /// filter did not say (one older than this field); the reconciler takes both as "not
    /// reached".
    #[serde(default)]
    pub forwarded_key_carriers: KeyCarriers,
    /// The call's arguments, configured fields redacted (`None` once pruned, or for an
    /// attempt stored before arguments were kept).
    #[serde(default)]
    pub arguments: Option<Value>,
    /// The credential (name and version, never its secret) the dispatch carried; `None` when
    /// its permit names none, or for an attempt stored before it was kept.
    #[serde(default)]
    pub credential: Option<CredentialUse>,
    /// The person's approval the call waited for (docs/approvals.md); absent for a call that
    /// needed none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<ApprovalView>,
}

impl AttemptView {
    pub fn new(a: &Attempt, redaction: &Redaction) -> Self {
        AttemptView {
            id: a.id.clone(),
            permit_id: a.permit_id.clone(),
            tool: a.tool.clone(),
            state: a.state,
            cost: a.cost,
            has_key: a.key_hash.is_some(),
            created_at: clock::rfc3339(a.created_at_ms),
            updated_at: clock::rfc3339(a.updated_at_ms),
            lease_expires_at: clock::rfc3339(a.lease_expires_at_ms),
            finished_at: a.finished_at_ms.map(clock::rfc3339),
            reason: a.reason.clone(),
            has_receipt: a.receipt.is_some(),
            replay_count: a.replay_count,
            pruned_at: a.pruned_at_ms.map(clock::rfc3339),
            resolution: a.resolution.as_ref().map(ResolutionView::from),
            forwarded_key: a.forwarded_key.clone(),
            forwarded_key_carriers: a.forwarded_key_carriers,
            arguments: a.arguments.as_deref().map(|t| redaction.show(t)),
            credential: a.credential.clone(),
            approval: a.approval.as_ref().map(ApprovalView::from),
        }
    }
}

/// Where an attempt's forwarded key went, in words for people (the CLI, the inbox): the
/// carriers' names, `none` when no key was forwarded, or that the filter did not say.
pub fn key_carriers_text(forwarded_key: Option<&str>, carriers: KeyCarriers) -> String {
    match (forwarded_key, carriers.is_empty()) {
        (None, _) => "none".into(),
        (Some(_), true) => "none recorded (taken as reaching no carrier)".into(),
        (Some(_), false) => carriers
            .iter()
            .map(|c| c.as_str())
            .collect::<Vec<_>>()
            .join(", "),
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttemptResponse {
    pub attempt: AttemptView,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttemptListResponse {
    pub attempts: Vec<AttemptView>,
}

/// A signing key as the admin API shows it: never its private half.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyView {
    /// The RFC 7638 thumbprint: the `keyid` of its signatures, the `kid` in `/v1/keys`.
    pub kid: String,
    /// `active` (it signs), `retired` (it no longer signs and `/v1/keys` still lists it) or
    /// `unpublished` (no longer listed).
    pub status: String,
    pub created_at: String,
    pub retired_at: Option<String>,
    /// Until when `/v1/keys` lists it; `None` while it signs.
    pub published_until: Option<String>,
}

impl KeyView {
    pub fn new(k: &PublicSigningKey, now: Millis) -> Self {
        let status = match k.retired_at_ms {
            None => "active",
            Some(_) if k.is_published(now) => "retired",
            Some(_) => "unpublished",
        };
        KeyView {
            kid: k.kid.clone(),
            status: status.to_string(),
            created_at: clock::rfc3339(k.created_at_ms),
            retired_at: k.retired_at_ms.map(clock::rfc3339),
            published_until: k.published_until_ms().map(clock::rfc3339),
        }
    }
}

/// Answer of `GET /admin/v1/keys`: every signing key, newest first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyListResponse {
    pub keys: Vec<KeyView>,
}

/// Answer of `POST /admin/v1/keys/rotate`: the key that signs from now on, and the one it
/// retired.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRotateResponse {
    pub key: KeyView,
    pub retired: Option<KeyView>,
}

/// Answer of `POST /admin/v1/inbox/sessions/revoke`: how many open inbox sessions it ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionsRevokeResponse {
    pub revoked: u64,
}

/// Answer of `GET /admin/v1/attempts/export`: one signed receipt (a compact JWS) per attempt
/// the filters let through, newest first, all signed by the key `kid`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReceiptExportResponse {
    pub kid: String,
    pub receipts: Vec<String>,
}

/// An error answer as the admin CLI reads it. The ledger writes
/// [`atmost_protocol::ledger_error::LedgerErrorBody`]; the code is read here as text, so the
/// CLI still shows a code of a newer ledger it does not know.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

#[cfg(test)]
mod tests {
    use atmost_ledger::model::{CostRule, GuardMode, Policy};

    use super::*;

    /// The view is the record, the call rules as stored, and the retention in seconds, in
    /// this order: the answer's JSON is the same whatever struct holds the rules.
    #[test]
    fn a_permit_view_keeps_its_json() {
        let permit = Permit {
            id: "pmt_1".into(),
            token_hash: "h".into(),
            label: "agent".into(),
            created_at_ms: 0,
            expires_at_ms: 3_600_000,
            revoked_at_ms: None,
            policy: Policy::builder()
                .tools(&["pay"])
                .max_calls("pay", 1)
                .budget(100)
                .cost("pay", CostRule::Pointer("/amount".into()))
                .duplicate_guard(GuardMode::Enforce)
                .retention_ms(7 * 24 * 3_600_000)
                .build(),
        };
        let view = PermitView::new(&permit, 0);
        let json = serde_json::to_string(&view).unwrap();
        assert_eq!(
            json,
            r#"{"id":"pmt_1","label":"agent","status":"active","created_at":"1970-01-01T00:00:00.000Z","expires_at":"1970-01-01T01:00:00.000Z","revoked_at":null,"tools":["pay"],"max_calls":{"pay":1},"max_calls_default":null,"budget":100,"cost":{"pay":"/amount"},"cost_default":0,"duplicate_guard":"enforce","retention_secs":604800}"#
        );
        assert_eq!(serde_json::from_str::<PermitView>(&json).unwrap(), view);
    }
}
