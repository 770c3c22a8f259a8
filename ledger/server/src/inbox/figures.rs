//! What the inbox's figures show, computed in one place: a permit's use against its caps and
//! budget (bars on the permits page) and an attempt's life on a time scale (the timeline on
//! its page). The templates only place what is here; every width and position is a
//! [`Pct`] of the figure's width, so a figure drawn at 100% of any screen keeps its text at
//! the text's size. Integer arithmetic throughout: no division by zero, no NaN.

use std::time::Duration;

use atmost_ledger::clock::{self, Millis};
use atmost_ledger::model::{Approval, Attempt, AttemptState};

use crate::api::PermitShowResponse;

/// A share of a figure's width, in hundredths of a percent (0 to 10 000); shown as SVG
/// length text, `37.50%`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Pct(u32);

impl Pct {
    pub const FULL: Pct = Pct(10_000);

    /// `part` of `whole`, at most the whole. A whole of 0 is full when anything is used of
    /// it (a cap of 0 that was passed) and empty otherwise.
    pub fn share(part: u64, whole: u64) -> Pct {
        if whole == 0 {
            return if part > 0 { Pct::FULL } else { Pct(0) };
        }
        let hundredths = u128::from(part.min(whole)) * 10_000 / u128::from(whole);
        Pct(u32::try_from(hundredths).unwrap_or(10_000))
    }

    /// Where `t` falls between `start` and `end`, inside the margins a mark needs at either
    /// edge ([`EDGE`]); a scale of no length puts everything at its start.
    fn on_scale(t: Millis, start: Millis, end: Millis) -> Pct {
        let length = i128::from(end) - i128::from(start);
        let inner = i128::from(10_000 - 2 * EDGE.0);
        let offset = if length <= 0 {
            0
        } else {
            ((i128::from(t) - i128::from(start)).clamp(0, length) * inner) / length
        };
        Pct(EDGE.0 + u32::try_from(offset).unwrap_or(0))
    }

    fn minus(self, other: Pct) -> Pct {
        Pct(self.0.saturating_sub(other.0))
    }

    /// In hundredths of a percent (for tests).
    pub fn hundredths(self) -> u32 {
        self.0
    }
}

impl std::fmt::Display for Pct {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{:02}%", self.0 / 100, self.0 % 100)
    }
}

/// The margin left at each end of a time scale, so marks at its ends are drawn whole.
pub const EDGE: Pct = Pct(200);

/// One tool's calls against its cap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolMeter {
    pub tool: String,
    pub used: u64,
    /// The cap as text: the number, or `no cap`.
    pub limit: String,
    /// The used part of the bar; `None` for a tool without a cap (nothing to fill).
    pub bar: Option<Pct>,
    /// Every slot is taken: the next new call is denied.
    pub full: bool,
    /// What the bar says, in words (its accessible name).
    pub summary: String,
}

impl ToolMeter {
    pub fn new(tool: &str, used: u64, cap: Option<u64>) -> ToolMeter {
        let summary = match cap {
            Some(c) => format!("{tool}: {used} of {c} calls used"),
            None => format!("{tool}: {used} calls used, no cap"),
        };
        ToolMeter {
            tool: tool.to_string(),
            used,
            limit: cap.map_or_else(|| "no cap".into(), |c| c.to_string()),
            bar: cap.map(|c| Pct::share(used, c)),
            full: cap.is_some_and(|c| used >= c),
            summary,
        }
    }
}

/// The budget's parts, stacked in one bar: spent, then reserved, then what is left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetBar {
    pub spent: Pct,
    /// Where the reserved part starts (the end of the spent part).
    pub reserved_x: Pct,
    pub reserved: Pct,
    pub left_x: Pct,
    pub left: Pct,
}

/// A permit's budget: the figures as text, and the bar when there is a budget to fill.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetMeter {
    /// The budget as text: the number, or `no limit`.
    pub total: String,
    pub spent: u64,
    pub reserved: u64,
    /// What is left as text: the number, or `no limit`.
    pub left: String,
    pub bar: Option<BudgetBar>,
    pub summary: String,
}

impl BudgetMeter {
    pub fn new(budget: Option<u64>, spent: u64, reserved: u64) -> BudgetMeter {
        let Some(total) = budget else {
            return BudgetMeter {
                total: "no limit".into(),
                spent,
                reserved,
                left: "no limit".into(),
                bar: None,
                summary: format!("No budget limit: {spent} spent, {reserved} reserved"),
            };
        };
        let left = total.saturating_sub(spent.saturating_add(reserved));
        let spent_part = Pct::share(spent, total);
        // What the spent part leaves of the bar bounds the reserved part, so the two never
        // draw past its end.
        let reserved_part = Pct::share(reserved, total).min(Pct::FULL.minus(spent_part));
        let left_x = Pct(spent_part.0 + reserved_part.0);
        BudgetMeter {
            total: total.to_string(),
            spent,
            reserved,
            left: left.to_string(),
            bar: Some(BudgetBar {
                spent: spent_part,
                reserved_x: spent_part,
                reserved: reserved_part,
                left_x,
                left: Pct::share(left, total).min(Pct::FULL.minus(left_x)),
            }),
            summary: format!("Budget {total}: {spent} spent, {reserved} reserved, {left} left"),
        }
    }
}

/// A permit's figures, as its card on the permits page draws them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PermitFigures {
    pub tools: Vec<ToolMeter>,
    pub budget: BudgetMeter,
}

impl PermitFigures {
    pub fn new(shown: &PermitShowResponse) -> PermitFigures {
        PermitFigures {
            tools: shown
                .usage
                .iter()
                .map(|(tool, u)| ToolMeter::new(tool, u.calls_made, u.limit))
                .collect(),
            budget: BudgetMeter::new(
                shown.budget.budget,
                shown.budget.spent,
                shown.budget.reserved,
            ),
        }
    }
}

atmost_protocol::closed_set! {
    /// What a mark on an attempt's timeline stands for (its class on the page).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum MarkKind {
        /// Round 1 dispatched: the attempt was created (or its approval used).
        Sent => "sent";
        /// The permit asked a person to approve the call (the attempt was created).
        Asked => "asked";
        /// A person approved or rejected it.
        Decided => "decided";
        /// A continuation round dispatched (known for the current round while in flight).
        Dispatched => "dispatched";
        /// The current round's outcome: the state the attempt entered.
        Outcome => "outcome";
        /// A person or the reconciler settled the uncertain attempt.
        Resolved => "resolved";
        /// When the current lease runs out (the sweeper then turns it uncertain).
        LeaseEnds => "lease-ends";
        /// Its receipt was dropped past retention.
        Pruned => "pruned";
        /// The time the page was drawn (an attempt still open).
        Now => "now";
    }
}

/// One mark on the timeline, on a row of its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mark {
    pub kind: MarkKind,
    /// Drawn beside the mark (a few words).
    pub label: String,
    /// Said in the list under the figure.
    pub detail: String,
    pub at_ms: Millis,
    /// RFC 3339.
    pub at: String,
    /// Time since the first dispatch, as people read it.
    pub after: String,
    pub x: Pct,
    /// The previous mark's position: the row's line runs from there to this mark.
    pub from_x: Pct,
    pub y: u32,
    /// Its label goes left of the mark (past the middle) or right of it.
    pub label_left: bool,
    /// Not yet reached (a lease still running).
    pub ahead: bool,
}

impl Mark {
    pub fn kind_name(&self) -> &'static str {
        self.kind.as_str()
    }
}

/// Height of one row of the timeline, in px.
const ROW: u32 = 26;
/// The first row's centre, in px.
const TOP: u32 = 14;

/// An attempt's life on one time scale, from its first dispatch to its last recorded change
/// (to now while it is open).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Timeline {
    pub marks: Vec<Mark>,
    pub start: String,
    pub end: String,
    /// The scale's length, as people read it.
    pub length: String,
    pub axis_y: u32,
    pub height: u32,
    /// Where [`MarkKind::Now`] is, for the line drawn across every row.
    pub now_x: Option<Pct>,
    /// The attempt's current round (1: never continued).
    pub rounds: u32,
    /// Rounds whose dispatch time the ledger does not keep (it keeps the first dispatch and
    /// the latest change): said under the figure.
    pub untimed_rounds: Option<String>,
    /// What the figure says in words (its accessible name).
    pub summary: String,
}

/// Why a timeline has no mark for some rounds.
const KEPT_TIMES: &str =
    "the ledger keeps the time of the first dispatch and of the latest change only.";

/// `Round 2 was` or `Rounds 2 to n were`.
fn rounds_were(last: u32) -> String {
    if last <= 2 {
        "Round 2 was".into()
    } else {
        format!("Rounds 2 to {last} were")
    }
}

/// The words for an attempt's current state on its timeline: (label, detail).
fn outcome_words(a: &Attempt) -> (String, String) {
    let why = a
        .reason
        .as_deref()
        .map(|r| format!(" ({r})"))
        .unwrap_or_default();
    let round = a.round;
    match a.state {
        AttemptState::Completed => (
            "completed".into(),
            format!("Round {round} answered: completed, its receipt kept"),
        ),
        AttemptState::Accepted => (
            "accepted".into(),
            format!("Round {round} answered: accepted as a task"),
        ),
        AttemptState::AwaitingInput => (
            "input required".into(),
            format!("Round {round} answered input_required: waiting for the continuation"),
        ),
        AttemptState::Released => (
            "released".into(),
            format!("Released: the slot and budget came back{why}"),
        ),
        AttemptState::Uncertain => (
            "uncertain".into(),
            format!("Uncertain: sent, its answer lost{why}"),
        ),
        AttemptState::RefusedAtTool => (
            "refused at the tool".into(),
            format!("Refused by the verifier at the tool, which proved it: the tool never ran it, the slot and budget came back{why}"),
        ),
        AttemptState::AwaitingApproval => (
            "awaiting approval".into(),
            "Waiting for a person's approval: its slot and cost held, nothing sent".into(),
        ),
        AttemptState::Approved => (
            "approved".into(),
            "Approved: the agent's retry with the same key sends it, once".into(),
        ),
        AttemptState::ApprovalRejected => (
            "rejected".into(),
            "Rejected by a person: nothing sent, the slot and budget came back".into(),
        ),
        AttemptState::ApprovalExpired => (
            "approval lapsed".into(),
            format!("The approval lapsed: nothing sent, the slot and budget came back{why}"),
        ),
        other => (other.as_str().into(), other.as_str().into()),
    }
}

/// The first marks of a call that waited for a person: asked, decided, and sent when the
/// approval was used (its dispatch is the attempt's latest change while it is in flight).
fn approval_marks(a: &Attempt, approval: &Approval) -> Vec<(MarkKind, String, String, Millis)> {
    let mut marks = vec![(
        MarkKind::Asked,
        "approval asked".into(),
        "The permit asked a person to approve the call: its slot and cost held, nothing sent"
            .into(),
        approval.requested_at_ms,
    )];
    if let Some(d) = &approval.decision {
        let (label, verb) = if d.approved {
            ("approved", "Approved")
        } else {
            ("rejected", "Rejected")
        };
        let note = d
            .note
            .as_deref()
            .map(|n| format!(": {n}"))
            .unwrap_or_default();
        marks.push((
            MarkKind::Decided,
            label.into(),
            format!("{verb} by {}{note}", d.by),
            d.at_ms,
        ));
    }
    if a.state == AttemptState::InFlight && a.round == 1 {
        marks.push((
            MarkKind::Sent,
            "sent".into(),
            "The approved call dispatched to the upstream".into(),
            a.updated_at_ms,
        ));
    }
    marks
}

impl Timeline {
    pub fn new(a: &Attempt, now: Millis) -> Timeline {
        let mut marks: Vec<(MarkKind, String, String, Millis)> = match &a.approval {
            // A call that waited for a person was asked for first, and sent (if ever) after.
            Some(approval) => approval_marks(a, approval),
            None => vec![(
                MarkKind::Sent,
                "sent".into(),
                "Round 1 dispatched to the upstream".into(),
                a.created_at_ms,
            )],
        };
        match a.state {
            AttemptState::InFlight if a.round > 1 => marks.push((
                MarkKind::Dispatched,
                format!("round {}", a.round),
                format!("Round {} (a continuation) dispatched", a.round),
                a.updated_at_ms,
            )),
            AttemptState::InFlight => {}
            AttemptState::ResolvedExecuted | AttemptState::ResolvedNotExecuted => {
                if let Some(r) = &a.resolution {
                    let (label, what) = if r.executed {
                        ("resolved: ran", "executed")
                    } else {
                        ("resolved: not run", "not executed")
                    };
                    let by = match r.source.provider_answer() {
                        Some(_) => format!("{} (reconciler)", r.by),
                        None => r.by.clone(),
                    };
                    marks.push((
                        MarkKind::Resolved,
                        label.into(),
                        format!("Resolved by {by}: {what}"),
                        r.at_ms,
                    ));
                }
            }
            AttemptState::Completed | AttemptState::Accepted => {
                let (label, detail) = outcome_words(a);
                marks.push((
                    MarkKind::Outcome,
                    label,
                    detail,
                    // A pruned attempt's last change is the pruning.
                    a.finished_at_ms.unwrap_or(a.updated_at_ms),
                ));
            }
            AttemptState::AwaitingApproval | AttemptState::Approved => {}
            AttemptState::Released
            | AttemptState::RefusedAtTool
            | AttemptState::Uncertain
            | AttemptState::AwaitingInput
            | AttemptState::ApprovalRejected
            | AttemptState::ApprovalExpired => {
                let (label, detail) = outcome_words(a);
                marks.push((MarkKind::Outcome, label, detail, a.updated_at_ms));
            }
        }
        if matches!(
            a.state,
            AttemptState::AwaitingApproval | AttemptState::Approved
        ) {
            marks.push((
                MarkKind::LeaseEnds,
                "approval lapses".into(),
                if a.state == AttemptState::Approved {
                    "Unless the agent's retry uses the approval by then, it lapses and the slot comes back"
                } else {
                    "Unless a person decides by then, the request lapses and the slot comes back"
                }
                .into(),
                a.lease_expires_at_ms,
            ));
        } else if a.state.leased() {
            let ran_out = a.lease_expires_at_ms <= now;
            marks.push((
                MarkKind::LeaseEnds,
                "lease ends".into(),
                if ran_out {
                    "The lease ran out (the next sweep turns the attempt uncertain)".into()
                } else {
                    "The lease runs out: without an outcome by then, the attempt turns uncertain"
                        .into()
                },
                a.lease_expires_at_ms,
            ));
        }
        if let Some(at) = a.pruned_at_ms {
            marks.push((
                MarkKind::Pruned,
                "receipt dropped".into(),
                "Its receipt and arguments were dropped past the permit's retention".into(),
                at,
            ));
        }
        let open = matches!(
            a.state,
            AttemptState::InFlight
                | AttemptState::AwaitingInput
                | AttemptState::Uncertain
                | AttemptState::AwaitingApproval
                | AttemptState::Approved
        );
        if open {
            marks.push((
                MarkKind::Now,
                "now".into(),
                "This page was drawn".into(),
                now,
            ));
        }
        // In time order; marks at the same time keep the order they happened in.
        marks.sort_by_key(|m| m.3);

        let start = a.created_at_ms;
        let end = marks.iter().map(|m| m.3).max().unwrap_or(start).max(start);
        let mut from_x = EDGE;
        let placed: Vec<Mark> = marks
            .into_iter()
            .zip(0u32..)
            .map(|((kind, label, detail, at_ms), row)| {
                let x = Pct::on_scale(at_ms, start, end);
                let mark = Mark {
                    kind,
                    label,
                    detail,
                    at_ms,
                    at: clock::rfc3339(at_ms),
                    after: format!("+{}", span(at_ms.saturating_sub(start))),
                    x,
                    from_x,
                    y: TOP + row * ROW,
                    label_left: x > Pct(5_000),
                    ahead: at_ms > now,
                };
                from_x = x;
                mark
            })
            .collect();
        let rows = u32::try_from(placed.len()).unwrap_or(0);
        let axis_y = TOP + rows * ROW - ROW / 2;
        let untimed_rounds = match (a.round, a.state) {
            (0 | 1, _) | (2, AttemptState::InFlight) => None,
            (n, AttemptState::InFlight) => Some(format!(
                "{} dispatched before round {n}; {KEPT_TIMES}",
                rounds_were(n - 1)
            )),
            (n, _) => Some(format!(
                "{} dispatched between the first dispatch and the latest change; {KEPT_TIMES}",
                rounds_were(n)
            )),
        };
        let length = span(end.saturating_sub(start));
        Timeline {
            now_x: placed.iter().find(|m| m.kind == MarkKind::Now).map(|m| m.x),
            summary: format!(
                "Timeline over {length}: {}",
                placed
                    .iter()
                    .map(|m| format!("{} at +{}", m.label, m.after.trim_start_matches('+')))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            marks: placed,
            start: clock::rfc3339(start),
            end: clock::rfc3339(end),
            length,
            axis_y,
            height: axis_y + 22,
            rounds: a.round,
            untimed_rounds,
        }
    }
}

/// A span of time as people read it: `3m 12s`, `2h 5m` (whole seconds).
pub fn span(ms: Millis) -> String {
    let secs = u64::try_from(ms.max(0) / 1000).unwrap_or(0);
    humantime::format_duration(Duration::from_secs(secs)).to_string()
}

#[cfg(test)]
mod tests;
