//! Storage of permits and attempts behind one async trait.
//!
//! Each store reads a [`Snapshot`](crate::decide::Snapshot) and applies the pure decision's
//! [`Mutation`](crate::decide::Mutation) inside ONE transaction that serializes every
//! decision for the same permit (SQLite: `BEGIN IMMEDIATE`; PostgreSQL: `SELECT … FOR UPDATE`
//! on the permit row). That makes check + reserve one atomic step.

use std::collections::BTreeMap;

use async_trait::async_trait;
use atmost_protocol::{AuthorizeRequest, OutcomeAck, OutcomeReport};

use crate::clock::Millis;
use crate::decide::{Decision, ResolveInput};
use crate::error::{LedgerError, ResolveError};
use crate::model::{Attempt, AttemptState, Permit, PermitDetail};

pub mod counters;
#[cfg(feature = "postgres")]
pub mod postgres;
pub mod rows;
pub mod schema;
pub mod snapshot;
#[cfg(feature = "sqlite")]
pub mod sqlite;

#[cfg(test)]
pub mod conformance;

/// Which attempts to list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AttemptFilter {
    pub state: Option<AttemptState>,
    pub permit_id: Option<String>,
    /// At most this many, newest first.
    pub limit: Option<u32>,
}

/// What one sweep did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// `in_flight` attempts past their lease turned `uncertain`.
    pub leases_expired: u64,
    /// Receipts past retention dropped to a tombstone.
    pub receipts_pruned: u64,
}

/// How an outcome report was taken, with the state the attempt had before (for logs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutcomeResult {
    pub ack: OutcomeAck,
    pub previous: Option<AttemptState>,
}

/// A permit's O(1) counters as stored (kept in the same transaction as every attempt write).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PermitCounters {
    /// Slots held per tool (rows may hold 0).
    pub slots_held: BTreeMap<String, i64>,
    pub reserved: i64,
    pub spent: i64,
}

#[async_trait]
pub trait Store: Send + Sync {
    /// The store answers.
    async fn ping(&self) -> Result<(), LedgerError>;

    /// Stores a new permit (its token already hashed).
    async fn create_permit(&self, permit: &Permit) -> Result<(), LedgerError>;

    async fn list_permits(&self) -> Result<Vec<Permit>, LedgerError>;

    /// A permit with its usage per tool, budget totals and attempt counts.
    async fn permit_detail(&self, id: &str) -> Result<Option<PermitDetail>, LedgerError>;

    /// The permit with this id, `None` if unknown.
    async fn get_permit(&self, id: &str) -> Result<Option<Permit>, LedgerError>;

    /// Revokes a permit; revoking twice keeps the first time. `None` if unknown.
    async fn revoke_permit(&self, id: &str, now: Millis) -> Result<Option<Permit>, LedgerError>;

    /// Check and reserve in one atomic step. `ledger/model/atmost.pml`'s `NO_ATOMIC_RESERVE`
    /// mutant shows why: as two steps, two replicas both pass a cap of 1.
    async fn authorize(
        &self,
        req: &AuthorizeRequest,
        lease_ms: u64,
        now: Millis,
    ) -> Result<Decision, LedgerError>;

    /// Applies one outcome report.
    async fn record_outcome(
        &self,
        report: &OutcomeReport,
        now: Millis,
    ) -> Result<OutcomeResult, LedgerError>;

    /// Applies the reports of one batch, in order. The default loops over
    /// [`Store::record_outcome`]; a store may apply them all in one transaction. One answer per
    /// report; an error of the whole call means none of them is known to be recorded.
    async fn record_outcomes(
        &self,
        reports: &[OutcomeReport],
        now: Millis,
    ) -> Result<Vec<OutcomeResult>, LedgerError> {
        let mut out = Vec::with_capacity(reports.len());
        for r in reports {
            out.push(self.record_outcome(r, now).await?);
        }
        Ok(out)
    }

    /// The permit's stored counters, `None` if unknown.
    async fn permit_counters(&self, id: &str) -> Result<Option<PermitCounters>, LedgerError>;

    async fn get_attempt(&self, id: &str) -> Result<Option<Attempt>, LedgerError>;

    async fn list_attempts(&self, filter: &AttemptFilter) -> Result<Vec<Attempt>, LedgerError>;

    /// Settles an `uncertain` attempt.
    async fn resolve_attempt(
        &self,
        id: &str,
        input: &ResolveInput,
        now: Millis,
    ) -> Result<Attempt, ResolveError>;

    /// Expired leases → `uncertain`; receipts past retention → tombstones.
    async fn sweep(&self, now: Millis) -> Result<SweepReport, LedgerError>;

    /// Number of attempts per state, over all permits.
    async fn attempt_counts(&self) -> Result<BTreeMap<AttemptState, u64>, LedgerError>;

    /// What the reconciliation inbox lists: every `uncertain` attempt, and each
    /// `awaiting_input` one that has waited since `stuck_since` or earlier, oldest first by
    /// when it entered its state (`updated_at`, which nothing else moves in these states);
    /// at most `limit`.
    async fn open_attempts(
        &self,
        stuck_since: Millis,
        limit: u32,
    ) -> Result<Vec<Attempt>, LedgerError>;

    /// `uncertain` attempts in the inbox's order (when each turned so, then id) that come
    /// after `after` (that order's key of the last one read; `(Millis::MIN, "")` for the
    /// first); at most `limit`. The reconciler walks them page by page, so no number of
    /// older attempts hides a newer one from it.
    async fn uncertain_after(
        &self,
        after: (Millis, &str),
        limit: u32,
    ) -> Result<Vec<Attempt>, LedgerError>;

    /// Resolved attempts, the latest resolution first; at most `limit`.
    async fn resolved_attempts(&self, limit: u32) -> Result<Vec<Attempt>, LedgerError>;

    /// When the attempt that has been `uncertain` the longest turned so; `None` when none is.
    async fn oldest_uncertain(&self) -> Result<Option<Millis>, LedgerError>;
}

/// The inbox's one list from a store's two reads (`uncertain` ones, stuck `awaiting_input`
/// ones): oldest first by when each entered its state, ties by id, at most `limit`.
pub fn oldest_first(mut attempts: Vec<Attempt>, limit: u32) -> Vec<Attempt> {
    attempts.sort_by(|a, b| (a.updated_at_ms, &a.id).cmp(&(b.updated_at_ms, &b.id)));
    attempts.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
    attempts
}
