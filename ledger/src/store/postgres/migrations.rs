//! The schema: versioned migrations, applied once each under an advisory lock.

use deadpool_postgres::GenericClient;

use super::column_err;
use super::{pg_err, PgStore};
use crate::error::LedgerError;
use crate::store::schema::{check_compatibility, log_verdict, SCHEMA_VERSION};

/// Key of the advisory lock that serializes migrations of every replica.
pub(super) const MIGRATION_LOCK: i64 = 0x6174_6d6f_7374_0001;

/// One schema version. `compatible_from` is the oldest schema version a ledger may know and
/// still serve on a database that has this migration (the rule: store/schema.rs): the
/// version itself when older ledgers would write or read it wrongly, an older one when the
/// migration only adds what older ledgers ignore.
#[derive(Debug, Clone, Copy)]
pub(super) struct Migration {
    pub version: i32,
    pub compatible_from: i32,
    pub description: &'static str,
    pub sql: &'static str,
}

/// Versioned migrations, applied in order, each once, recorded in `atmost_migrations`.
/// Never edit a released one: add the next version. Versions 2 to 4 each changed what
/// every writer must keep (counters, per-state counts, dispatch rounds), so each needs a
/// ledger that knows it; 5 only added columns and indexes an older ledger leaves empty, 6
/// and 8 tables an older ledger never reads, 7 a column and 9 indexes.
pub(super) const RELEASED: &[Migration] = &[
    Migration {
        version: 1,
        compatible_from: 1,
        description: "permits, attempts, idempotency keys",
        sql: r#"
CREATE TABLE permits (
    id           TEXT PRIMARY KEY,
    token_hash   TEXT NOT NULL,
    label        TEXT NOT NULL,
    created_at   BIGINT NOT NULL,
    expires_at   BIGINT NOT NULL,
    revoked_at   BIGINT,
    retention_ms BIGINT NOT NULL,
    policy       TEXT NOT NULL
);
CREATE TABLE attempts (
    id                TEXT PRIMARY KEY,
    permit_id         TEXT NOT NULL REFERENCES permits(id),
    tool              TEXT NOT NULL,
    key_hash          TEXT,
    fingerprint       TEXT NOT NULL,
    cost              BIGINT NOT NULL,
    state             TEXT NOT NULL,
    created_at        BIGINT NOT NULL,
    updated_at        BIGINT NOT NULL,
    lease_expires_at  BIGINT NOT NULL,
    finished_at       BIGINT,
    receipt           TEXT,
    reason            TEXT,
    replay_count      BIGINT NOT NULL DEFAULT 0,
    pruned_at         BIGINT,
    resolved_executed BOOLEAN,
    resolved_by       TEXT,
    resolved_at       BIGINT,
    resolution_note   TEXT
);
CREATE INDEX attempts_by_permit_tool_state ON attempts(permit_id, tool, state);
CREATE INDEX attempts_by_permit_fingerprint ON attempts(permit_id, fingerprint, created_at);
CREATE INDEX attempts_by_state_lease ON attempts(state, lease_expires_at);
CREATE INDEX attempts_unpruned ON attempts(state, permit_id) WHERE pruned_at IS NULL;
CREATE INDEX attempts_by_created ON attempts(created_at);
CREATE TABLE idempotency_keys (
    permit_id  TEXT NOT NULL,
    key_hash   TEXT NOT NULL,
    attempt_id TEXT NOT NULL REFERENCES attempts(id),
    PRIMARY KEY (permit_id, key_hash)
);
"#,
    },
    Migration {
        version: 2,
        compatible_from: 2,
        description: "O(1) counters: slots held per permit and tool, reserved and spent budget per permit",
        // The state lists are the model's rules when this was written (a migration never changes).
        sql: r#"
CREATE TABLE permit_tool_usage (
    permit_id  TEXT NOT NULL,
    tool       TEXT NOT NULL,
    slots_held BIGINT NOT NULL,
    PRIMARY KEY (permit_id, tool)
);
ALTER TABLE permits ADD COLUMN reserved BIGINT NOT NULL DEFAULT 0;
ALTER TABLE permits ADD COLUMN spent BIGINT NOT NULL DEFAULT 0;
INSERT INTO permit_tool_usage (permit_id, tool, slots_held)
    SELECT permit_id, tool, COUNT(*) FROM attempts
    WHERE state IN ('in_flight','completed','uncertain','resolved_executed','awaiting_input','accepted')
    GROUP BY permit_id, tool;
UPDATE permits p SET
    reserved = COALESCE(t.reserved, 0),
    spent = COALESCE(t.spent, 0)
FROM (SELECT permit_id,
             SUM(cost) FILTER (WHERE state IN ('in_flight','awaiting_input')) AS reserved,
             SUM(cost) FILTER (WHERE state IN ('completed','uncertain','resolved_executed','accepted')) AS spent
      FROM attempts GROUP BY permit_id) t
WHERE t.permit_id = p.id;
"#,
    },
    Migration {
        version: 3,
        compatible_from: 3,
        description: "attempts per permit and state counted; sweeper candidates in partial indexes",
        // As in SQLite's version 3: the metrics and the sweeper no longer read every attempt.
        // Counts are per permit, so they are moved under the permit's row lock that every
        // writer already holds (no row shared by all permits). The state lists are the
        // model's `leased` and `replays` when this was written; a test keeps the queries'
        // lists equal to them (a partial index is only used for the same literal list).
        sql: r#"
CREATE TABLE permit_state_counts (
    permit_id TEXT NOT NULL,
    state     TEXT NOT NULL,
    n         BIGINT NOT NULL,
    PRIMARY KEY (permit_id, state)
);
INSERT INTO permit_state_counts (permit_id, state, n)
    SELECT permit_id, state, COUNT(*) FROM attempts GROUP BY permit_id, state;
DROP INDEX attempts_by_permit_tool_state;
DROP INDEX attempts_by_state_lease;
DROP INDEX attempts_unpruned;
CREATE INDEX attempts_leased ON attempts(lease_expires_at)
    WHERE state IN ('in_flight','awaiting_input');
CREATE INDEX attempts_prunable ON attempts((COALESCE(finished_at, updated_at)))
    WHERE pruned_at IS NULL AND state IN ('completed','resolved_executed','accepted');
"#,
    },
    Migration {
        version: 4,
        compatible_from: 4,
        description: "dispatch rounds: each attempt's current round and its capability's hash",
        // As in SQLite's version 4: older attempts keep round 1 and no capability, so no
        // report moves them; their lease turns them uncertain (fail closed).
        sql: r#"
ALTER TABLE attempts ADD COLUMN round INTEGER NOT NULL DEFAULT 1;
ALTER TABLE attempts ADD COLUMN capability_hash TEXT;
"#,
    },
    Migration {
        version: 5,
        compatible_from: 4,
        description: "reconciliation inbox: forwarded key and arguments per attempt, resolution source and evidence",
        // As in SQLite's version 5: older attempts have no forwarded key or arguments, and a
        // resolution without a source was a person's. The partial indexes hold what the inbox
        // lists (uncertain attempts by when they turned so; resolved ones by when).
        sql: r#"
ALTER TABLE attempts ADD COLUMN forwarded_key TEXT;
ALTER TABLE attempts ADD COLUMN arguments TEXT;
ALTER TABLE attempts ADD COLUMN resolution_source TEXT;
ALTER TABLE attempts ADD COLUMN provider_answer TEXT;
CREATE INDEX attempts_uncertain ON attempts(updated_at) WHERE state = 'uncertain';
CREATE INDEX attempts_resolved ON attempts(resolved_at) WHERE resolved_at IS NOT NULL;
"#,
    },
    Migration {
        version: 6,
        compatible_from: 4,
        description: "signing keys: Ed25519 keys shared by the replicas, one active",
        // As in SQLite's version 6: the partial unique index admits one active key, so
        // replicas starting together can never make two.
        sql: r#"
CREATE TABLE signing_keys (
    kid           TEXT PRIMARY KEY,
    public_key    TEXT NOT NULL,
    private_pkcs8 TEXT NOT NULL,
    created_at    BIGINT NOT NULL,
    retired_at    BIGINT
);
CREATE UNIQUE INDEX signing_keys_one_active ON signing_keys((retired_at IS NULL))
    WHERE retired_at IS NULL;
"#,
    },
    Migration {
        version: 7,
        compatible_from: 4,
        description: "where each attempt's forwarded key reached the upstream (its carriers)",
        // As in SQLite's version 7: older attempts have none, which the reconciler takes as
        // "reached no carrier", never as the header. Additive: an older ledger's upsert
        // leaves the column as it was.
        sql: r#"
ALTER TABLE attempts ADD COLUMN forwarded_key_carriers TEXT;
"#,
    },
    Migration {
        version: 8,
        compatible_from: 4,
        description: "inbox sessions: one row per signed-in session, ended by sign-out or revocation",
        // As in SQLite's version 8. Additive: an older ledger never reads the table.
        sql: r#"
CREATE TABLE inbox_sessions (
    id_hash    TEXT PRIMARY KEY,
    created_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL
);
"#,
    },
    Migration {
        version: 9,
        compatible_from: 4,
        description: "the purge of ended permits: permits by expiry and by revocation, keys by attempt",
        // As in SQLite's version 9. Additive: an older ledger never purges, and serves on a
        // store a newer one purges (a purged permit's token is unknown to both). The keys'
        // index serves the foreign key's check when an attempt is deleted, which without it
        // reads every key.
        sql: r#"
CREATE INDEX permits_by_expiry ON permits(expires_at);
CREATE INDEX permits_revoked ON permits(revoked_at) WHERE revoked_at IS NOT NULL;
CREATE INDEX idempotency_keys_by_attempt ON idempotency_keys(attempt_id);
"#,
    },
];

/// The rehearsal of the next schema version (feature `schema-rehearsal`, never released): an
/// additive migration as the next release might add, so the upgrade test can run two
/// schema versions side by side. Each attempt may name the replica that decided it (left
/// empty by older ledgers), and the admin listing of a permit's attempts by time gets an
/// index.
#[cfg(feature = "schema-rehearsal")]
const NEXT: &[Migration] = &[Migration {
    version: 10,
    compatible_from: 9,
    description:
        "rehearsal: the deciding replica per attempt (nullable), attempts by permit and time",
    sql: r#"
ALTER TABLE attempts ADD COLUMN decided_by TEXT;
CREATE INDEX attempts_by_permit_created ON attempts(permit_id, created_at);
"#,
}];
#[cfg(not(feature = "schema-rehearsal"))]
const NEXT: &[Migration] = &[];

/// Every migration this build knows, in order.
pub(super) fn migrations() -> impl Iterator<Item = &'static Migration> {
    RELEASED.iter().chain(NEXT)
}

impl PgStore {
    pub(super) async fn migrate(&self, schema: Option<&str>) -> Result<(), LedgerError> {
        let schema = schema.map(str::to_string);
        // A migration may build an index on a large table, and a replica starting beside
        // another waits for its migrations on the advisory lock: neither is a decision, so
        // neither runs under the session's timeouts, which the callout timeout bounds.
        let long_work = self.long_work.clone();
        self.timed(async move |c: &mut deadpool_postgres::Object| {
            let tx = c.transaction().await.map_err(pg_err)?;
            tx.batch_execute(&long_work).await.map_err(pg_err)?;
            tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
                .await
                .map_err(pg_err)?;
            if let Some(s) = schema.as_deref() {
                // Validated: lowercase letters, digits, '_'.
                tx.batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {s}"))
                    .await
                    .map_err(pg_err)?;
            }
            // `compatible_from` came after the table: added where an older ledger made it.
            tx.batch_execute(
                "CREATE TABLE IF NOT EXISTS atmost_migrations (\
                   version INTEGER PRIMARY KEY, description TEXT NOT NULL, \
                   applied_at TIMESTAMPTZ NOT NULL DEFAULT now());\
                 ALTER TABLE atmost_migrations ADD COLUMN IF NOT EXISTS compatible_from INTEGER",
            )
            .await
            .map_err(pg_err)?;
            let applied: Vec<(i32, Option<i32>)> = tx
                .query(
                    "SELECT version, compatible_from FROM atmost_migrations ORDER BY version",
                    &[],
                )
                .await
                .map_err(pg_err)?
                .iter()
                .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
                .collect::<Result<_, tokio_postgres::Error>>()
                .map_err(column_err)?;
            let database = applied.iter().map(|m| i64::from(m.0)).max().unwrap_or(0);
            // Rows written before `compatible_from` existed are released versions this
            // ledger knows: they require nothing newer.
            let required = applied
                .iter()
                .filter_map(|m| m.1.map(i64::from))
                .max()
                .unwrap_or(0);
            let verdict = check_compatibility(SCHEMA_VERSION, database, required)?;
            for m in migrations() {
                if applied.iter().any(|a| a.0 == m.version) {
                    continue;
                }
                tx.batch_execute(m.sql).await.map_err(pg_err)?;
                tx.execute(
                    "INSERT INTO atmost_migrations (version, description, compatible_from) \
                     VALUES ($1, $2, $3)",
                    &[&m.version, &m.description, &m.compatible_from],
                )
                .await
                .map_err(pg_err)?;
                tracing::info!(
                    version = m.version,
                    description = m.description,
                    compatible_from = m.compatible_from,
                    "migration applied"
                );
            }
            for m in migrations() {
                tx.execute(
                    "UPDATE atmost_migrations SET compatible_from = $2 \
                     WHERE version = $1 AND compatible_from IS NULL",
                    &[&m.version, &m.compatible_from],
                )
                .await
                .map_err(pg_err)?;
            }
            log_verdict(verdict, SCHEMA_VERSION);
            tx.commit().await.map_err(pg_err)?;
            Ok(())
        })
        .await
    }
}
