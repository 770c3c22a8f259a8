//! A permit as an operator asks for it, and what the ledger refuses to issue.
//!
//! `POST /admin/v1/permits` takes a [`PermitRequest`] (the CLI's `permit create` sends one):
//! a label, an expiry, and the policy as a [`PolicySpec`], which is the [`CallRules`] the
//! store keeps plus the retention as a duration. [`PermitRequest::issue`] checks every rule
//! and makes the [`Permit`] and its token; each refusal is a [`PermitError`], whose text is
//! the API's answer.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::clock::{self, Millis};
use crate::error::LedgerError;
use crate::model::{ApprovalRule, CallRules, CostRule, Permit, Policy};
use crate::token;

/// Default replay retention of a permit.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// Why a permit was not issued.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PermitError {
    #[error("label must not be empty")]
    EmptyLabel,
    #[error("expiry must be a duration like 24h or an RFC 3339 time, not {0:?}")]
    UnreadableExpiry(String),
    #[error("expiry {0:?} is too far")]
    ExpiryTooFar(String),
    #[error("expiry is in the past")]
    ExpiryPast,
    #[error("tools must be a non-empty list of tool names, or [\"*\"]")]
    NoTools,
    /// The tool whose cost pointer is not a JSON pointer.
    #[error("cost pointer for {0:?} must start with '/'")]
    CostPointer(String),
    /// The tool whose fixed cost is larger than a store keeps.
    #[error("cost for {0:?} is too large")]
    CostTooLarge(String),
    /// The tool (`*`: the default) whose approval amount no cost can exceed.
    #[error("approval cost_above for {0:?} is too large")]
    ApprovalAmountTooLarge(String),
    #[error("bad duration {text:?}: {reason}")]
    UnreadableRetention { text: String, reason: String },
    #[error("duration {0:?} is too long")]
    RetentionTooLong(String),
    /// No id or token could be drawn (the operating system's random source failed).
    #[error(transparent)]
    Token(#[from] LedgerError),
}

/// A permit's policy as an operator writes it: the call rules in the shape they are kept and
/// shown, and the replay retention as a duration (`7d`; default [`DEFAULT_RETENTION`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicySpec {
    #[serde(flatten)]
    pub rules: CallRules,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retention: Option<String>,
}

impl PolicySpec {
    /// The policy, once every rule holds: at least one tool and no empty name, cost pointers
    /// that are JSON pointers, fixed costs a store can keep, a readable retention.
    pub fn validate(self) -> Result<Policy, PermitError> {
        self.rules.check()?;
        let retention_ms = match self.retention.as_deref() {
            Some(text) => duration_ms(text)?,
            None => default_retention_ms(),
        };
        Ok(Policy {
            rules: self.rules,
            retention_ms,
        })
    }
}

impl CallRules {
    /// What the ledger refuses in call rules, in the order the admin API reports it.
    pub fn check(&self) -> Result<(), PermitError> {
        if self.tools.is_empty() || self.tools.iter().any(|t| t.trim().is_empty()) {
            return Err(PermitError::NoTools);
        }
        for (tool, rule) in &self.cost {
            match rule {
                CostRule::Pointer(p) if !p.starts_with('/') => {
                    return Err(PermitError::CostPointer(tool.clone()));
                }
                CostRule::Fixed(n) if i64::try_from(*n).is_err() => {
                    return Err(PermitError::CostTooLarge(tool.clone()));
                }
                CostRule::Pointer(_) | CostRule::Fixed(_) => {}
            }
        }
        let approvals = self
            .approval
            .iter()
            .map(|(tool, rule)| (tool.as_str(), rule))
            .chain(self.approval_default.iter().map(|rule| ("*", rule)));
        for (tool, rule) in approvals {
            if matches!(rule, ApprovalRule::CostAbove(n) if i64::try_from(*n).is_err()) {
                return Err(PermitError::ApprovalAmountTooLarge(tool.to_string()));
            }
        }
        Ok(())
    }
}

impl Default for Policy {
    /// The policy of a permit created with nothing but a label and an expiry.
    fn default() -> Self {
        Policy {
            rules: CallRules::default(),
            retention_ms: default_retention_ms(),
        }
    }
}

fn default_retention_ms() -> Millis {
    i64::try_from(DEFAULT_RETENTION.as_millis()).unwrap_or(i64::MAX)
}

/// A permit as an operator asks for it: the body of `POST /admin/v1/permits`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PermitRequest {
    pub label: String,
    /// A duration from now (`24h`, `30m`) or an RFC 3339 time.
    pub expires: String,
    #[serde(flatten)]
    pub policy: PolicySpec,
}

impl PermitRequest {
    /// Checks the request (the label, the expiry, then the policy) and issues the permit at
    /// `now`: a new id, and a new token, which is returned and never kept (the permit holds
    /// its hash).
    pub fn issue(self, now: Millis) -> Result<(Permit, String), PermitError> {
        let label = self.label.trim().to_string();
        if label.is_empty() {
            return Err(PermitError::EmptyLabel);
        }
        let expires_at_ms = expiry(&self.expires, now)?;
        if expires_at_ms <= now {
            return Err(PermitError::ExpiryPast);
        }
        let policy = self.policy.validate()?;
        let id = token::new_permit_id()?;
        let tok = token::new_token(&id)?;
        let permit = Permit {
            token_hash: token::sha256_hex(&tok),
            id,
            label,
            created_at_ms: now,
            expires_at_ms,
            revoked_at_ms: None,
            policy,
        };
        Ok((permit, tok))
    }
}

/// `24h` / `30m` from now, or an RFC 3339 time.
fn expiry(text: &str, now: Millis) -> Result<Millis, PermitError> {
    let text = text.trim();
    if let Ok(d) = humantime::parse_duration(text) {
        let ms =
            i64::try_from(d.as_millis()).map_err(|_| PermitError::ExpiryTooFar(text.into()))?;
        return Ok(now.saturating_add(ms));
    }
    clock::parse_rfc3339(text).ok_or_else(|| PermitError::UnreadableExpiry(text.into()))
}

/// A humantime duration (`7d`, `12h`) in milliseconds.
fn duration_ms(text: &str) -> Result<Millis, PermitError> {
    let d =
        humantime::parse_duration(text.trim()).map_err(|e| PermitError::UnreadableRetention {
            text: text.into(),
            reason: e.to_string(),
        })?;
    i64::try_from(d.as_millis()).map_err(|_| PermitError::RetentionTooLong(text.into()))
}

/// A policy for tests and benchmarks: [`Policy::default`] changed by a setter per field.
/// Nothing is checked (an operator's policy goes through [`PolicySpec::validate`]).
#[cfg(any(test, feature = "test-support"))]
#[derive(Debug, Clone, Default)]
pub struct PolicyBuilder(Policy);

#[cfg(any(test, feature = "test-support"))]
impl Policy {
    pub fn builder() -> PolicyBuilder {
        PolicyBuilder::default()
    }
}

#[cfg(any(test, feature = "test-support"))]
impl PolicyBuilder {
    pub fn tools(mut self, tools: &[&str]) -> Self {
        self.0.rules.tools = tools.iter().map(|t| t.to_string()).collect();
        self
    }

    /// The cap of one tool.
    pub fn max_calls(mut self, tool: &str, n: u64) -> Self {
        self.0.rules.max_calls.insert(tool.into(), n);
        self
    }

    pub fn max_calls_default(mut self, n: u64) -> Self {
        self.0.rules.max_calls_default = Some(n);
        self
    }

    pub fn budget(mut self, budget: u64) -> Self {
        self.0.rules.budget = Some(budget);
        self
    }

    /// The cost rule of one tool.
    pub fn cost(mut self, tool: &str, rule: CostRule) -> Self {
        self.0.rules.cost.insert(tool.into(), rule);
        self
    }

    pub fn cost_default(mut self, n: u64) -> Self {
        self.0.rules.cost_default = n;
        self
    }

    pub fn duplicate_guard(mut self, mode: crate::model::GuardMode) -> Self {
        self.0.rules.duplicate_guard = mode;
        self
    }

    /// The approval rule of one tool.
    pub fn approval(mut self, tool: &str, rule: ApprovalRule) -> Self {
        self.0.rules.approval.insert(tool.into(), rule);
        self
    }

    pub fn retention_ms(mut self, ms: Millis) -> Self {
        self.0.retention_ms = ms;
        self
    }

    pub fn build(self) -> Policy {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::model::GuardMode;

    const NOW: Millis = 1_800_000_000_000;

    fn request(body: serde_json::Value) -> PermitRequest {
        serde_json::from_value(body).unwrap()
    }

    fn refusal(body: serde_json::Value) -> String {
        request(body).issue(NOW).unwrap_err().to_string()
    }

    #[test]
    fn a_request_with_a_label_and_an_expiry_gets_the_default_policy() {
        let (p, tok) = request(json!({"label": " agent ", "expires": "1h"}))
            .issue(NOW)
            .unwrap();
        assert_eq!(p.label, "agent");
        assert_eq!((p.created_at_ms, p.expires_at_ms), (NOW, NOW + 3_600_000));
        assert_eq!(p.policy, Policy::default());
        assert_eq!(p.policy.rules.tools, ["*"]);
        assert_eq!(p.policy.rules.duplicate_guard, GuardMode::Log);
        assert_eq!(p.policy.retention_ms, 7 * 24 * 3_600_000);
        assert!(tok.starts_with(&format!("atmp_{}_", p.id)));
        assert!(token::token_matches(&tok, &p.token_hash));
    }

    #[test]
    fn every_refusal_reads_as_the_admin_api_answers_it() {
        for (body, text) in [
            (
                json!({"label": " ", "expires": "1h"}),
                "label must not be empty",
            ),
            (
                json!({"label": "x", "expires": " yesterday "}),
                "expiry must be a duration like 24h or an RFC 3339 time, not \"yesterday\"",
            ),
            (
                json!({"label": "x", "expires": "2001-01-01T00:00:00Z"}),
                "expiry is in the past",
            ),
            (
                json!({"label": "x", "expires": "1h", "tools": []}),
                "tools must be a non-empty list of tool names, or [\"*\"]",
            ),
            (
                json!({"label": "x", "expires": "1h", "tools": ["a", " "]}),
                "tools must be a non-empty list of tool names, or [\"*\"]",
            ),
            (
                json!({"label": "x", "expires": "1h", "cost": {"pay": "amount"}}),
                "cost pointer for \"pay\" must start with '/'",
            ),
            (
                json!({"label": "x", "expires": "1h", "cost": {"pay": u64::MAX}}),
                "cost for \"pay\" is too large",
            ),
            (
                json!({"label": "x", "expires": "1h", "retention": "forever"}),
                "bad duration \"forever\": expected number at 0",
            ),
        ] {
            assert_eq!(refusal(body.clone()), text, "{body}");
        }
    }

    #[test]
    fn the_first_broken_rule_is_the_one_reported() {
        assert_eq!(
            refusal(json!({"label": "", "expires": "never", "tools": []})),
            "label must not be empty"
        );
        assert_eq!(
            refusal(json!({"label": "x", "expires": "1h", "tools": [], "retention": "x"})),
            "tools must be a non-empty list of tool names, or [\"*\"]"
        );
    }

    #[test]
    fn null_is_the_default_where_the_api_always_took_it() {
        let r = request(json!({"label": "x", "expires": "1h", "tools": null,
            "max_calls_default": null, "budget": null, "cost_default": null,
            "duplicate_guard": null, "retention": null}));
        assert_eq!(r.policy, PolicySpec::default());
    }

    #[test]
    fn the_stored_policy_keeps_its_json() {
        let policy = Policy::builder()
            .tools(&["pay"])
            .max_calls("pay", 2)
            .budget(100)
            .cost("pay", CostRule::Pointer("/amount".into()))
            .duplicate_guard(GuardMode::Enforce)
            .retention_ms(60_000)
            .build();
        let stored = serde_json::to_string(&policy).unwrap();
        assert_eq!(
            stored,
            r#"{"tools":["pay"],"max_calls":{"pay":2},"max_calls_default":null,"budget":100,"cost":{"pay":"/amount"},"cost_default":0,"duplicate_guard":"enforce","retention_ms":60000}"#
        );
        assert_eq!(serde_json::from_str::<Policy>(&stored).unwrap(), policy);
    }
}
