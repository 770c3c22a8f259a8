//! The ledger's records: permits and attempts.

use std::collections::BTreeMap;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::clock::Millis;
pub use atmost_protocol::{KeyCarrier, KeyCarriers};

atmost_protocol::closed_set! {
    /// What the duplicate guard does with a new key whose fingerprint matches a recent attempt.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    pub enum GuardMode {
        Off => "off";
        #[default]
        Log => "log";
        Enforce => "enforce";
    }
}

impl FromStr for GuardMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        GuardMode::from_wire(s).ok_or_else(|| {
            format!(
                "duplicate guard must be {}, not {s:?}",
                one_of(&GuardMode::NAMES)
            )
        })
    }
}

/// `a, b or c`: the names an error offers.
fn one_of(names: &[&str]) -> String {
    match names.split_last() {
        Some((last, [])) => (*last).to_string(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// How much one call to a tool costs against the permit's budget.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum CostRule {
    /// A fixed number of minor units.
    Fixed(u64),
    /// A JSON pointer (RFC 6901) into `arguments` that must hold a non-negative integer.
    Pointer(String),
}

impl FromStr for CostRule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.starts_with('/') {
            Ok(CostRule::Pointer(s.to_string()))
        } else {
            s.parse::<u64>().map(CostRule::Fixed).map_err(|_| {
                format!("cost must be a non-negative integer or a JSON pointer starting with '/', not {s:?}")
            })
        }
    }
}

/// When a permit asks a person to approve a new call of a tool (docs/approvals.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalRule {
    /// Every new call (`"always"`).
    Always,
    /// A call whose cost is more than this many minor units (`{"cost_above": N}`).
    CostAbove(u64),
}

impl ApprovalRule {
    /// Whether a call of this cost needs a person's approval.
    pub fn asks_for(self, cost: u64) -> bool {
        match self {
            ApprovalRule::Always => true,
            ApprovalRule::CostAbove(amount) => cost > amount,
        }
    }
}

impl FromStr for ApprovalRule {
    type Err = String;
    /// The CLI's spelling: `always` or `cost-above:N`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "always" {
            return Ok(ApprovalRule::Always);
        }
        s.strip_prefix("cost-above:")
            .and_then(|n| n.parse::<u64>().ok())
            .map(ApprovalRule::CostAbove)
            .ok_or_else(|| {
                format!("an approval rule is always or cost-above:N (N a non-negative integer), not {s:?}")
            })
    }
}

/// What calls a permit lets through and what they cost: the part of its policy that the
/// operator writes (`POST /admin/v1/permits`), the store keeps (the policy's JSON) and the admin
/// API shows in one shape. A field added here is taken, stored and shown with no other change;
/// its rule goes in [`crate::decide`], and what values it refuses in [`crate::policy`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallRules {
    /// Tool names, or `["*"]` for every tool (the default).
    #[serde(default = "every_tool", deserialize_with = "tools_or_every_tool")]
    pub tools: Vec<String>,
    #[serde(default)]
    pub max_calls: BTreeMap<String, u64>,
    #[serde(default)]
    pub max_calls_default: Option<u64>,
    /// Budget in integer minor units; `None` means no budget limit.
    #[serde(default)]
    pub budget: Option<u64>,
    #[serde(default)]
    pub cost: BTreeMap<String, CostRule>,
    #[serde(default, deserialize_with = "default_if_null")]
    pub cost_default: u64,
    #[serde(default, deserialize_with = "default_if_null")]
    pub duplicate_guard: GuardMode,
    /// The registered credential ([`crate::credentials`]) the filter sets on this permit's
    /// calls, by name; `None`: the permit names none, and its calls carry none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential: Option<String>,
    /// Per tool, when a person must approve a new call first; a tool not named here follows
    /// [`CallRules::approval_default`].
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub approval: BTreeMap<String, ApprovalRule>,
    /// The approval rule of every tool `approval` does not name; `None`: no approval.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval_default: Option<ApprovalRule>,
}

impl Default for CallRules {
    /// What a permit created with no rules allows: every tool, no cap, no budget, no cost,
    /// the duplicate guard logging.
    fn default() -> Self {
        CallRules {
            tools: every_tool(),
            max_calls: BTreeMap::new(),
            max_calls_default: None,
            budget: None,
            cost: BTreeMap::new(),
            cost_default: 0,
            duplicate_guard: GuardMode::default(),
            credential: None,
            approval: BTreeMap::new(),
            approval_default: None,
        }
    }
}

fn every_tool() -> Vec<String> {
    vec!["*".to_string()]
}

/// `null` is the default, as a missing field is (the admin API has always taken `null` for
/// these).
fn default_if_null<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

fn tools_or_every_tool<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    Ok(Option::<Vec<String>>::deserialize(d)?.unwrap_or_else(every_tool))
}

impl CallRules {
    pub fn allows_tool(&self, tool: &str) -> bool {
        self.tools.iter().any(|t| t == "*" || t == tool)
    }

    pub fn limit_for(&self, tool: &str) -> Option<u64> {
        self.max_calls.get(tool).copied().or(self.max_calls_default)
    }

    /// The approval rule for a tool, if a person must approve some of its calls.
    pub fn approval_for(&self, tool: &str) -> Option<ApprovalRule> {
        self.approval.get(tool).copied().or(self.approval_default)
    }

    pub fn cost_rule_for(&self, tool: &str) -> CostRule {
        self.cost
            .get(tool)
            .cloned()
            .unwrap_or(CostRule::Fixed(self.cost_default))
    }
}

/// The policy of a permit, as stored: its call rules and how long its receipts are kept.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    #[serde(flatten)]
    pub rules: CallRules,
    /// How long completed receipts stay replayable, in milliseconds.
    pub retention_ms: Millis,
}

/// A durable authorization an agent acts under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permit {
    pub id: String,
    /// Lowercase hex SHA-256 of the full token. The token itself is never stored.
    pub token_hash: String,
    pub label: String,
    pub created_at_ms: Millis,
    pub expires_at_ms: Millis,
    pub revoked_at_ms: Option<Millis>,
    pub policy: Policy,
}

impl Permit {
    pub fn status(&self, now: Millis) -> &'static str {
        if self.revoked_at_ms.is_some() {
            "revoked"
        } else if now >= self.expires_at_ms {
            "expired"
        } else {
            "active"
        }
    }
}

/// What an attempt in one state holds of its permit, and what may happen to it next: one
/// row of the attempt states table (docs/design.md#attempt-states).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateRules {
    /// The attempt holds one of its tool's slots.
    pub holds_slot: bool,
    /// The attempt's cost is reserved (not yet spent).
    pub reserves_budget: bool,
    /// The attempt's cost counts as spent.
    pub spends_budget: bool,
    /// The lease sweeper turns this state `uncertain` once its lease has run out.
    pub leased: bool,
    /// A stored receipt of this state is answered as a replay.
    pub replays: bool,
    /// The attempt gave its slot and budget back. Its key may be used again, but for an
    /// approval that was rejected or expired (docs/approvals.md), whose key keeps answering so.
    pub gave_back: bool,
    /// Nothing is left to happen to the attempt: no report, lease or resolution moves it.
    /// Once its permit has stopped authorizing for long enough, the purge may delete it
    /// (docs/design.md#purging-ended-permits).
    pub settled: bool,
}

/// A state's rules, by what it holds (the rows below read as the design's table).
const fn rules(
    holds_slot: bool,
    budget: Budget,
    leased: bool,
    replays: bool,
    settled: bool,
) -> StateRules {
    StateRules {
        holds_slot,
        reserves_budget: matches!(budget, Budget::Reserved),
        spends_budget: matches!(budget, Budget::Spent),
        leased,
        replays,
        gave_back: !holds_slot && matches!(budget, Budget::Returned),
        settled,
    }
}

/// Where an attempt's cost stands.
enum Budget {
    Reserved,
    Spent,
    Returned,
}

atmost_protocol::closed_set! {
    /// Where an attempt stands (docs/design.md#attempt-states), with its rules.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
    pub enum AttemptState: rules -> StateRules {
        //                                        slot   budget             leased replays settled
        InFlight => "in_flight",             rules(true,  Budget::Reserved, true,  false, false);
        Completed => "completed",            rules(true,  Budget::Spent,    false, true,  true);
        Released => "released",              rules(false, Budget::Returned, false, false, true);
        Uncertain => "uncertain",            rules(true,  Budget::Spent,    false, false, false);
        ResolvedExecuted => "resolved_executed", rules(true, Budget::Spent, false, true,  true);
        ResolvedNotExecuted => "resolved_not_executed", rules(false, Budget::Returned, false, false, true);
        /// MCP 2026-07-28: the upstream answered `input_required`; the attempt keeps its slot
        /// and reserved budget and waits for the continuation under the same key (which moves
        /// it back to `in_flight`). Past its lease the sweeper turns it `uncertain`.
        AwaitingInput => "awaiting_input",   rules(true,  Budget::Reserved, true,  false, false);
        /// The upstream accepted the call as a task (`CreateTaskResult`): the stored receipt is
        /// the task handle, replayed like a completed receipt; slot kept, budget spent.
        Accepted => "accepted",              rules(true,  Budget::Spent,    false, true,  true);
        /// A verifier at the tool refused the first round before the server got it, and
        /// proved it (an HMAC the ledger checked over the round's nonce): slot and budget
        /// back, and the same key may try again, as after `released`.
        RefusedAtTool => "refused_at_tool",  rules(false, Budget::Returned, false, false, true);
        /// The permit asks a person to approve the call (docs/approvals.md): slot and cost
        /// held, nothing sent. Its lease is the request's lapse time; past it the sweeper
        /// turns it `approval_expired`.
        AwaitingApproval => "awaiting_approval", rules(true, Budget::Reserved, true, false, false);
        /// A person approved it: the same key and fingerprint dispatch it, once (to
        /// `in_flight`). Its lease is the approval's use-by time, then `approval_expired`.
        Approved => "approved",              rules(true,  Budget::Reserved, true,  false, false);
        /// A person rejected it: nothing was sent, slot and cost back; its key answers
        /// `approval_rejected` from then on.
        ApprovalRejected => "approval_rejected", rules(false, Budget::Returned, false, false, true);
        /// Nobody decided in time, or the approval was not used in time: nothing was sent,
        /// slot and cost back; its key answers `approval_expired` from then on.
        ApprovalExpired => "approval_expired", rules(false, Budget::Returned, false, false, true);
    }
}

impl AttemptState {
    /// The stored names of the states for which `pred` holds, as an SQL list
    /// `('a','b')` (names are fixed identifiers, never user input).
    pub fn sql_list(pred: impl Fn(AttemptState) -> bool) -> String {
        let names: Vec<String> = AttemptState::ALL
            .into_iter()
            .filter(|s| pred(*s))
            .map(|s| format!("'{}'", s.as_str()))
            .collect();
        format!("({})", names.join(","))
    }

    /// A stored receipt of this state is answered as a replay.
    pub fn replays(self) -> bool {
        self.rules().replays
    }

    /// The lease sweeper turns this state `uncertain` once its lease has run out.
    pub fn leased(self) -> bool {
        self.rules().leased
    }

    /// The attempt holds one of its tool's slots.
    pub fn holds_slot(self) -> bool {
        self.rules().holds_slot
    }

    /// The attempt's cost is reserved (not yet spent).
    pub fn reserves_budget(self) -> bool {
        self.rules().reserves_budget
    }

    /// The attempt's cost counts as spent.
    pub fn spends_budget(self) -> bool {
        self.rules().spends_budget
    }

    /// The attempt gave its slot and budget back; its key may be used again.
    pub fn gave_back(self) -> bool {
        self.rules().gave_back
    }

    /// Nothing is left to happen to the attempt (see [`StateRules::settled`]).
    pub fn settled(self) -> bool {
        self.rules().settled
    }
}

impl FromStr for AttemptState {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        AttemptState::from_wire(s).ok_or_else(|| format!("unknown attempt state {s:?}"))
    }
}

/// Who settled an uncertain attempt, when and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resolution {
    pub executed: bool,
    /// The person's name, or the reconciler's (a rule's name).
    pub by: String,
    pub at_ms: Millis,
    pub note: Option<String>,
    pub source: ResolutionSource,
}

/// Whether a person or the reconciler settled an attempt, and on what evidence.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ResolutionSource {
    /// Someone checked the provider (the admin API, the CLI or the inbox).
    #[default]
    Person,
    /// The reconciler asked the provider's lookup tool; `provider_answer` is what it
    /// answered (its JSON, verbatim), kept as the evidence of the resolution.
    Reconciler { provider_answer: String },
}

impl ResolutionSource {
    /// The stored name: `person` or `reconciler`.
    pub fn as_str(&self) -> &'static str {
        match self {
            ResolutionSource::Person => "person",
            ResolutionSource::Reconciler { .. } => "reconciler",
        }
    }

    pub fn provider_answer(&self) -> Option<&str> {
        match self {
            ResolutionSource::Person => None,
            ResolutionSource::Reconciler { provider_answer } => Some(provider_answer),
        }
    }

    /// Reads the stored pair back; a row written before sources were kept has none and was
    /// resolved by a person.
    pub fn from_stored(
        source: Option<&str>,
        provider_answer: Option<String>,
    ) -> Result<Self, String> {
        match (source, provider_answer) {
            (None | Some("person"), None) => Ok(ResolutionSource::Person),
            (Some("reconciler"), Some(provider_answer)) => {
                Ok(ResolutionSource::Reconciler { provider_answer })
            }
            (s, a) => Err(format!(
                "resolution source {s:?} with{} a provider answer",
                if a.is_some() { "" } else { "out" }
            )),
        }
    }
}

/// One reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    pub id: String,
    pub permit_id: String,
    pub tool: String,
    /// Hex SHA-256 of the idempotency key; the raw key is never stored.
    pub key_hash: Option<String>,
    pub fingerprint: String,
    pub cost: u64,
    pub state: AttemptState,
    pub created_at_ms: Millis,
    pub updated_at_ms: Millis,
    pub lease_expires_at_ms: Millis,
    /// When the attempt reached `completed` or `resolved_executed`.
    pub finished_at_ms: Option<Millis>,
    pub receipt: Option<String>,
    /// The filter's (or sweeper's) reason for `released` / `uncertain`.
    pub reason: Option<String>,
    pub replay_count: u64,
    /// Set when the receipt was pruned past retention: the row stays as a tombstone.
    pub pruned_at_ms: Option<Millis>,
    pub resolution: Option<Resolution>,
    /// Which dispatch of the attempt is current: 1 for the call, one more per continuation.
    pub round: u32,
    /// SHA-256 (hex) of the current round's capability; only a report carrying that
    /// capability moves the attempt. `None` for attempts stored before rounds existed.
    pub capability_hash: Option<String>,
    /// The key's value the upstream received, as the filter said when it asked
    /// (for lookups at the provider; `None` without a key, under `upstream_key.mode: off`,
    /// or for attempts stored before it was kept).
    pub forwarded_key: Option<String>,
    /// Where the upstream received the forwarded key, as the filter said (kept with the
    /// value, from the same round). Empty when it reached no carrier and when the filter did
    /// not say (an older filter, an attempt stored before it was kept): either way no lookup
    /// may take the key as having reached the provider in any form.
    pub forwarded_key_carriers: KeyCarriers,
    /// `params.arguments` of the call as JSON text, as the filter sent them (shown redacted;
    /// dropped with the receipt past retention).
    pub arguments: Option<String>,
    /// Lowercase hex SHA-256 of the body the current round was signed over (the dispatch
    /// target's `body_sha256`): the ledger signs a round only over the body its attempt
    /// records. `None` for a round dispatched without a signature (`request_hold: body`) and
    /// for attempts stored before it was kept.
    pub dispatch_body_sha256: Option<String>,
    /// The credential (name, version) the dispatch of its first round carried; `None` when
    /// its permit names none, and for attempts stored before it was kept.
    pub credential: Option<CredentialUse>,
    /// The person's approval the call waited for, when its permit asked for one
    /// (docs/approvals.md); `None` for every other call.
    pub approval: Option<Approval>,
}

/// A call's approval: when it was asked for and what a person decided. It is part of the
/// call's attempt, so it is bound to the attempt's permit, tool, fingerprint and key, and the
/// attempt's one move from `approved` to `in_flight` consumes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Approval {
    pub requested_at_ms: Millis,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<ApprovalDecision>,
}

/// Who decided an approval, when, and how.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApprovalDecision {
    pub approved: bool,
    /// The admin's name (with the person an authenticating proxy named: `proxy:person`).
    pub by: String,
    pub at_ms: Millis,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// An approval as the admin API, the CLI and signed receipts show it: times in RFC 3339,
/// the decision by name (`approved`, `rejected`, or none while a person has not decided).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApprovalView {
    pub requested_at: String,
    #[serde(default)]
    pub decision: Option<String>,
    #[serde(default)]
    pub decided_by: Option<String>,
    #[serde(default)]
    pub decided_at: Option<String>,
    #[serde(default)]
    pub note: Option<String>,
}

impl From<&Approval> for ApprovalView {
    fn from(a: &Approval) -> Self {
        let d = a.decision.as_ref();
        ApprovalView {
            requested_at: crate::clock::rfc3339(a.requested_at_ms),
            decision: d.map(|d| if d.approved { "approved" } else { "rejected" }.to_string()),
            decided_by: d.map(|d| d.by.clone()),
            decided_at: d.map(|d| crate::clock::rfc3339(d.at_ms)),
            note: d.and_then(|d| d.note.clone()),
        }
    }
}

/// Which credential (name and version) a dispatch carried; kept with its attempt. How the
/// stores keep it in one column is in [`crate::credentials`], with the rule for its name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CredentialUse {
    pub name: String,
    pub version: u32,
}

#[cfg(any(test, feature = "test-support"))]
impl Attempt {
    /// An attempt for tests of what stores do with attempts: no key, no receipt, times at 0.
    pub fn example(id: &str, permit_id: &str, tool: &str, state: AttemptState, cost: u64) -> Self {
        Attempt {
            id: id.into(),
            permit_id: permit_id.into(),
            tool: tool.into(),
            key_hash: None,
            fingerprint: format!("fp-{id}"),
            cost,
            state,
            created_at_ms: 0,
            updated_at_ms: 0,
            lease_expires_at_ms: 0,
            finished_at_ms: None,
            receipt: None,
            reason: None,
            replay_count: 0,
            pruned_at_ms: None,
            resolution: None,
            round: 1,
            capability_hash: None,
            forwarded_key: None,
            forwarded_key_carriers: KeyCarriers::NONE,
            dispatch_body_sha256: None,
            arguments: None,
            credential: None,
            approval: None,
        }
    }
}

/// Slots held for one tool under one permit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ToolUsage {
    pub calls_made: u64,
}

/// Budget use under one permit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct BudgetTotals {
    pub spent: u64,
    pub reserved: u64,
}

/// Everything `permit show` reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PermitDetail {
    pub permit: Permit,
    /// Slots held per tool (tools with attempts or a configured cap).
    pub usage: BTreeMap<String, ToolUsage>,
    pub budget: BudgetTotals,
    pub attempts_by_state: BTreeMap<AttemptState, u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_and_budget_rules_per_state() {
        use AttemptState::*;
        for s in AttemptState::ALL {
            assert_eq!(s.holds_slot(), !s.gave_back(), "{s}");
            assert_eq!(
                s.holds_slot(),
                s.reserves_budget() || s.spends_budget(),
                "{s}"
            );
            assert_eq!(s.as_str().parse::<AttemptState>(), Ok(s));
        }
        assert!(Uncertain.holds_slot() && Uncertain.spends_budget());
        assert!(ResolvedNotExecuted.gave_back());
        assert!(AwaitingInput.holds_slot() && AwaitingInput.reserves_budget());
        assert!(Accepted.holds_slot() && Accepted.spends_budget() && Accepted.replays());
        assert!(AwaitingInput.leased() && InFlight.leased() && !Accepted.leased());
        assert_eq!(
            AttemptState::sql_list(AttemptState::reserves_budget),
            "('in_flight','awaiting_input','awaiting_approval','approved')"
        );
    }

    #[test]
    fn the_state_table_gives_each_rule_to_exactly_these_states() {
        let with = |rule: fn(AttemptState) -> bool| AttemptState::sql_list(rule);
        assert_eq!(
            with(AttemptState::holds_slot),
            "('in_flight','completed','uncertain','resolved_executed','awaiting_input','accepted','awaiting_approval','approved')"
        );
        assert_eq!(
            with(AttemptState::spends_budget),
            "('completed','uncertain','resolved_executed','accepted')"
        );
        assert_eq!(
            with(AttemptState::leased),
            "('in_flight','awaiting_input','awaiting_approval','approved')"
        );
        assert_eq!(
            with(AttemptState::replays),
            "('completed','resolved_executed','accepted')"
        );
        assert_eq!(
            with(AttemptState::gave_back),
            "('released','resolved_not_executed','refused_at_tool','approval_rejected','approval_expired')"
        );
        // Whatever a report, a lease or a resolution may still move stays: the purge keeps it.
        assert_eq!(
            with(AttemptState::settled),
            "('completed','released','resolved_executed','resolved_not_executed','accepted','refused_at_tool','approval_rejected','approval_expired')"
        );
    }

    #[test]
    fn guard_modes_read_their_names_and_refuse_others_by_name() {
        for mode in GuardMode::ALL {
            assert_eq!(mode.as_str().parse::<GuardMode>(), Ok(mode));
        }
        assert_eq!(GuardMode::default(), GuardMode::Log);
        assert_eq!(
            "loud".parse::<GuardMode>(),
            Err("duplicate guard must be off, log or enforce, not \"loud\"".to_string())
        );
    }

    #[test]
    fn cost_rule_parses_fixed_and_pointer() {
        assert_eq!("12".parse::<CostRule>(), Ok(CostRule::Fixed(12)));
        assert_eq!(
            "/amount".parse::<CostRule>(),
            Ok(CostRule::Pointer("/amount".into()))
        );
        assert!("-1".parse::<CostRule>().is_err());
        let json = serde_json::to_value(CostRule::Fixed(3)).unwrap();
        assert_eq!(json, serde_json::json!(3));
    }
}
