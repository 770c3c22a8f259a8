//! Tests of the inbox's figures: permit bars and attempt timelines.

use super::*;
use atmost_ledger::model::{Resolution, ResolutionSource};

#[test]
fn shares_are_exact_bounded_and_never_divide_by_zero() {
    assert_eq!(Pct::share(1, 4).to_string(), "25.00%");
    assert_eq!(Pct::share(2, 3).to_string(), "66.66%");
    assert_eq!(Pct::share(0, 7).to_string(), "0.00%");
    assert_eq!(Pct::share(7, 7), Pct::FULL);
    // Past the whole: drawn full, never wider.
    assert_eq!(Pct::share(9, 7), Pct::FULL);
    // A whole of zero: empty, or full once anything is used of it.
    assert_eq!(Pct::share(0, 0), Pct(0));
    assert_eq!(Pct::share(1, 0), Pct::FULL);
    // The largest figures do not overflow.
    assert_eq!(Pct::share(u64::MAX, u64::MAX), Pct::FULL);
    assert_eq!(Pct::share(u64::MAX / 2, u64::MAX).to_string(), "49.99%");
    assert_eq!(Pct(5).to_string(), "0.05%");
}

#[test]
fn a_tool_meter_fills_used_over_cap_and_has_no_bar_without_a_cap() {
    let m = ToolMeter::new("pay", 2, Some(3));
    assert_eq!(m.bar, Some(Pct(6666)));
    assert_eq!(
        (m.limit.as_str(), m.full, m.summary.as_str()),
        ("3", false, "pay: 2 of 3 calls used")
    );
    assert!(ToolMeter::new("pay", 3, Some(3)).full);
    let over = ToolMeter::new("pay", 5, Some(3));
    assert_eq!((over.bar, over.full), (Some(Pct::FULL), true));
    let zero = ToolMeter::new("blocked", 0, Some(0));
    assert_eq!((zero.bar, zero.full), (Some(Pct(0)), true));
    let free = ToolMeter::new("search", 12, None);
    assert_eq!(
        (free.bar, free.full, free.limit.as_str()),
        (None, false, "no cap")
    );
    assert_eq!(free.summary, "search: 12 calls used, no cap");
}

#[test]
fn the_budget_bar_stacks_spent_reserved_and_left_to_the_whole() {
    let m = BudgetMeter::new(Some(1000), 350, 200);
    let bar = m.bar.unwrap();
    assert_eq!(
        (
            bar.spent,
            bar.reserved_x,
            bar.reserved,
            bar.left_x,
            bar.left
        ),
        (Pct(3500), Pct(3500), Pct(2000), Pct(5500), Pct(4500))
    );
    assert_eq!((m.total.as_str(), m.left.as_str()), ("1000", "450"));
    assert_eq!(m.summary, "Budget 1000: 350 spent, 200 reserved, 450 left");
    // Nothing used: all left.
    let fresh = BudgetMeter::new(Some(10), 0, 0).bar.unwrap();
    assert_eq!((fresh.spent, fresh.left), (Pct(0), Pct::FULL));
    // More taken than the budget: the parts still end at the bar's end.
    let over = BudgetMeter::new(Some(100), 80, 50);
    let bar = over.bar.unwrap();
    assert_eq!(
        (bar.spent, bar.reserved, bar.left_x, bar.left),
        (Pct(8000), Pct(2000), Pct::FULL, Pct(0))
    );
    assert_eq!(over.left, "0");
    // A budget of 0: no part has any width.
    let zero = BudgetMeter::new(Some(0), 0, 0).bar.unwrap();
    assert_eq!(
        (zero.spent, zero.reserved, zero.left),
        (Pct(0), Pct(0), Pct(0))
    );
    // No budget: figures, no bar.
    let none = BudgetMeter::new(None, 40, 5);
    assert_eq!(none.bar, None);
    assert_eq!(
        (none.total.as_str(), none.left.as_str()),
        ("no limit", "no limit")
    );
    assert_eq!(none.summary, "No budget limit: 40 spent, 5 reserved");
}

const T0: Millis = 1_767_225_600_000; // 2026-01-01T00:00:00Z

fn attempt(state: AttemptState) -> Attempt {
    let mut a = Attempt::example("att-1", "pmt-1", "pay", state, 10);
    a.created_at_ms = T0;
    a.updated_at_ms = T0;
    a.lease_expires_at_ms = T0 + 30_000;
    a
}

fn kinds(t: &Timeline) -> Vec<&'static str> {
    t.marks.iter().map(Mark::kind_name).collect()
}

#[test]
fn an_uncertain_attempt_runs_from_its_dispatch_to_now() {
    let mut a = attempt(AttemptState::Uncertain);
    a.updated_at_ms = T0 + 20_000;
    a.reason = Some("upstream_reset".into());
    let t = Timeline::new(&a, T0 + 80_000);
    assert_eq!(kinds(&t), ["sent", "outcome", "now"]);
    let x: Vec<u32> = t.marks.iter().map(|m| m.x.hundredths()).collect();
    // 2% + 96% × 20/80 = 26%.
    assert_eq!(x, [200, 2600, 9800]);
    assert_eq!(t.marks[1].from_x, Pct(200));
    assert_eq!(t.marks[2].from_x, Pct(2600));
    assert_eq!(
        t.marks[1].detail,
        "Uncertain: sent, its answer lost (upstream_reset)"
    );
    assert_eq!(t.marks[1].after, "+20s");
    assert_eq!(t.length, "1m 20s");
    assert_eq!(
        (t.start.as_str(), t.end.as_str()),
        ("2026-01-01T00:00:00.000Z", "2026-01-01T00:01:20.000Z")
    );
    assert_eq!(t.now_x, Some(Pct(9800)));
    assert!(!t.marks[1].label_left && t.marks[2].label_left);
    assert_eq!(
        t.marks.iter().map(|m| m.y).collect::<Vec<_>>(),
        [14, 40, 66]
    );
    assert_eq!((t.axis_y, t.height), (79, 101));
    assert_eq!(t.untimed_rounds, None);
    assert_eq!(
        t.summary,
        "Timeline over 1m 20s: sent at +0s, uncertain at +20s, now at +1m 20s"
    );
}

#[test]
fn a_continued_attempt_in_flight_shows_its_round_and_its_lease_ahead() {
    let mut a = attempt(AttemptState::InFlight);
    a.round = 2;
    a.updated_at_ms = T0 + 10_000;
    a.lease_expires_at_ms = T0 + 40_000;
    let t = Timeline::new(&a, T0 + 20_000);
    assert_eq!(kinds(&t), ["sent", "dispatched", "now", "lease-ends"]);
    assert_eq!(t.marks[1].label, "round 2");
    let lease = &t.marks[3];
    assert!(lease.ahead && !t.marks[2].ahead);
    // The scale reaches the lease's end; now is half way.
    assert_eq!(t.now_x, Some(Pct(200 + 4800)));
    assert_eq!(lease.x, Pct(9800));
    assert_eq!(t.untimed_rounds, None);
    a.round = 4;
    assert_eq!(
        Timeline::new(&a, T0 + 20_000).untimed_rounds.as_deref(),
        Some("Rounds 2 to 3 were dispatched before round 4; the ledger keeps the time of the first dispatch and of the latest change only.")
    );
    a.round = 3;
    assert_eq!(
        Timeline::new(&a, T0 + 20_000).untimed_rounds.as_deref(),
        Some("Round 2 was dispatched before round 3; the ledger keeps the time of the first dispatch and of the latest change only.")
    );
}

#[test]
fn a_resolved_attempt_ends_at_its_resolution_and_names_who_resolved_it() {
    let mut a = attempt(AttemptState::ResolvedNotExecuted);
    a.round = 3;
    a.updated_at_ms = T0 + 90_000;
    a.resolution = Some(Resolution {
        executed: false,
        by: "<b>Ana</b>".into(),
        at_ms: T0 + 90_000,
        note: None,
        source: ResolutionSource::Person,
    });
    let t = Timeline::new(&a, T0 + 500_000);
    assert_eq!(kinds(&t), ["sent", "resolved"]);
    assert_eq!(t.marks[1].detail, "Resolved by <b>Ana</b>: not executed");
    assert_eq!(t.marks[1].x, Pct(9800));
    assert_eq!(t.now_x, None);
    assert!(t
        .untimed_rounds
        .unwrap()
        .starts_with("Rounds 2 to 3 were dispatched"));
    // By the reconciler.
    a.state = AttemptState::ResolvedExecuted;
    a.resolution = Some(Resolution {
        executed: true,
        by: "stripe-lookup".into(),
        at_ms: T0 + 90_000,
        note: None,
        source: ResolutionSource::Reconciler {
            provider_answer: "{}".into(),
        },
    });
    let t = Timeline::new(&a, T0 + 500_000);
    assert_eq!(t.marks[1].label, "resolved: ran");
    assert_eq!(
        t.marks[1].detail,
        "Resolved by stripe-lookup (reconciler): executed"
    );
}

#[test]
fn a_refusal_at_the_tool_is_its_own_outcome_on_the_timeline() {
    let mut a = attempt(AttemptState::RefusedAtTool);
    a.reason = Some("refused_at_tool: signature_key_unknown".into());
    a.updated_at_ms = T0 + 2_000;
    let t = Timeline::new(&a, T0 + 9_000);
    assert_eq!(kinds(&t), ["sent", "outcome"]);
    assert_eq!(t.marks[1].label, "refused at the tool");
    assert!(
        t.marks[1].detail.contains("the tool never ran it")
            && t.marks[1].detail.contains("signature_key_unknown"),
        "{}",
        t.marks[1].detail
    );
}

#[test]
fn a_scale_of_no_length_puts_every_mark_at_its_start() {
    // Released in the same millisecond it was sent: nothing to divide by.
    let mut a = attempt(AttemptState::Released);
    a.reason = Some("upstream_refused".into());
    let t = Timeline::new(&a, T0);
    assert_eq!(kinds(&t), ["sent", "outcome"]);
    assert!(t.marks.iter().all(|m| m.x == EDGE && m.from_x == EDGE));
    assert_eq!(t.length, "0s");
    // A clock that went back: still on the scale.
    let mut a = attempt(AttemptState::Uncertain);
    a.updated_at_ms = T0 - 5_000;
    let t = Timeline::new(&a, T0 - 10_000);
    assert!(t.marks.iter().all(|m| m.x == EDGE), "{:?}", t.marks);
}

#[test]
fn a_completed_and_pruned_attempt_keeps_its_finish_time() {
    let mut a = attempt(AttemptState::Completed);
    a.finished_at_ms = Some(T0 + 1_000);
    a.pruned_at_ms = Some(T0 + 3_000);
    a.updated_at_ms = T0 + 3_000;
    let t = Timeline::new(&a, T0 + 9_000);
    assert_eq!(kinds(&t), ["sent", "outcome", "pruned"]);
    assert_eq!(t.marks[1].at_ms, T0 + 1_000);
    assert_eq!(t.marks[1].x, Pct(200 + 3200));
    assert_eq!(t.end, "2026-01-01T00:00:03.000Z");
}

#[test]
fn a_waiting_attempt_shows_the_input_asked_and_its_lease() {
    let mut a = attempt(AttemptState::AwaitingInput);
    a.updated_at_ms = T0 + 2_000;
    a.lease_expires_at_ms = T0 + 32_000;
    let t = Timeline::new(&a, T0 + 60_000);
    assert_eq!(kinds(&t), ["sent", "outcome", "lease-ends", "now"]);
    assert_eq!(t.marks[1].label, "input required");
    assert!(t.marks[2].detail.starts_with("The lease ran out"));
    assert!(!t.marks[2].ahead);
}
