//! The snapshot an authorize decision reads, assembled one way for every store.
//!
//! A store supplies the reads ([`SnapshotReads`]: SQLite queries each one when asked;
//! PostgreSQL looks it up among what it read for a whole batch) and the counter moves its
//! transaction made but has not written yet ([`PendingMoves`]). [`assemble`] decides what is
//! read, following [`decide::reads_needed`], and adds the pending moves to the stored counters,
//! so every store feeds [`decide::decide`] the same snapshot.

use atmost_protocol::AuthorizeRequest;

use crate::clock::Millis;
use crate::decide::{self, Snapshot};
use crate::error::LedgerError;
use crate::model::{Attempt, BudgetTotals, Permit, ToolUsage};
use crate::store::counters::CounterMoves;

/// The permit a call's token names, as read, and whether the token authenticates for it.
#[derive(Debug, Clone, Copy)]
pub enum PermitRead<'a> {
    /// The token names no permit, or no permit has its id.
    Unknown,
    /// The permit exists and the token does not authenticate for it (wrong secret, revoked):
    /// nothing else is read.
    Refused(&'a Permit),
    Authenticated(&'a Permit),
}

impl<'a> PermitRead<'a> {
    /// Checks the token against the permit read by the token's id.
    pub fn check(token: &str, permit: Option<&'a Permit>) -> Self {
        match permit {
            None => PermitRead::Unknown,
            Some(p) if decide::authenticate(token, Some(p)).is_some() => {
                PermitRead::Authenticated(p)
            }
            Some(p) => PermitRead::Refused(p),
        }
    }

    /// The permit, when the token authenticates for it.
    pub fn authenticated(self) -> Option<&'a Permit> {
        match self {
            PermitRead::Authenticated(p) => Some(p),
            PermitRead::Unknown | PermitRead::Refused(_) => None,
        }
    }

    fn permit(self) -> Option<&'a Permit> {
        match self {
            PermitRead::Unknown => None,
            PermitRead::Refused(p) | PermitRead::Authenticated(p) => Some(p),
        }
    }
}

/// The duplicate guard's lookup: the newest attempt under the permit with this fingerprint,
/// not given back, created at or after `since`, under another key than `key_hash` (or none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DuplicateLookup<'a> {
    pub permit_id: &'a str,
    pub fingerprint: &'a str,
    pub key_hash: Option<&'a str>,
    pub since: Millis,
}

impl<'a> DuplicateLookup<'a> {
    /// The lookup of one call: the permit's retention window back from `now`.
    pub fn of(
        req: &'a AuthorizeRequest,
        permit: &'a Permit,
        key_hash: Option<&'a str>,
        now: Millis,
    ) -> Self {
        DuplicateLookup {
            permit_id: &permit.id,
            fingerprint: &req.fingerprint,
            key_hash,
            since: now.saturating_sub(permit.policy.retention_ms),
        }
    }
}

/// What a store reads for a snapshot, inside the decision's transaction; each read is asked
/// for only when the decision needs it. Counters are as stored, without pending moves.
pub trait SnapshotReads {
    /// The attempt the key (its hash) names under the permit.
    fn key_attempt(
        &mut self,
        permit: &Permit,
        key_hash: &str,
    ) -> Result<Option<Attempt>, LedgerError>;
    /// Slots held for the tool under the permit.
    fn slots_held(&mut self, permit: &Permit, tool: &str) -> Result<i64, LedgerError>;
    /// The permit's (reserved, spent) budget totals.
    fn budget(&mut self, permit: &Permit) -> Result<(i64, i64), LedgerError>;
    /// The attempt the duplicate guard would match.
    fn recent_duplicate(
        &mut self,
        lookup: &DuplicateLookup<'_>,
    ) -> Result<Option<Attempt>, LedgerError>;
}

/// Counter moves the decision's transaction made and has not written yet (see
/// [`CounterMoves`]): a decision sees those of the decisions before it in its group.
pub trait PendingMoves {
    /// Slots of the permit's tool taken (or given back, negative).
    fn slots(&self, permit_id: &str, tool: &str) -> i64;
    /// (reserved, spent) of the permit moved.
    fn budget(&self, permit_id: &str) -> (i64, i64);
}

impl PendingMoves for CounterMoves {
    fn slots(&self, permit_id: &str, tool: &str) -> i64 {
        CounterMoves::slots(self, permit_id, tool)
    }

    fn budget(&self, permit_id: &str) -> (i64, i64) {
        CounterMoves::budget(self, permit_id)
    }
}

/// A stored counter plus its pending move; below zero (never written) counts as none.
fn counted(stored: i64, pending: i64) -> u64 {
    u64::try_from(stored.saturating_add(pending)).unwrap_or(0)
}

/// The snapshot `decide` reads for `req`: the permit, and, when the token authenticates, the
/// key's attempt and whatever else [`decide::reads_needed`] asks for, counters with the
/// transaction's pending moves added.
pub fn assemble(
    req: &AuthorizeRequest,
    permit: PermitRead<'_>,
    key_hash: Option<&str>,
    now: Millis,
    reads: &mut impl SnapshotReads,
    pending: &impl PendingMoves,
) -> Result<Snapshot, LedgerError> {
    let mut snap = Snapshot {
        permit: permit.permit().cloned(),
        now_ms: now,
        ..Snapshot::default()
    };
    // Nothing else is read for a token that does not authenticate.
    let Some(permit) = permit.authenticated() else {
        return Ok(snap);
    };
    if let Some(kh) = key_hash {
        snap.existing = reads.key_attempt(permit, kh)?;
    }
    let need = decide::reads_needed(req, permit, snap.existing.as_ref());
    if need.usage {
        let stored = reads.slots_held(permit, &req.tool)?;
        snap.usage = ToolUsage {
            calls_made: counted(stored, pending.slots(&permit.id, &req.tool)),
        };
    }
    if need.budget {
        let (reserved, spent) = reads.budget(permit)?;
        let (moved_reserved, moved_spent) = pending.budget(&permit.id);
        snap.budget = BudgetTotals {
            reserved: counted(reserved, moved_reserved),
            spent: counted(spent, moved_spent),
        };
    }
    if need.duplicate {
        snap.recent_duplicate =
            reads.recent_duplicate(&DuplicateLookup::of(req, permit, key_hash, now))?;
    }
    Ok(snap)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::model::{AttemptState, GuardMode, Policy};
    use crate::token;

    const NOW: i64 = 1_800_000_000_000;
    const HOUR: i64 = 3_600_000;
    const PID: &str = "pmt_000000000000000000000001";

    fn token() -> String {
        format!("atmp_{PID}_{}", "ab".repeat(32))
    }

    /// A permit with a cap on every tool, a budget and the duplicate guard on.
    fn permit() -> Permit {
        Permit {
            id: PID.into(),
            token_hash: token::sha256_hex(&token()),
            label: "test".into(),
            created_at_ms: NOW - HOUR,
            expires_at_ms: NOW + HOUR,
            revoked_at_ms: None,
            policy: Policy::builder()
                .max_calls_default(10)
                .budget(100)
                .cost_default(1)
                .duplicate_guard(GuardMode::Log)
                .retention_ms(HOUR)
                .build(),
        }
    }

    fn unguarded() -> Permit {
        let mut p = permit();
        p.policy.rules.max_calls_default = None;
        p.policy.rules.budget = None;
        p.policy.rules.duplicate_guard = GuardMode::Off;
        p
    }

    fn req(key: Option<&str>) -> AuthorizeRequest {
        AuthorizeRequest {
            reports: Vec::new(),
            permit_token: token(),
            tool: "pay".into(),
            idempotency_key: key.map(String::from),
            fingerprint: "fp".into(),
            arguments: json!({}),
            key_required: false,
            continuation: false,
            forwarded_key: None,
            forwarded_key_carriers: Default::default(),
            dispatch: None,
        }
    }

    fn attempt(id: &str, state: AttemptState) -> Attempt {
        Attempt::example(id, PID, "pay", state, 1)
    }

    /// Stored values, and a log of what was asked for.
    #[derive(Default)]
    struct Fake {
        key_attempt: Option<Attempt>,
        slots: i64,
        budget: (i64, i64),
        duplicate: Option<Attempt>,
        asked: Vec<String>,
    }

    impl SnapshotReads for Fake {
        fn key_attempt(
            &mut self,
            _: &Permit,
            key_hash: &str,
        ) -> Result<Option<Attempt>, LedgerError> {
            self.asked.push(format!("key {key_hash}"));
            Ok(self.key_attempt.clone())
        }
        fn slots_held(&mut self, _: &Permit, tool: &str) -> Result<i64, LedgerError> {
            self.asked.push(format!("slots {tool}"));
            Ok(self.slots)
        }
        fn budget(&mut self, _: &Permit) -> Result<(i64, i64), LedgerError> {
            self.asked.push("budget".into());
            Ok(self.budget)
        }
        fn recent_duplicate(
            &mut self,
            lookup: &DuplicateLookup<'_>,
        ) -> Result<Option<Attempt>, LedgerError> {
            self.asked.push(format!(
                "duplicate {} {} {:?} {}",
                lookup.permit_id, lookup.fingerprint, lookup.key_hash, lookup.since
            ));
            Ok(self.duplicate.clone())
        }
    }

    fn assemble_with(
        req: &AuthorizeRequest,
        permit: PermitRead<'_>,
        reads: &mut Fake,
        pending: &CounterMoves,
    ) -> Snapshot {
        let kh = decide::key_hash(req);
        assemble(req, permit, kh.as_deref(), NOW, reads, pending).unwrap()
    }

    #[test]
    fn an_unknown_permit_reads_nothing() {
        let mut reads = Fake::default();
        let snap = assemble_with(
            &req(Some("k")),
            PermitRead::check(&token(), None),
            &mut reads,
            &CounterMoves::default(),
        );
        assert!(snap.permit.is_none());
        assert_eq!(snap.now_ms, NOW);
        assert!(reads.asked.is_empty());
    }

    #[test]
    fn a_refused_token_reads_nothing_but_keeps_the_permit() {
        let mut revoked = permit();
        revoked.revoked_at_ms = Some(NOW - 1);
        let mut wrong_secret = permit();
        wrong_secret.token_hash = token::sha256_hex("another token");
        for p in [revoked, wrong_secret] {
            let mut reads = Fake::default();
            let read = PermitRead::check(&token(), Some(&p));
            assert!(matches!(read, PermitRead::Refused(_)));
            let snap = assemble_with(&req(Some("k")), read, &mut reads, &CounterMoves::default());
            assert_eq!(snap.permit.as_ref(), Some(&p));
            assert!(reads.asked.is_empty());
        }
    }

    #[test]
    fn a_new_call_reads_what_the_policy_checks_with_pending_moves_added() {
        let p = permit();
        let mut reads = Fake {
            slots: 3,
            budget: (10, 20),
            duplicate: Some(attempt("dup", AttemptState::Completed)),
            ..Fake::default()
        };
        let mut pending = CounterMoves::default();
        pending.record(None, &attempt("a1", AttemptState::InFlight));
        pending.record(None, &attempt("a2", AttemptState::InFlight));
        let r = req(Some("k"));
        let kh = decide::key_hash(&r).unwrap();
        let snap = assemble_with(
            &r,
            PermitRead::check(&token(), Some(&p)),
            &mut reads,
            &pending,
        );
        assert_eq!(
            reads.asked,
            vec![
                format!("key {kh}"),
                "slots pay".into(),
                "budget".into(),
                format!("duplicate {PID} fp Some({kh:?}) {}", NOW - HOUR),
            ]
        );
        assert!(snap.existing.is_none());
        assert_eq!(snap.usage.calls_made, 5);
        assert_eq!((snap.budget.reserved, snap.budget.spent), (12, 20));
        assert_eq!(snap.recent_duplicate.map(|a| a.id), Some("dup".to_string()));
    }

    #[test]
    fn a_call_without_a_key_reads_no_key_and_looks_for_duplicates_under_any_key() {
        let p = permit();
        let mut reads = Fake::default();
        assemble_with(
            &req(None),
            PermitRead::check(&token(), Some(&p)),
            &mut reads,
            &CounterMoves::default(),
        );
        assert_eq!(
            reads.asked,
            vec![
                "slots pay".to_string(),
                "budget".into(),
                format!("duplicate {PID} fp None {}", NOW - HOUR),
            ]
        );
    }

    #[test]
    fn a_key_whose_attempt_decides_alone_reads_the_counters_but_no_duplicate() {
        // The answer carries the permit's figures, so the counters are read; the duplicate
        // guard only looks at new calls.
        let p = permit();
        for state in [
            AttemptState::InFlight,
            AttemptState::AwaitingInput,
            AttemptState::Completed,
            AttemptState::Accepted,
            AttemptState::Uncertain,
            AttemptState::ResolvedExecuted,
        ] {
            let mut reads = Fake {
                key_attempt: Some(attempt("old", state)),
                slots: 3,
                budget: (1, 2),
                ..Fake::default()
            };
            let snap = assemble_with(
                &req(Some("k")),
                PermitRead::check(&token(), Some(&p)),
                &mut reads,
                &CounterMoves::default(),
            );
            assert_eq!(reads.asked.len(), 3, "{state:?}: {:?}", reads.asked);
            assert_eq!(&reads.asked[1..], ["slots pay", "budget"], "{state:?}");
            assert_eq!(snap.existing.map(|a| a.state), Some(state));
            assert_eq!(snap.usage.calls_made, 3);
            assert_eq!((snap.budget.reserved, snap.budget.spent), (1, 2));
            assert!(snap.recent_duplicate.is_none());
        }
    }

    #[test]
    fn a_key_whose_attempt_was_given_back_reads_as_a_new_call() {
        let p = permit();
        for state in [AttemptState::Released, AttemptState::ResolvedNotExecuted] {
            let mut reads = Fake {
                key_attempt: Some(attempt("old", state)),
                slots: 3,
                budget: (1, 2),
                ..Fake::default()
            };
            let snap = assemble_with(
                &req(Some("k")),
                PermitRead::check(&token(), Some(&p)),
                &mut reads,
                &CounterMoves::default(),
            );
            assert_eq!(reads.asked.len(), 4, "{state:?}: {:?}", reads.asked);
            assert_eq!(snap.existing.map(|a| a.state), Some(state));
            assert_eq!(snap.usage.calls_made, 3);
            assert_eq!((snap.budget.reserved, snap.budget.spent), (1, 2));
        }
    }

    #[test]
    fn a_policy_without_cap_budget_or_guard_reads_only_the_key() {
        let p = unguarded();
        let mut reads = Fake {
            slots: 3,
            ..Fake::default()
        };
        let snap = assemble_with(
            &req(Some("k")),
            PermitRead::check(&token(), Some(&p)),
            &mut reads,
            &CounterMoves::default(),
        );
        assert_eq!(reads.asked.len(), 1);
        assert_eq!(snap.usage, ToolUsage::default());
        assert_eq!(snap.budget, BudgetTotals::default());
        assert!(snap.recent_duplicate.is_none());
    }

    #[test]
    fn moves_given_back_in_the_group_count_down_and_never_below_zero() {
        let p = permit();
        let mut pending = CounterMoves::default();
        let sent = attempt("a1", AttemptState::InFlight);
        pending.record(Some(&sent), &attempt("a1", AttemptState::Released));
        pending.record(Some(&sent), &attempt("a1", AttemptState::Released));
        let mut reads = Fake {
            slots: 1,
            budget: (1, 0),
            ..Fake::default()
        };
        let snap = assemble_with(
            &req(None),
            PermitRead::check(&token(), Some(&p)),
            &mut reads,
            &pending,
        );
        assert_eq!(snap.usage.calls_made, 0);
        assert_eq!(snap.budget.reserved, 0);
    }

    #[test]
    fn moves_of_other_permits_and_tools_do_not_count() {
        let p = permit();
        let mut pending = CounterMoves::default();
        pending.record(
            None,
            &Attempt::example("o1", "pmt_other", "pay", AttemptState::InFlight, 4),
        );
        pending.record(
            None,
            &Attempt::example("o2", PID, "refund", AttemptState::InFlight, 4),
        );
        let mut reads = Fake {
            slots: 2,
            ..Fake::default()
        };
        let snap = assemble_with(
            &req(None),
            PermitRead::check(&token(), Some(&p)),
            &mut reads,
            &pending,
        );
        assert_eq!(snap.usage.calls_made, 2);
        // The other tool's attempt reserved budget under this permit.
        assert_eq!(snap.budget.reserved, 4);
    }
}
