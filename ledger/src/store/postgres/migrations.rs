//! The schema: versioned migrations, applied once each under an advisory lock.

use deadpool_postgres::GenericClient;

use super::column_err;
use super::{pg_err, PgStore};
use crate::error::LedgerError;

/// Key of the advisory lock that serializes migrations of every replica.
pub(super) const MIGRATION_LOCK: i64 = 0x6174_6d6f_7374_0001;

/// Versioned migrations, applied in order, each once, recorded in `atmost_migrations`.
/// Never edit a released one: add the next version.
pub(super) const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "permits, attempts, idempotency keys",
        r#"
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
    ),
    (
        2,
        "O(1) counters: slots held per permit and tool, reserved and spent budget per permit",
        // The state lists are the model's rules when this was written (a migration never changes).
        r#"
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
    ),
    (
        3,
        "attempts per permit and state counted; sweeper candidates in partial indexes",
        // As in SQLite's version 3: the metrics and the sweeper no longer read every attempt.
        // Counts are per permit, so they are moved under the permit's row lock that every
        // writer already holds (no row shared by all permits). The state lists are the
        // model's `leased` and `replays` when this was written; a test keeps the queries'
        // lists equal to them (a partial index is only used for the same literal list).
        r#"
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
    ),
    (
        4,
        "dispatch rounds: each attempt's current round and its capability's hash",
        // As in SQLite's version 4: older attempts keep round 1 and no capability, so no
        // report moves them; their lease turns them uncertain (fail closed).
        r#"
ALTER TABLE attempts ADD COLUMN round INTEGER NOT NULL DEFAULT 1;
ALTER TABLE attempts ADD COLUMN capability_hash TEXT;
"#,
    ),
    (
        5,
        "reconciliation inbox: forwarded key and arguments per attempt, resolution source and evidence",
        // As in SQLite's version 5: older attempts have no forwarded key or arguments, and a
        // resolution without a source was a person's. The partial indexes hold what the inbox
        // lists (uncertain attempts by when they turned so; resolved ones by when).
        r#"
ALTER TABLE attempts ADD COLUMN forwarded_key TEXT;
ALTER TABLE attempts ADD COLUMN arguments TEXT;
ALTER TABLE attempts ADD COLUMN resolution_source TEXT;
ALTER TABLE attempts ADD COLUMN provider_answer TEXT;
CREATE INDEX attempts_uncertain ON attempts(updated_at) WHERE state = 'uncertain';
CREATE INDEX attempts_resolved ON attempts(resolved_at) WHERE resolved_at IS NOT NULL;
"#,
    ),
];

impl PgStore {
    pub(super) async fn migrate(&self, schema: Option<&str>) -> Result<(), LedgerError> {
        let schema = schema.map(str::to_string);
        self.timed(async move |c: &mut deadpool_postgres::Object| {
            let tx = c.transaction().await.map_err(pg_err)?;
            tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
                .await
                .map_err(pg_err)?;
            if let Some(s) = schema.as_deref() {
                // Validated: lowercase letters, digits, '_'.
                tx.batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {s}"))
                    .await
                    .map_err(pg_err)?;
            }
            tx.batch_execute(
                "CREATE TABLE IF NOT EXISTS atmost_migrations (\
                   version INTEGER PRIMARY KEY, description TEXT NOT NULL, \
                   applied_at TIMESTAMPTZ NOT NULL DEFAULT now())",
            )
            .await
            .map_err(pg_err)?;
            let applied: Vec<i32> = tx
                .query("SELECT version FROM atmost_migrations ORDER BY version", &[])
                .await
                .map_err(pg_err)?
                .iter()
                .map(|r| r.try_get(0))
                .collect::<Result<_, _>>()
                .map_err(column_err)?;
            for (version, description, sql) in MIGRATIONS {
                if applied.contains(version) {
                    continue;
                }
                tx.batch_execute(sql).await.map_err(pg_err)?;
                tx.execute(
                    "INSERT INTO atmost_migrations (version, description) VALUES ($1, $2)",
                    &[version, description],
                )
                .await
                .map_err(pg_err)?;
                tracing::info!(version, description, "migration applied");
            }
            let known = MIGRATIONS.iter().map(|m| m.0).max().unwrap_or(0);
            if let Some(newer) = applied.iter().copied().filter(|v| *v > known).max() {
                tracing::warn!(
                    database_version = newer,
                    known,
                    "the database has migrations this ledger does not know (a newer replica ran them)"
                );
            }
            tx.commit().await.map_err(pg_err)?;
            Ok(())
        })
        .await
    }
}
