//! Storage of permits and attempts: what writes ([`Decisions`], each store its own way) and
//! what only reads ([`Reads`], written once over the SQL the stores share).
//!
//! Each store reads a [`Snapshot`](crate::decide::Snapshot) and applies the pure decision's
//! [`Mutation`](crate::decide::Mutation) inside ONE transaction that serializes every
//! decision for the same permit (SQLite: `BEGIN IMMEDIATE`; PostgreSQL: `SELECT … FOR UPDATE`
//! on the permit row). That makes check + reserve one atomic step.
//!
//! A store is a module of its own behind a cargo feature (`sqlite`, `postgres`): it
//! implements [`Decisions`] and [`ReadQueries`] (run statements, read their rows), and runs
//! the conformance suite (`conformance.rs`) with one `conformance_suite!` call.

use std::collections::BTreeMap;

use async_trait::async_trait;
use atmost_protocol::{AuthorizeRequest, OutcomeAck, OutcomeReport};

use crate::clock::{Deadline, Millis};
use crate::credentials::{CredentialUse, StoredCredential};
use crate::decide::{ApprovalInput, Decision, Leases, ResolveInput};
use crate::error::{ApprovalError, LedgerError, ResolveError};
use crate::keys::{Rotation, SigningKey};
use crate::model::{Attempt, AttemptState, Permit};

pub mod counters;
#[cfg(feature = "postgres")]
pub mod postgres;
pub mod purge;
pub mod reads;
pub mod record;
pub mod rows;
pub mod schema;
pub mod snapshot;
#[cfg(feature = "sqlite")]
pub mod sqlite;

pub use purge::PurgeReport;
pub use reads::{ReadQueries, Reads};

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
    /// Calls waiting for a person's approval, or approved and not used, past their lapse time
    /// turned `approval_expired`.
    pub approvals_expired: u64,
    /// Receipts past retention dropped to a tombstone.
    pub receipts_pruned: u64,
}

impl SweepReport {
    /// Counts one attempt the sweeper moved, by where it went.
    pub fn count_expiry(&mut self, next: &Attempt) {
        if next.state == AttemptState::ApprovalExpired {
            self.approvals_expired += 1;
        } else {
            self.leases_expired += 1;
        }
    }
}

/// How one kind of one-statement write fared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Applied {
    /// Written by one statement.
    pub applied: u64,
    /// Statements sent that did not apply (what the copy saw had moved, or the key was
    /// taken): those went to the locked path.
    pub not_applied: u64,
}

/// How a store handle's one-statement decisions and reports fared (PostgreSQL's,
/// docs/postgresql.md "One statement per decision"); none on a store without them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OneStatementCounts {
    pub decisions: Applied,
    pub reports: Applied,
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

/// What changes the ledger: the decisions and everything else that writes, each in one
/// transaction under the permit's serialization (see the module docs), and readiness. Each
/// store writes these its own way; the reads that decide nothing are written once for every
/// store ([`Reads`]).
#[async_trait]
pub trait Decisions: Send + Sync {
    /// The store answers, and can take decisions.
    async fn ping(&self) -> Result<(), LedgerError>;

    /// How this handle's one-statement writes fared; `None` on a store that has none.
    fn one_statement_counts(&self) -> Option<OneStatementCounts> {
        None
    }

    /// Stores a new permit (its token already hashed).
    async fn create_permit(&self, permit: &Permit) -> Result<(), LedgerError>;

    /// Revokes a permit; revoking twice keeps the first time. `None` if unknown.
    async fn revoke_permit(&self, id: &str, now: Millis) -> Result<Option<Permit>, LedgerError>;

    /// Check and reserve in one atomic step. `ledger/model/atmost.pml`'s `NO_ATOMIC_RESERVE`
    /// mutant shows why: as two steps, two replicas both pass a cap of 1. Nothing is
    /// committed after `deadline` (the caller stopped waiting and was told nothing was
    /// reserved): a decision that cannot commit before it fails with
    /// [`LedgerError::DeadlinePassed`]. A new attempt keeps `credential`, the credential its
    /// dispatch carries (the ledger read it, by the permit's name for it, before deciding).
    async fn authorize_with(
        &self,
        req: &AuthorizeRequest,
        credential: Option<CredentialUse>,
        leases: Leases,
        now: Millis,
        deadline: Deadline,
    ) -> Result<Decision, LedgerError>;

    /// [`Decisions::authorize_with`] for a permit that names no credential, with a call lease
    /// of `lease_ms` and the default wait for approvals.
    async fn authorize(
        &self,
        req: &AuthorizeRequest,
        lease_ms: u64,
        now: Millis,
        deadline: Deadline,
    ) -> Result<Decision, LedgerError> {
        self.authorize_with(req, None, Leases::call(lease_ms), now, deadline)
            .await
    }

    /// A person's decision on a call waiting for approval (docs/approvals.md), applied under
    /// the permit's serialization like every write of an attempt.
    async fn decide_approval(
        &self,
        id: &str,
        input: &ApprovalInput,
        now: Millis,
    ) -> Result<Attempt, ApprovalError>;

    /// Stores a new version of the credential `c` names (its secret already sealed): version
    /// 1 for a new name, else one more than the newest, whatever `c.version` says. Two
    /// registrations of one name at once get two versions. Answers what was stored.
    async fn put_credential(&self, c: &StoredCredential) -> Result<StoredCredential, LedgerError>;

    /// Applies one outcome report.
    async fn record_outcome(
        &self,
        report: &OutcomeReport,
        now: Millis,
    ) -> Result<OutcomeResult, LedgerError>;

    /// Applies the reports of one batch, in order. The default loops over
    /// [`Decisions::record_outcome`]; a store may apply them all in one transaction. One
    /// answer per report; an error of the whole call means none of them is known to be
    /// recorded.
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

    /// Settles an `uncertain` attempt.
    async fn resolve_attempt(
        &self,
        id: &str,
        input: &ResolveInput,
        now: Millis,
    ) -> Result<Attempt, ResolveError>;

    /// Expired leases → `uncertain`; receipts past retention → tombstones.
    async fn sweep(&self, now: Millis) -> Result<SweepReport, LedgerError>;

    /// Deletes the history of permits that stopped authorizing (expired, or revoked) at or
    /// before `ended_before`: their settled attempts with their idempotency keys, then each
    /// permit with its counters once nothing is left under it; attempts that are not settled
    /// stay, and so does their permit (docs/design.md#purging-ended-permits). At most `limit`
    /// attempts, in transactions of at most [`purge::PURGE_BATCH`] under the permit's
    /// serialization; the counters stay equal to a recount throughout.
    async fn purge(&self, ended_before: Millis, limit: u64) -> Result<PurgeReport, LedgerError>;

    /// Makes sure one signing key is active, and answers it: when none is, a new key created
    /// at `now` becomes it. Replicas starting together on one store end with one active key,
    /// the same for all of them.
    async fn ensure_signing_key(&self, now: Millis) -> Result<SigningKey, LedgerError>;

    /// Retires the active signing key at `now` and makes a new one active, in one
    /// transaction: there is never a moment without an active key, nor one with two.
    async fn rotate_signing_key(&self, now: Millis) -> Result<Rotation, LedgerError>;

    /// Records an inbox session (by the SHA-256 of its id, hex) open until `expires_at`;
    /// sessions expired at `now` are dropped on the way, so the table holds open ones only.
    async fn open_inbox_session(
        &self,
        id_hash: &str,
        now: Millis,
        expires_at: Millis,
    ) -> Result<(), LedgerError>;

    /// Whether the inbox session is open at `now`: recorded, not ended, not expired.
    async fn inbox_session_open(&self, id_hash: &str, now: Millis) -> Result<bool, LedgerError>;

    /// Ends one inbox session (its sign-out); whether it was recorded.
    async fn end_inbox_session(&self, id_hash: &str) -> Result<bool, LedgerError>;

    /// Ends every inbox session; how many were open at `now`.
    async fn end_all_inbox_sessions(&self, now: Millis) -> Result<u64, LedgerError>;
}

/// A store: its decisions, and the shared reads (a store provides them by running
/// statements, [`ReadQueries`]).
pub trait Store: Decisions + Reads {}

impl<S: Decisions + Reads + ?Sized> Store for S {}
