//! Purging ended permits (docs/design.md#purging-ended-permits): the history of a permit that
//! can no longer authorize anything is deleted once it has been over for long enough, so the
//! store stops growing under steady use.
//!
//! A permit that expired or was revoked never dispatches again, whatever key a call carries
//! (the decision table denies it before anything is reserved), so its tombstones protect
//! nothing. What a report, a lease or a resolution may still move (`in_flight`,
//! `awaiting_input`, `uncertain`: the model's `settled` rule) is kept with its permit until it
//! settles. Each store deletes in batches of at most [`PURGE_BATCH`] attempts, each in one
//! transaction under the permit's serialization; the SQL that finds what to delete is shared
//! here.

use crate::error::LedgerError;
use crate::model::AttemptState;
use crate::store::counters::Counted;
use crate::store::rows::to_u64;

/// What one purge did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PurgeReport {
    /// Attempts deleted, with their idempotency keys.
    pub attempts_purged: u64,
    /// Permits deleted, with their counters, once nothing was left under them.
    pub permits_purged: u64,
}

impl PurgeReport {
    pub fn absorb(&mut self, other: PurgeReport) {
        self.attempts_purged += other.attempts_purged;
        self.permits_purged += other.permits_purged;
    }
}

/// Most attempts one purge transaction deletes: the permit's row lock (PostgreSQL) or the
/// writer (SQLite) is held no longer than deleting that many takes.
pub const PURGE_BATCH: u32 = 500;

/// Most attempts one sweep purges, so a backlog (a first start with the purge on, a burst of
/// permits ending together) is worked off over several sweeps instead of one long one.
pub const PURGE_PER_SWEEP: u64 = 20 * PURGE_BATCH as u64;

/// The size of the next batch once `purged` of `limit` attempts are done: at most
/// [`PURGE_BATCH`]; `None` when the limit is reached.
pub fn next_batch(limit: u64, purged: u64) -> Option<u32> {
    let left = limit.saturating_sub(purged).min(u64::from(PURGE_BATCH));
    u32::try_from(left).ok().filter(|n| *n > 0)
}

/// How many candidate permits one statement lists.
pub const CANDIDATES_PER_READ: u32 = 64;

/// The purge's statements, with the store's spelling of a parameter (`?n`, `$n`).
pub struct PurgeSql {
    pub param: fn(u8) -> String,
}

impl PurgeSql {
    /// Permits that stopped authorizing at or before parameter 1 (expired or revoked; both
    /// columns indexed, schema version 9) and still have something to purge: a settled
    /// attempt, or nothing at all under them. A permit left with unsettled attempts only is
    /// not listed, so it never crowds out the others. At most parameter 2, in id order.
    pub fn candidates(&self) -> String {
        let p = self.param;
        format!(
            "SELECT p.id FROM permits p WHERE (p.expires_at <= {ended} OR p.revoked_at <= {ended}) \
             AND (EXISTS (SELECT 1 FROM attempts a WHERE a.permit_id = p.id AND a.state IN {settled}) \
                  OR NOT EXISTS (SELECT 1 FROM attempts a WHERE a.permit_id = p.id)) \
             ORDER BY p.id LIMIT {limit}",
            ended = p(1),
            limit = p(2),
            settled = AttemptState::sql_list(AttemptState::settled),
        )
    }

    /// Whether permit parameter 1 stopped authorizing at or before parameter 2: read again
    /// under the permit's serialization, so a permit is never purged on a stale listing.
    pub fn ended(&self) -> String {
        let p = self.param;
        format!(
            "SELECT id FROM permits WHERE id = {id} AND (expires_at <= {ended} OR revoked_at <= {ended})",
            id = p(1),
            ended = p(2),
        )
    }

    /// Up to parameter 2 settled attempts of permit parameter 1: what each counted for and
    /// its key (`id`, `permit_id`, `tool`, `state`, `cost`, `key_hash`; [`Doomed::read`]).
    pub fn batch(&self) -> String {
        let p = self.param;
        format!(
            "SELECT id, permit_id, tool, state, cost, key_hash FROM attempts \
             WHERE permit_id = {id} AND state IN {settled} LIMIT {limit}",
            id = p(1),
            limit = p(2),
            settled = AttemptState::sql_list(AttemptState::settled),
        )
    }

    /// Whether any attempt is left under permit parameter 1.
    pub fn anything_left(&self) -> String {
        format!(
            "SELECT 1 FROM attempts WHERE permit_id = {} LIMIT 1",
            (self.param)(1)
        )
    }
}

/// A settled attempt the purge deletes: what it counted for, and its key's hash (the key
/// row goes with it when it still points at it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Doomed {
    pub counted: Counted,
    pub key_hash: Option<String>,
}

impl Doomed {
    /// One row of [`PurgeSql::batch`], as the driver read its columns.
    pub fn read(
        (id, permit_id, tool, state, cost, key_hash): (
            String,
            String,
            String,
            String,
            i64,
            Option<String>,
        ),
    ) -> Result<Self, LedgerError> {
        let state = state
            .parse::<AttemptState>()
            .map_err(|e| LedgerError::Invariant(format!("attempt {id}: {e}")))?;
        Ok(Doomed {
            counted: Counted {
                id,
                permit_id,
                tool,
                state,
                cost: to_u64(cost),
            },
            key_hash,
        })
    }
}
