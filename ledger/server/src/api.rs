//! JSON shapes of the admin API, shared by the server and the CLI.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::redact::Redaction;
use atmost_ledger::clock::{self, Millis};
use atmost_ledger::model::{
    Attempt, AttemptState, CostRule, GuardMode, Permit, PermitDetail, Resolution, ResolutionSource,
};

pub const ADMIN_PERMITS_PATH: &str = "/admin/v1/permits";
pub const ADMIN_ATTEMPTS_PATH: &str = "/admin/v1/attempts";

/// Default replay retention of a permit.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// Body of `POST /admin/v1/permits`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreatePermitRequest {
    pub label: String,
    /// A duration from now (`24h`, `30m`) or an RFC 3339 time.
    pub expires: String,
    /// Tool names or `["*"]`; default `["*"]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub max_calls: BTreeMap<String, u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_calls_default: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<u64>,
    /// Tool → fixed cost or JSON pointer into the arguments.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub cost: BTreeMap<String, CostRule>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_default: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duplicate_guard: Option<GuardMode>,
    /// Replay retention as a duration (`7d`); default 7 days.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retention: Option<String>,
}

/// A permit as the admin API shows it. The token never appears here.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PermitView {
    pub id: String,
    pub label: String,
    /// `active`, `expired` or `revoked`.
    pub status: String,
    pub created_at: String,
    pub expires_at: String,
    pub revoked_at: Option<String>,
    pub tools: Vec<String>,
    pub max_calls: BTreeMap<String, u64>,
    pub max_calls_default: Option<u64>,
    pub budget: Option<u64>,
    pub cost: BTreeMap<String, CostRule>,
    pub cost_default: u64,
    pub duplicate_guard: GuardMode,
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
            tools: p.policy.tools.clone(),
            max_calls: p.policy.max_calls.clone(),
            max_calls_default: p.policy.max_calls_default,
            budget: p.policy.budget,
            cost: p.policy.cost.clone(),
            cost_default: p.policy.cost_default,
            duplicate_guard: p.policy.duplicate_guard,
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
        let policy = &d.permit.policy;
        let usage = d
            .usage
            .iter()
            .map(|(tool, u)| {
                (
                    tool.clone(),
                    ToolUsageView {
                        calls_made: u.calls_made,
                        limit: policy.limit_for(tool),
                    },
                )
            })
            .collect();
        let budget = BudgetView {
            budget: policy.budget,
            spent: d.budget.spent,
            reserved: d.budget.reserved,
            left: policy
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
    /// The `Idempotency-Key` value the upstream received (search the provider for it).
    #[serde(default)]
    pub forwarded_key: Option<String>,
    /// The call's arguments, configured fields redacted (`None` once pruned, or for an
    /// attempt stored before arguments were kept).
    #[serde(default)]
    pub arguments: Option<Value>,
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
            arguments: a.arguments.as_deref().map(|t| redaction.show(t)),
        }
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

/// Error body of every endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// `24h` / `30m` from now, or an RFC 3339 time.
pub fn parse_expiry(s: &str, now: Millis) -> Result<Millis, String> {
    let s = s.trim();
    if let Ok(d) = humantime::parse_duration(s) {
        let ms = i64::try_from(d.as_millis()).map_err(|_| format!("expiry {s:?} is too far"))?;
        return Ok(now.saturating_add(ms));
    }
    clock::parse_rfc3339(s)
        .ok_or_else(|| format!("expiry must be a duration like 24h or an RFC 3339 time, not {s:?}"))
}

/// A humantime duration (`7d`, `12h`) in milliseconds.
pub fn parse_duration_ms(s: &str) -> Result<Millis, String> {
    let d = humantime::parse_duration(s.trim()).map_err(|e| format!("bad duration {s:?}: {e}"))?;
    i64::try_from(d.as_millis()).map_err(|_| format!("duration {s:?} is too long"))
}
