//! The schema: versioned migrations, applied once each under an advisory lock.

use std::time::Duration;

use deadpool_postgres::GenericClient;
use tokio_postgres::error::SqlState;

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
/// and 8 tables an older ledger never reads, 7 a column and 9 indexes; 12 new attempt
/// states an older ledger cannot read.
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
    Migration {
        version: 10,
        compatible_from: 4,
        description: "permits by retention: the sweep's bound read from one end of an index",
        // As in SQLite's version 10. Additive. The sweep reads the shortest retention of any
        // permit once a second; without the index that reads every permit (21 ms at 10^5
        // permits, 37 ms as their pages left the cache).
        sql: r#"
CREATE INDEX permits_by_retention ON permits(retention_ms);
"#,
    },
    Migration {
        version: 11,
        compatible_from: 4,
        description: "the SHA-256 of the body each attempt's current round was signed over; tool credentials in the ledger's custody (sealed), and the credential each attempt carried",
        // As in SQLite's version 11. Additive: an older ledger's upsert leaves the columns as
        // they were, attempts stored before it have neither, and an older ledger never reads
        // the credentials (its dispatches carry none).
        sql: r#"
ALTER TABLE attempts ADD COLUMN dispatch_body_sha256 TEXT;
CREATE TABLE credentials (
    name       TEXT NOT NULL,
    version    BIGINT NOT NULL,
    header     TEXT NOT NULL,
    form       TEXT NOT NULL,
    route      TEXT NOT NULL,
    sealed     TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (name, version)
);
ALTER TABLE attempts ADD COLUMN credential TEXT;
"#,
    },
    Migration {
        version: 12,
        compatible_from: 12,
        description: "approvals: the approval each attempt waited for; the sweeper's index takes in the two approval states with a lapse time",
        // As in SQLite's version 12. Not additive: an older ledger would not know the new
        // states. The index is built anew with the model's `leased` list, literally.
        sql: r#"
ALTER TABLE attempts ADD COLUMN approval TEXT;
DROP INDEX attempts_leased;
CREATE INDEX attempts_leased ON attempts(lease_expires_at)
    WHERE state IN ('in_flight','awaiting_input','awaiting_approval','approved');
"#,
    },
    Migration {
        version: 13,
        compatible_from: 12,
        description: "one-statement decisions: each tool's slot counter carries a version that every raise of it moves",
        // Additive: the version is kept by the database, whatever ledger writes the row, so a
        // ledger of 12 beside one of 13 moves it too (store/postgres/one_statement.rs reads it).
        // Rows stored before have version 1, as a new row gets: 0 stands for "no row".
        sql: r#"
ALTER TABLE permit_tool_usage ADD COLUMN version BIGINT NOT NULL DEFAULT 1;
CREATE FUNCTION atmost_tool_usage_version() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        NEW.version := 1;
    ELSIF NEW.slots_held > OLD.slots_held THEN
        NEW.version := OLD.version + 1;
    ELSE
        NEW.version := OLD.version;
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER permit_tool_usage_version BEFORE INSERT OR UPDATE ON permit_tool_usage
    FOR EACH ROW EXECUTE FUNCTION atmost_tool_usage_version();
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
    version: 14,
    compatible_from: 12,
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

/// How long a migration's statements wait for a table lock before the migration gives way:
/// rolled back, and tried again after a pause. While a DDL statement waits for its lock,
/// every statement that comes after it on that table queues behind it, decisions included,
/// and those have less than a second (the session's `lock_timeout`): a migration that
/// waited for a long transaction to end would fail them all meanwhile.
const MIGRATION_LOCK_WAIT: Duration = Duration::from_millis(200);
/// How many times a migration gives way before the start fails: about 26 s in all, then the
/// operator reads why in the log instead of a pod that seems to hang.
const MIGRATION_TRIES: u32 = 15;
/// The pause after the first give-way, doubled after each up to [`MIGRATION_PAUSE_MAX`].
const MIGRATION_PAUSE: Duration = Duration::from_millis(100);
const MIGRATION_PAUSE_MAX: Duration = Duration::from_secs(2);

/// How one try of the migrations ended.
enum Try {
    Done,
    /// A table lock was not granted within [`MIGRATION_LOCK_WAIT`]; nothing was applied.
    GaveWay,
}

impl PgStore {
    pub(super) async fn migrate(&self, schema: Option<&str>) -> Result<(), LedgerError> {
        let all: Vec<&Migration> = migrations().collect();
        self.migrate_to(schema, &all, SCHEMA_VERSION).await
    }

    /// Applies what `list` has and the database lacks; `known` is the newest version this
    /// ledger knows (the compatibility rule reads it).
    pub(super) async fn migrate_to(
        &self,
        schema: Option<&str>,
        list: &[&Migration],
        known: i64,
    ) -> Result<(), LedgerError> {
        let mut pause = MIGRATION_PAUSE;
        for attempt in 1..=MIGRATION_TRIES {
            match self.try_migrate(schema, list, known).await? {
                Try::Done => return Ok(()),
                Try::GaveWay => {
                    tracing::warn!(
                        attempt,
                        lock_wait_ms = MIGRATION_LOCK_WAIT.as_millis() as u64,
                        "migration gave way: a table it changes is held by another transaction; trying again"
                    );
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(MIGRATION_PAUSE_MAX);
                }
            }
        }
        Err(LedgerError::Unavailable(format!(
            "postgres: the migration could not take its table locks in {MIGRATION_TRIES} tries \
             (each waits {} ms): a long transaction holds a table it changes",
            MIGRATION_LOCK_WAIT.as_millis()
        )))
    }

    /// One try, in one transaction under the advisory lock: what the database has is read
    /// first; what it lacks is then sent in one message with the `COMMIT`, so the table locks
    /// it takes are held for the server's own work only, never across a round trip.
    async fn try_migrate(
        &self,
        schema: Option<&str>,
        list: &[&Migration],
        known: i64,
    ) -> Result<Try, LedgerError> {
        let schema = schema.map(str::to_string);
        // A migration may build an index on a large table, and a replica starting beside
        // another waits for its migrations on the advisory lock: neither is a decision, so
        // neither runs under the session's timeouts, which the callout timeout bounds.
        let long_work = self.long_work.clone();
        self.timed(async move |c: &mut deadpool_postgres::Object| {
            c.batch_execute(&format!("BEGIN; {long_work}"))
                .await
                .map_err(pg_err)?;
            let read = read_applied(&*c, schema.as_deref(), list, known).await;
            let plan = match read {
                Ok(plan) => plan,
                Err(e) => {
                    // The connection goes back to the pool: never inside this transaction.
                    let _ = c.batch_execute("ROLLBACK").await;
                    return Err(e);
                }
            };
            let message = format!(
                "SET LOCAL lock_timeout = {}; {} COMMIT",
                MIGRATION_LOCK_WAIT.as_millis(),
                plan.sql
            );
            match c.batch_execute(&message).await {
                Ok(()) => {
                    for m in &plan.pending {
                        tracing::info!(
                            version = m.version,
                            description = m.description,
                            compatible_from = m.compatible_from,
                            "migration applied"
                        );
                    }
                    Ok(Try::Done)
                }
                Err(e) => {
                    // An error ended the message before its `COMMIT`: the transaction is
                    // aborted, and rolled back here (a warning only if it already ended).
                    let _ = c.batch_execute("ROLLBACK").await;
                    if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) {
                        Ok(Try::GaveWay)
                    } else {
                        Err(pg_err(e))
                    }
                }
            }
        })
        .await
    }
}

/// Under the advisory lock (taken here): makes sure of the schema and the migrations' table,
/// checks the compatibility rule, and returns the [`Plan`] of what the database lacks, for
/// the caller to send with its `COMMIT`.
async fn read_applied<C: GenericClient>(
    c: &C,
    schema: Option<&str>,
    list: &[&Migration],
    known: i64,
) -> Result<Plan, LedgerError> {
    c.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .await
        .map_err(pg_err)?;
    if let Some(s) = schema {
        // Validated: lowercase letters, digits, '_'.
        c.batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {s}"))
            .await
            .map_err(pg_err)?;
    }
    // The table, and `compatible_from` (it came after the table), only where they are
    // missing: an `ALTER TABLE` would lock the table the readiness check reads, even when
    // it has nothing to add.
    let row = c
        .query_one(
            "SELECT to_regclass('atmost_migrations') IS NOT NULL, EXISTS (SELECT 1 FROM pg_attribute \
             WHERE attrelid = to_regclass('atmost_migrations') AND attname = 'compatible_from' \
             AND NOT attisdropped)",
            &[],
        )
        .await
        .map_err(pg_err)?;
    let (table, column): (bool, bool) = (
        row.try_get(0).map_err(column_err)?,
        row.try_get(1).map_err(column_err)?,
    );
    if !table {
        c.batch_execute(
            "CREATE TABLE atmost_migrations (\
               version INTEGER PRIMARY KEY, description TEXT NOT NULL, \
               applied_at TIMESTAMPTZ NOT NULL DEFAULT now(), compatible_from INTEGER)",
        )
        .await
        .map_err(pg_err)?;
    } else if !column {
        c.batch_execute("ALTER TABLE atmost_migrations ADD COLUMN compatible_from INTEGER")
            .await
            .map_err(pg_err)?;
    }
    let applied: Vec<(i32, Option<i32>)> = c
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
    // Rows written before `compatible_from` existed are released versions this ledger
    // knows: they require nothing newer.
    let required = applied
        .iter()
        .filter_map(|m| m.1.map(i64::from))
        .max()
        .unwrap_or(0);
    let verdict = check_compatibility(known, database, required)?;
    log_verdict(verdict, known);
    Ok(plan(list, &applied))
}

/// What one try sends: the migrations the database lacks, and the statements that apply
/// them, record each and fill in `compatible_from` where a row lacks it (empty when nothing
/// is missing).
struct Plan {
    pending: Vec<Migration>,
    sql: String,
}

/// The [`Plan`] for a database whose `atmost_migrations` rows are `applied`.
fn plan(list: &[&Migration], applied: &[(i32, Option<i32>)]) -> Plan {
    let pending: Vec<Migration> = list
        .iter()
        .filter(|m| !applied.iter().any(|a| a.0 == m.version))
        .map(|m| **m)
        .collect();
    let mut out = String::new();
    for m in &pending {
        out.push_str(m.sql);
        out.push_str(&format!(
            "\nINSERT INTO atmost_migrations (version, description, compatible_from) VALUES ({}, {}, {});\n",
            m.version,
            sql_text(m.description),
            m.compatible_from
        ));
    }
    let backfill: Vec<String> = list
        .iter()
        .filter(|m| applied.iter().any(|a| a.0 == m.version && a.1.is_none()))
        .map(|m| format!("({}, {})", m.version, m.compatible_from))
        .collect();
    if !backfill.is_empty() {
        out.push_str(&format!(
            "UPDATE atmost_migrations m SET compatible_from = v.c FROM (VALUES {}) AS v(version, c) \
             WHERE m.version = v.version AND m.compatible_from IS NULL;\n",
            backfill.join(", ")
        ));
    }
    Plan { pending, sql: out }
}

/// A constant of this file as an SQL string literal.
fn sql_text(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_to_send_when_every_migration_is_recorded() {
        let applied: Vec<(i32, Option<i32>)> = migrations()
            .map(|m| (m.version, Some(m.compatible_from)))
            .collect();
        let all: Vec<&Migration> = migrations().collect();
        let nothing = plan(&all, &applied);
        assert!(nothing.pending.is_empty());
        assert_eq!(nothing.sql, "");
    }

    #[test]
    fn missing_migrations_are_applied_and_recorded_and_old_rows_filled_in() {
        let all: Vec<&Migration> = RELEASED.iter().collect();
        let applied = [(1, None), (2, Some(2))];
        let plan = plan(&all, &applied);
        let pending: Vec<i32> = plan.pending.iter().map(|m| m.version).collect();
        assert_eq!(pending, (3..=13).collect::<Vec<_>>());
        let sql = plan.sql;
        assert!(
            !sql.contains("compatible_from) VALUES (1,"),
            "version 1 is applied already: {sql}"
        );
        assert!(sql.contains("VALUES (3, 'attempts per permit"), "{sql}");
        assert!(sql.contains("(1, 1)") && !sql.contains("(2, 2)"), "{sql}");
        let third = sql.find("VALUES (3,").unwrap_or(usize::MAX);
        let fourth = sql.find("VALUES (4,").unwrap_or(0);
        assert!(third < fourth, "in order: {sql}");
    }

    #[test]
    fn descriptions_are_quoted() {
        assert_eq!(sql_text("it's"), "'it''s'");
    }
}
