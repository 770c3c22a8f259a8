//! The counter moves of one transaction, summed per counter row and written once, just before
//! it commits.
//!
//! A group of decisions on one permit touches the same few counter rows every time: the tool's
//! slots, the permit's budget totals, its count of attempts per state. Written per decision,
//! PostgreSQL keeps a new version of each of those rows per write (all of them visible only to
//! the writing transaction, so none can be pruned before it ends, and every later write walks
//! them), and every store pays one statement per row per decision. Summed, a group writes each
//! row once. Reads inside the transaction add what is still pending to what is stored
//! ([`CounterMoves::slots`], [`CounterMoves::budget`]), so a decision sees the moves of the
//! decisions before it in its group.

use std::collections::BTreeMap;

use crate::decide;
use crate::model::{Attempt, AttemptState};

/// What an attempt counts for in its permit's counters: all the purge reads of one it deletes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Counted {
    pub id: String,
    pub permit_id: String,
    pub tool: String,
    pub state: AttemptState,
    pub cost: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CounterMoves {
    /// permit → tool → slots held.
    slots: BTreeMap<String, BTreeMap<String, i64>>,
    /// permit → (reserved, spent).
    budget: BTreeMap<String, (i64, i64)>,
    /// (permit, state) → attempts.
    states: BTreeMap<(String, AttemptState), i64>,
}

impl CounterMoves {
    /// Adds what writing `new` over `old` (`None`: a new attempt) moves.
    pub fn record(&mut self, old: Option<&Attempt>, new: &Attempt) {
        let d = decide::counter_delta(old, new);
        if d.slots != 0 {
            *self
                .slots
                .entry(new.permit_id.clone())
                .or_default()
                .entry(new.tool.clone())
                .or_default() += d.slots;
        }
        if d.reserved != 0 || d.spent != 0 {
            let b = self.budget.entry(new.permit_id.clone()).or_default();
            b.0 = b.0.saturating_add(d.reserved);
            b.1 = b.1.saturating_add(d.spent);
        }
        let before = old.map(|o| o.state);
        if before != Some(new.state) {
            if let Some(s) = before {
                *self.states.entry((new.permit_id.clone(), s)).or_default() -= 1;
            }
            *self
                .states
                .entry((new.permit_id.clone(), new.state))
                .or_default() += 1;
        }
    }

    /// Adds what deleting an attempt moves (the purge): everything it counted for is taken
    /// back, and its state counts one fewer.
    pub fn record_removal(&mut self, gone: &Counted) {
        let w = decide::counter_weight(gone.state, gone.cost);
        if w.slots != 0 {
            *self
                .slots
                .entry(gone.permit_id.clone())
                .or_default()
                .entry(gone.tool.clone())
                .or_default() -= w.slots;
        }
        if w.reserved != 0 || w.spent != 0 {
            let b = self.budget.entry(gone.permit_id.clone()).or_default();
            b.0 = b.0.saturating_sub(w.reserved);
            b.1 = b.1.saturating_sub(w.spent);
        }
        *self
            .states
            .entry((gone.permit_id.clone(), gone.state))
            .or_default() -= 1;
    }

    /// Adds another transaction part's moves (one whose writes succeeded).
    pub fn absorb(&mut self, other: CounterMoves) {
        for (permit, tools) in other.slots {
            let mine = self.slots.entry(permit).or_default();
            for (tool, v) in tools {
                *mine.entry(tool).or_default() += v;
            }
        }
        for (k, (r, s)) in other.budget {
            let b = self.budget.entry(k).or_default();
            b.0 = b.0.saturating_add(r);
            b.1 = b.1.saturating_add(s);
        }
        for (k, v) in other.states {
            *self.states.entry(k).or_default() += v;
        }
    }

    /// Slots of the permit's tool taken (or given back, negative) and not yet written.
    pub fn slots(&self, permit_id: &str, tool: &str) -> i64 {
        self.slots
            .get(permit_id)
            .and_then(|tools| tools.get(tool))
            .copied()
            .unwrap_or(0)
    }

    /// (reserved, spent) of the permit moved and not yet written.
    pub fn budget(&self, permit_id: &str) -> (i64, i64) {
        self.budget.get(permit_id).copied().unwrap_or_default()
    }

    /// The slot moves to write, zero sums left out, in key order (so concurrent writers take
    /// row locks in one order).
    pub fn slot_rows(&self) -> impl Iterator<Item = (&str, &str, i64)> {
        self.slots
            .iter()
            .flat_map(|(p, tools)| tools.iter().map(move |(t, v)| (p.as_str(), t.as_str(), *v)))
            .filter(|(_, _, v)| *v != 0)
    }

    /// The budget moves to write (permit, reserved, spent), zero sums left out, in permit order.
    pub fn budget_rows(&self) -> impl Iterator<Item = (&str, i64, i64)> {
        self.budget
            .iter()
            .filter(|(_, (r, s))| *r != 0 || *s != 0)
            .map(|(p, (r, s))| (p.as_str(), *r, *s))
    }

    /// The per-state count moves to write, zero sums left out, in key order.
    pub fn state_rows(&self) -> impl Iterator<Item = (&str, AttemptState, i64)> {
        self.states
            .iter()
            .filter(|(_, v)| **v != 0)
            .map(|((p, s), v)| (p.as_str(), *s, *v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attempt(id: &str, tool: &str, state: AttemptState, cost: u64) -> Attempt {
        Attempt::example(id, "p1", tool, state, cost)
    }

    #[test]
    fn a_group_of_reservations_sums_per_row() {
        let mut m = CounterMoves::default();
        for i in 0..3 {
            m.record(
                None,
                &attempt(&format!("a{i}"), "charge", AttemptState::InFlight, 5),
            );
        }
        m.record(None, &attempt("b", "refund", AttemptState::InFlight, 0));
        assert_eq!(m.slots("p1", "charge"), 3);
        assert_eq!(m.slots("p1", "refund"), 1);
        assert_eq!(m.slots("p2", "charge"), 0);
        assert_eq!(m.budget("p1"), (15, 0));
        let states: Vec<_> = m.state_rows().collect();
        assert_eq!(states, vec![("p1", AttemptState::InFlight, 4)]);
    }

    #[test]
    fn moves_that_cancel_out_write_nothing() {
        let mut m = CounterMoves::default();
        let reserved = attempt("a", "charge", AttemptState::InFlight, 5);
        m.record(None, &reserved);
        let released = attempt("a", "charge", AttemptState::Released, 5);
        m.record(Some(&reserved), &released);
        assert_eq!(m.slot_rows().count(), 0);
        assert_eq!(m.budget_rows().count(), 0);
        // in_flight +1 −1 cancels; released +1 stays.
        let states: Vec<_> = m.state_rows().collect();
        assert_eq!(states, vec![("p1", AttemptState::Released, 1)]);
    }

    #[test]
    fn completing_moves_budget_from_reserved_to_spent_and_keeps_the_slot() {
        let mut m = CounterMoves::default();
        let before = attempt("a", "charge", AttemptState::InFlight, 7);
        let after = attempt("a", "charge", AttemptState::Completed, 7);
        m.record(Some(&before), &after);
        assert_eq!(m.slots("p1", "charge"), 0);
        assert_eq!(m.budget_rows().collect::<Vec<_>>(), vec![("p1", -7, 7)]);
        let mut states: Vec<_> = m.state_rows().collect();
        states.sort_by_key(|(_, s, _)| s.as_str());
        assert_eq!(
            states,
            vec![
                ("p1", AttemptState::Completed, 1),
                ("p1", AttemptState::InFlight, -1)
            ]
        );
    }

    #[test]
    fn removing_an_attempt_takes_back_what_it_counted_for() {
        let mut m = CounterMoves::default();
        m.record(None, &attempt("a", "charge", AttemptState::Completed, 7));
        m.record(None, &attempt("b", "charge", AttemptState::Released, 3));
        for (id, state, cost) in [
            ("a", AttemptState::Completed, 7),
            ("b", AttemptState::Released, 3),
        ] {
            m.record_removal(&Counted {
                id: id.into(),
                permit_id: "p1".into(),
                tool: "charge".into(),
                state,
                cost,
            });
        }
        assert_eq!(m.slot_rows().count(), 0);
        assert_eq!(m.budget_rows().count(), 0);
        assert_eq!(m.state_rows().count(), 0);
    }

    #[test]
    fn absorbing_adds() {
        let mut group = CounterMoves::default();
        let mut part = CounterMoves::default();
        part.record(None, &attempt("a", "charge", AttemptState::InFlight, 2));
        group.absorb(part.clone());
        group.absorb(part);
        assert_eq!(group.slots("p1", "charge"), 2);
        assert_eq!(group.budget("p1"), (4, 0));
    }
}
