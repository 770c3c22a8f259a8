//! The approval events the webhook posts (docs/approvals.md, "The events").
//!
//! Every field of an event's type is always present, `null` when it has no value (`note`
//! without a note, `arguments` of an attempt stored without them); a field of another type
//! never appears. The constructors are the only way to make an event, so a type and its
//! fields cannot disagree.

use serde::Serialize;

use atmost_ledger::clock::{rfc3339, Millis};
use atmost_protocol::closed_set;

closed_set! {
    /// The `type` of an approval event.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum ApprovalEventType {
        /// A call waits for a person's approval.
        Requested => "approval.requested";
        /// A person approved it: the agent's retry under the same key may dispatch until `use_by`.
        Approved => "approval.approved";
        /// A person rejected it.
        Rejected => "approval.rejected";
    }
}

/// What every event says of the call waiting for approval.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ApprovalSubject {
    /// The attempt's id, which is the approval's (`att_…`).
    pub approval_id: String,
    pub permit_id: String,
    pub permit_label: String,
    pub tool: String,
    /// The call's cost, in the permit's minor units.
    pub cost: u64,
}

/// Who decided, when, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub by: String,
    pub at: Millis,
    pub note: Option<String>,
}

/// The fields of one type of event, in the order they are written after the subject's.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
enum Detail {
    Requested {
        arguments: Option<serde_json::Value>,
        requested_at: String,
        expires_at: String,
    },
    Approved {
        decided_by: String,
        decided_at: String,
        note: Option<String>,
        use_by: String,
    },
    Rejected {
        decided_by: String,
        decided_at: String,
        note: Option<String>,
    },
}

/// One event, as its JSON body is written (`serde_json::to_vec`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ApprovalEvent {
    #[serde(rename = "type")]
    kind: ApprovalEventType,
    #[serde(flatten)]
    subject: ApprovalSubject,
    #[serde(flatten)]
    detail: Detail,
}

impl ApprovalEvent {
    /// A new request for approval. `arguments` are the call's arguments as the admin API
    /// shows them, already redacted (`--redact-field`): the event carries them as given.
    pub fn requested(
        subject: ApprovalSubject,
        arguments: Option<serde_json::Value>,
        requested_at: Millis,
        expires_at: Millis,
    ) -> Self {
        ApprovalEvent {
            kind: ApprovalEventType::Requested,
            subject,
            detail: Detail::Requested {
                arguments,
                requested_at: rfc3339(requested_at),
                expires_at: rfc3339(expires_at),
            },
        }
    }

    /// An approval, which the agent's retry must use by `use_by`.
    pub fn approved(subject: ApprovalSubject, decision: Decision, use_by: Millis) -> Self {
        ApprovalEvent {
            kind: ApprovalEventType::Approved,
            subject,
            detail: Detail::Approved {
                decided_by: decision.by,
                decided_at: rfc3339(decision.at),
                note: decision.note,
                use_by: rfc3339(use_by),
            },
        }
    }

    /// A rejection.
    pub fn rejected(subject: ApprovalSubject, decision: Decision) -> Self {
        ApprovalEvent {
            kind: ApprovalEventType::Rejected,
            subject,
            detail: Detail::Rejected {
                decided_by: decision.by,
                decided_at: rfc3339(decision.at),
                note: decision.note,
            },
        }
    }

    pub fn event_type(&self) -> ApprovalEventType {
        self.kind
    }

    pub fn approval_id(&self) -> &str {
        &self.subject.approval_id
    }
}
