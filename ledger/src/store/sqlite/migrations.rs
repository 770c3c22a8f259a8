//! The schema and its versioned migrations (`PRAGMA user_version`).

use rusqlite::{Connection, TransactionBehavior};

use super::sql_err;
use crate::error::LedgerError;
use crate::store::schema::{check_compatibility, log_verdict};

pub(super) const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS permits (
    id           TEXT PRIMARY KEY,
    token_hash   TEXT NOT NULL,
    label        TEXT NOT NULL,
    created_at   INTEGER NOT NULL,
    expires_at   INTEGER NOT NULL,
    revoked_at   INTEGER,
    retention_ms INTEGER NOT NULL,
    policy       TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS attempts (
    id                TEXT PRIMARY KEY,
    permit_id         TEXT NOT NULL REFERENCES permits(id),
    tool              TEXT NOT NULL,
    key_hash          TEXT,
    fingerprint       TEXT NOT NULL,
    cost              INTEGER NOT NULL,
    state             TEXT NOT NULL,
    created_at        INTEGER NOT NULL,
    updated_at        INTEGER NOT NULL,
    lease_expires_at  INTEGER NOT NULL,
    finished_at       INTEGER,
    receipt           TEXT,
    reason            TEXT,
    replay_count      INTEGER NOT NULL DEFAULT 0,
    pruned_at         INTEGER,
    resolved_executed INTEGER,
    resolved_by       TEXT,
    resolved_at       INTEGER,
    resolution_note   TEXT
);
CREATE INDEX IF NOT EXISTS attempts_by_permit_tool_state ON attempts(permit_id, tool, state);
CREATE INDEX IF NOT EXISTS attempts_by_permit_fingerprint ON attempts(permit_id, fingerprint, created_at);
CREATE INDEX IF NOT EXISTS attempts_by_state_lease ON attempts(state, lease_expires_at);
CREATE TABLE IF NOT EXISTS idempotency_keys (
    permit_id  TEXT NOT NULL,
    key_hash   TEXT NOT NULL,
    attempt_id TEXT NOT NULL REFERENCES attempts(id),
    PRIMARY KEY (permit_id, key_hash)
);
"#;

/// Version 2: O(1) counters kept in the same transaction as every write that moves a slot or
/// budget (see [`decide::counter_delta`]), backfilled from the attempts. The state lists are
/// the model's rules as they were when this migration was written (a migration never changes).
pub(super) const MIGRATION_2: &str = r#"
CREATE TABLE IF NOT EXISTS permit_tool_usage (
    permit_id  TEXT NOT NULL,
    tool       TEXT NOT NULL,
    slots_held INTEGER NOT NULL,
    PRIMARY KEY (permit_id, tool)
) WITHOUT ROWID;
ALTER TABLE permits ADD COLUMN reserved INTEGER NOT NULL DEFAULT 0;
ALTER TABLE permits ADD COLUMN spent INTEGER NOT NULL DEFAULT 0;
INSERT INTO permit_tool_usage (permit_id, tool, slots_held)
    SELECT permit_id, tool, COUNT(*) FROM attempts
    WHERE state IN ('in_flight','completed','uncertain','resolved_executed','awaiting_input','accepted')
    GROUP BY permit_id, tool;
UPDATE permits SET
    reserved = COALESCE((SELECT SUM(cost) FROM attempts a WHERE a.permit_id = permits.id
                         AND a.state IN ('in_flight','awaiting_input')), 0),
    spent = COALESCE((SELECT SUM(cost) FROM attempts a WHERE a.permit_id = permits.id
                      AND a.state IN ('completed','uncertain','resolved_executed','accepted')), 0);
"#;

/// Version 3: what used to be read by scanning every attempt is kept or indexed for what it
/// is. Attempts per state are counted in a table kept in the writing transaction (the metrics
/// read it every sweep). The lease sweeper and the receipt pruner read partial indexes that
/// hold only their candidates, so their work follows the candidates, not the history. The
/// two indexes over every attempt's state (changed by every report) are gone. The state lists
/// are the model's `leased` and `replays` when this was written; the queries build the same
/// lists, and a test keeps them equal.
pub(super) const MIGRATION_3: &str = r#"
CREATE TABLE IF NOT EXISTS attempt_state_counts (
    state TEXT PRIMARY KEY,
    n     INTEGER NOT NULL
) WITHOUT ROWID;
INSERT INTO attempt_state_counts (state, n) SELECT state, COUNT(*) FROM attempts GROUP BY state;
DROP INDEX IF EXISTS attempts_by_permit_tool_state;
DROP INDEX IF EXISTS attempts_by_state_lease;
CREATE INDEX IF NOT EXISTS attempts_leased ON attempts(lease_expires_at)
    WHERE state IN ('in_flight','awaiting_input');
CREATE INDEX IF NOT EXISTS attempts_prunable ON attempts(COALESCE(finished_at, updated_at))
    WHERE pruned_at IS NULL AND state IN ('completed','resolved_executed','accepted');
"#;

/// Version 4: dispatch rounds. Each attempt keeps its current round and the SHA-256 of that
/// round's capability; a report must name the round and carry the capability. Attempts
/// written before have round 1 and no capability, so no report moves them: their lease
/// turns them `uncertain` (fail closed), and an operator resolves them.
pub(super) const MIGRATION_4: &str = r#"
ALTER TABLE attempts ADD COLUMN round INTEGER NOT NULL DEFAULT 1;
ALTER TABLE attempts ADD COLUMN capability_hash TEXT;
"#;

/// Version 5: the reconciliation inbox. Each attempt keeps the `Idempotency-Key` value its
/// upstream received (as the filter said) and the call's arguments; a resolution keeps its
/// source (`person` or `reconciler`) and the provider's answer the reconciler went by.
/// Attempts written before have none of these; a resolution without a source was a
/// person's. Partial indexes hold what the inbox lists: `uncertain` attempts by when they
/// turned so (also read for `atmost_uncertain_oldest_seconds`), and resolved ones by when.
pub(super) const MIGRATION_5: &str = r#"
ALTER TABLE attempts ADD COLUMN forwarded_key TEXT;
ALTER TABLE attempts ADD COLUMN arguments TEXT;
ALTER TABLE attempts ADD COLUMN resolution_source TEXT;
ALTER TABLE attempts ADD COLUMN provider_answer TEXT;
CREATE INDEX IF NOT EXISTS attempts_uncertain ON attempts(updated_at) WHERE state = 'uncertain';
CREATE INDEX IF NOT EXISTS attempts_resolved ON attempts(resolved_at) WHERE resolved_at IS NOT NULL;
"#;

/// Version 6: the signing keys (see [`crate::keys`]). One row per key, its PKCS#8 document
/// beside its public half; a partial unique index admits one active key (no `retired_at`),
/// so processes sharing the file can never make two. Additive: an older ledger ignores it.
pub(super) const MIGRATION_6: &str = r#"
CREATE TABLE IF NOT EXISTS signing_keys (
    kid           TEXT PRIMARY KEY,
    public_key    TEXT NOT NULL,
    private_pkcs8 TEXT NOT NULL,
    created_at    INTEGER NOT NULL,
    retired_at    INTEGER
) WITHOUT ROWID;
CREATE UNIQUE INDEX IF NOT EXISTS signing_keys_one_active ON signing_keys((retired_at IS NULL))
    WHERE retired_at IS NULL;
"#;

/// Version 7: where each attempt's forwarded key reached the upstream (the `Idempotency-Key`
/// header, `params._meta`, `params.idempotencyKey`), as the filter said: the carriers' names
/// joined by `,`. Attempts written before have none, which the reconciler takes as "reached
/// no carrier" and never as the header. Additive: an older ledger leaves the column alone.
pub(super) const MIGRATION_7: &str = r#"
ALTER TABLE attempts ADD COLUMN forwarded_key_carriers TEXT;
"#;

/// Version 8: the inbox's sessions, one row per signed-in session (the SHA-256 of its id),
/// so that signing out or `atmost inbox sessions revoke --all` ends a session on every
/// replica whatever its cookie says. Additive: an older ledger never reads it (its sessions
/// are its cookies alone).
pub(super) const MIGRATION_8: &str = r#"
CREATE TABLE IF NOT EXISTS inbox_sessions (
    id_hash    TEXT PRIMARY KEY,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL
) WITHOUT ROWID;
"#;

/// Version 9: what the purge of ended permits reads (docs/design.md#purging-ended-permits):
/// permits by expiry and by revocation, and keys by attempt, which the foreign key's check
/// reads when an attempt is deleted (without it, every key). Additive: an older ledger never
/// purges.
pub(super) const MIGRATION_9: &str = r#"
CREATE INDEX IF NOT EXISTS permits_by_expiry ON permits(expires_at);
CREATE INDEX IF NOT EXISTS permits_revoked ON permits(revoked_at) WHERE revoked_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS idempotency_keys_by_attempt ON idempotency_keys(attempt_id);
"#;

/// Version 10: permits by retention, so the sweep's bound (the shortest retention of any
/// permit) is read from one end of an index instead of from every permit. Additive.
pub(super) const MIGRATION_10: &str = r#"
CREATE INDEX IF NOT EXISTS permits_by_retention ON permits(retention_ms);
"#;

/// Version 11: the SHA-256 of the body the current round was signed over, so a dispatch
/// signature is tied to the attempt it records (docs/signatures.md#signed-receipts); tool
/// credentials in the ledger's custody (crate::credentials), one row per version of each name,
/// the secret sealed; and which credential (`name:version`) each attempt's dispatch carried.
/// Additive: an older ledger's update leaves the columns as they were, attempts stored before
/// it have neither, and an older ledger never reads the credentials (its dispatches carry
/// none).
pub(super) const MIGRATION_11: &str = r#"
ALTER TABLE attempts ADD COLUMN dispatch_body_sha256 TEXT;
CREATE TABLE IF NOT EXISTS credentials (
    name       TEXT NOT NULL,
    version    INTEGER NOT NULL,
    header     TEXT NOT NULL,
    form       TEXT NOT NULL,
    route      TEXT NOT NULL,
    sealed     TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (name, version)
) WITHOUT ROWID;
ALTER TABLE attempts ADD COLUMN credential TEXT;
"#;

/// Version 12: approvals (docs/approvals.md). Each attempt may keep the approval it waited
/// for; two new states hold a slot with a lapse time the sweeper keeps, so the sweeper's
/// partial index takes them in (its list is the model's `leased`, literally: a partial index
/// serves only a query that names the same list). Not additive: an older ledger would not know
/// the new states, so it may not serve once a newer one migrated the file.
pub(super) const MIGRATION_12: &str = r#"
ALTER TABLE attempts ADD COLUMN approval TEXT;
DROP INDEX IF EXISTS attempts_leased;
CREATE INDEX IF NOT EXISTS attempts_leased ON attempts(lease_expires_at)
    WHERE state IN ('in_flight','awaiting_input','awaiting_approval','approved');
"#;

/// Version 14, the rehearsal of the next schema version (feature `schema-rehearsal`, never
/// released): as PostgreSQL's version 14, additive.
#[cfg(feature = "schema-rehearsal")]
const MIGRATION_14: &str = r#"
ALTER TABLE attempts ADD COLUMN decided_by TEXT;
CREATE INDEX IF NOT EXISTS attempts_by_permit_created ON attempts(permit_id, created_at);
"#;

/// The schema version this ledger writes (`PRAGMA user_version`).
pub use crate::store::schema::SCHEMA_VERSION;

/// Per schema version, the oldest schema version a ledger may know and still serve on the
/// file (the rule: store/schema.rs), as for PostgreSQL. Kept in `atmost_schema_compat`, so
/// an older ledger opening a file a newer one migrated can tell whether it may serve.
const COMPATIBLE_FROM: &[(i64, i64)] = &[
    (1, 1),
    (2, 2),
    (3, 3),
    (4, 4),
    (5, 4),
    (6, 4),
    (7, 4),
    (8, 4),
    (9, 4),
    (10, 4),
    (11, 4),
    (12, 12),
    (13, 12),
    #[cfg(feature = "schema-rehearsal")]
    (14, 12),
];

const COMPAT_TABLE: &str = "CREATE TABLE IF NOT EXISTS atmost_schema_compat (\
    version INTEGER PRIMARY KEY, compatible_from INTEGER NOT NULL) WITHOUT ROWID";

/// Brings the file to [`SCHEMA_VERSION`] in one `BEGIN IMMEDIATE` transaction (so processes
/// opening the same file together migrate it once). A file whose schema needs a newer
/// ledger is refused before anything is written.
pub(super) fn migrate(conn: &mut Connection) -> Result<(), LedgerError> {
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(sql_err)?;
    let version: i64 = tx.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    tx.execute_batch(COMPAT_TABLE)?;
    let required: i64 = tx.query_row(
        "SELECT COALESCE(MAX(compatible_from), 0) FROM atmost_schema_compat",
        [],
        |r| r.get(0),
    )?;
    let verdict = check_compatibility(SCHEMA_VERSION, version, required)?;
    if version < 1 {
        // Version 1 predates the version number: its tables may already exist.
        tx.execute_batch(SCHEMA)?;
    }
    if version < 2 {
        tx.execute_batch(MIGRATION_2)?;
    }
    if version < 3 {
        tx.execute_batch(MIGRATION_3)?;
    }
    if version < 4 {
        tx.execute_batch(MIGRATION_4)?;
    }
    if version < 5 {
        tx.execute_batch(MIGRATION_5)?;
    }
    if version < 6 {
        tx.execute_batch(MIGRATION_6)?;
    }
    if version < 7 {
        tx.execute_batch(MIGRATION_7)?;
    }
    if version < 8 {
        tx.execute_batch(MIGRATION_8)?;
    }
    if version < 9 {
        tx.execute_batch(MIGRATION_9)?;
    }
    if version < 10 {
        tx.execute_batch(MIGRATION_10)?;
    }
    if version < 11 {
        tx.execute_batch(MIGRATION_11)?;
    }
    if version < 12 {
        tx.execute_batch(MIGRATION_12)?;
    }
    // Version 13 changed PostgreSQL's schema only (the tool slot counters' version, which
    // only PostgreSQL's one-statement decisions read): nothing to do here.
    #[cfg(feature = "schema-rehearsal")]
    if version < 14 {
        tx.execute_batch(MIGRATION_14)?;
    }
    for (v, compatible_from) in COMPATIBLE_FROM {
        tx.execute(
            "INSERT OR IGNORE INTO atmost_schema_compat (version, compatible_from) VALUES (?1, ?2)",
            [v, compatible_from],
        )?;
    }
    if version < SCHEMA_VERSION {
        tx.execute_batch(&format!("PRAGMA user_version = {SCHEMA_VERSION}"))?;
        tracing::info!(
            from = version,
            to = SCHEMA_VERSION,
            "sqlite schema migrated"
        );
    }
    log_verdict(verdict, SCHEMA_VERSION);
    tx.commit()?;
    Ok(())
}
