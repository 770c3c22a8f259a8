//! The PostgreSQL store: several ledger replicas on one database, with the embedded store's
//! guarantees.
//!
//! This file is the [`Decisions`] implementation, one method per operation, each a short
//! transaction over the helpers of the sibling modules (migrations, options, TLS, rows,
//! writes, errors, the decision and outcome workers, the sweep, and the shared reads' dialect
//! in `reads`).
//!
//! # Why READ COMMITTED with one row lock is enough
//!
//! Every transaction that reads or changes a permit's attempts, usage or keys (authorize,
//! outcome reports, resolutions, the sweeper) first takes `SELECT … FOR UPDATE` on that
//! permit's row. So all of them are serialized per permit, across connections and replicas.
//! Under READ COMMITTED each later statement of the transaction takes a fresh snapshot, which
//! therefore contains every commit of every transaction that held the lock before: the
//! snapshot the decision is made on is current, and the reservation written after it commits
//! before the next holder reads. Check and reserve are one atomic step, as with SQLite's
//! `BEGIN IMMEDIATE`; only the lock's scope is one permit instead of the whole file.
//!
//! # Failing closed
//!
//! A pool bounds connections; connecting, waiting for a pooled connection and every
//! statement have timeouts (server side `statement_timeout`, client side a deadline on the
//! whole operation), so a hung or unreachable database turns into a [`LedgerError::Unavailable`]
//! (HTTP 503, the filter denies `gateway_unavailable`), never a hang and never a decision
//! that was not committed. `idle_in_transaction_session_timeout` frees a row lock held by a
//! replica that stopped mid-transaction.
//!
//! States are stored as TEXT via [`AttemptState::as_str`]; which states hold a slot, reserve
//! or spend budget, expire or get pruned is asked of the model and of the pure transitions in
//! [`crate::decide`], so a new state needs no change here.

mod credentials;
mod decisions;
mod errors;
mod group_queue;
mod group_tx;
mod keys;
mod migrations;
mod one_statement;
mod one_statement_outcome;
mod options;
mod outcomes;
mod purge;
mod reads;
mod rows;
mod sweep;
#[cfg(feature = "postgres-tests")]
pub mod testing;
mod tls;
mod writes;

pub use options::{is_postgres_url, redact_url, session_bound, PgOptions, DEFAULT_CALLOUT_TIMEOUT};

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use atmost_protocol::{AuthorizeRequest, OutcomeReport};
use deadpool_postgres::{GenericClient, Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::config::SslMode;

use super::counters::CounterMoves;
use super::purge::{next_batch, PurgeReport, CANDIDATES_PER_READ};
use super::{Decisions, OneStatementCounts, OutcomeResult, SweepReport};
use crate::clock::{Deadline, Millis};
use crate::credentials::{CredentialUse, StoredCredential};
use crate::decide::{self, ApprovalInput, DecideParams, Decision, Leases, ResolveInput, Snapshot};
use crate::error::{ApprovalError, AttemptMoveError, LedgerError, ResolveError};
use crate::keys::{Rotation, SigningKey};
use crate::model::{Attempt, AttemptState, Permit};
use crate::token;
use decisions::{decision_worker, AuthJob, DecisionQueue};
use errors::{column_err, pg_err, pool_err};
use options::{pg_config, valid_schema_name};
use outcomes::{outcome_worker, OutcomeJob, OutcomeQueue};
use rows::{exec, load_attempt, load_permit, lock_permit_of_attempt, query};
use tls::RustlsMakeTls;
use writes::{write_attempt, write_counters};

/// State lists the SQL needs (bound as `TEXT[]` parameters), from the model's rules, so that
/// a state added there needs no change here. The pure transitions in `decide` still have the
/// last word on every row.
#[derive(Debug, Clone)]
struct StateSets {
    gave_back: Vec<String>,
}

impl StateSets {
    fn new() -> Self {
        let names = |pred: &dyn Fn(AttemptState) -> bool| -> Vec<String> {
            AttemptState::ALL
                .into_iter()
                .filter(|s| pred(*s))
                .map(|s| s.as_str().to_string())
                .collect()
        };
        StateSets {
            gave_back: names(&|s| s.gave_back()),
        }
    }
}

pub struct PgStore {
    pool: Pool,
    /// The decision and outcome workers' connections (see [`PgStore::connect`]).
    worker_pool: Pool,
    /// Decisions waiting for their permit's next group transaction.
    decisions: DecisionQueue,
    /// Outcome reports waiting for the next group transaction.
    outcomes: OutcomeQueue,
    states: StateSets,
    /// What the one-statement decisions and reports work on (`one_statement`); `None` when
    /// they are off.
    last_seen: Option<Arc<one_statement::LastSeen>>,
    op_timeout: Duration,
    /// `SET LOCAL statement_timeout` (and `lock_timeout`) of the work that may take long (the
    /// admin API's reads, the sweep's search, the migrations): `--pg-statement-timeout`, where
    /// the session's, bounded by the callout timeout, is shorter.
    long_work: String,
    description: String,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("database", &self.description)
            .finish()
    }
}

/// Waits for a queued operation's answer from its group worker, at most `deadline`.
async fn group_answer<T>(
    answer: tokio::sync::oneshot::Receiver<Result<T, LedgerError>>,
    deadline: Duration,
    dropped: &str,
) -> Result<T, LedgerError> {
    match tokio::time::timeout(deadline, answer).await {
        Ok(Ok(r)) => r,
        Ok(Err(_)) => Err(LedgerError::Join(dropped.into())),
        Err(_) => Err(LedgerError::Unavailable(format!(
            "postgres did not answer within {} ms",
            deadline.as_millis()
        ))),
    }
}

/// Answers every member of a group once its transaction committed, failed, or ran out of
/// time (`None`: answered `cut_off`): one result each on success, the group's error for all
/// otherwise.
fn answer_group<T>(
    replies: impl Iterator<Item = tokio::sync::oneshot::Sender<Result<T, LedgerError>>>,
    outcome: Option<Result<Vec<Result<T, LedgerError>>, LedgerError>>,
    cut_off: LedgerError,
) {
    let group_error = match outcome {
        Some(Ok(results)) => {
            for (reply, r) in replies.zip(results) {
                let _ = reply.send(r);
            }
            return;
        }
        Some(Err(e)) => e,
        None => cut_off,
    };
    for reply in replies {
        let _ = reply.send(Err(group_error.clone()));
    }
}

impl PgStore {
    /// Connects, runs the migrations (under an advisory lock) and returns the store.
    pub async fn connect(opts: &PgOptions) -> Result<Self, LedgerError> {
        if opts.pool_size == 0 {
            return Err(LedgerError::Invalid(
                "the pool size must be at least 1".into(),
            ));
        }
        if let Some(s) = opts.schema.as_deref() {
            if !valid_schema_name(s) {
                return Err(LedgerError::Invalid(format!(
                    "schema {s:?}: use lowercase letters, digits and '_', starting with a letter or '_'"
                )));
            }
        }
        let config = pg_config(opts)?;
        let tls = if config.get_ssl_mode() == SslMode::Disable {
            RustlsMakeTls::disabled()
        } else {
            RustlsMakeTls::new(opts.ca_file.as_deref())?
        };
        let build = |size: usize| {
            let manager = Manager::from_config(
                config.clone(),
                tls.clone(),
                ManagerConfig {
                    recycling_method: RecyclingMethod::Fast,
                },
            );
            Pool::builder(manager)
                .max_size(size)
                .runtime(Runtime::Tokio1)
                .wait_timeout(Some(opts.connect_timeout))
                .create_timeout(Some(opts.connect_timeout))
                .recycle_timeout(Some(opts.connect_timeout))
                .build()
                .map_err(|e| LedgerError::Invariant(format!("postgres pool: {e}")))
        };
        // The decision and outcome workers start on the thread of the request that needs
        // them (the ledger's decision loop), and a connection is driven by the runtime that
        // opened it: so the workers draw from connections only they open, and a decision
        // never waits on another thread (docs/design.md#the-ledgers-hot-path). Two of the
        // pool's connections, one of a pool of two; a pool of one is shared.
        let worker_connections = match opts.pool_size {
            1 => 0,
            2 => 1,
            _ => 2,
        };
        let pool = build(opts.pool_size - worker_connections)?;
        let worker_pool = match worker_connections {
            0 => pool.clone(),
            n => build(n)?,
        };
        let store = PgStore {
            pool,
            worker_pool,
            decisions: Arc::default(),
            outcomes: Arc::default(),
            states: StateSets::new(),
            last_seen: opts
                .one_statement_decisions
                .then(|| Arc::new(one_statement::LastSeen::default())),
            op_timeout: opts.connect_timeout + opts.statement_timeout * 2,
            long_work: {
                let ms = opts.statement_timeout.as_millis().max(1);
                format!("SET LOCAL statement_timeout = {ms}; SET LOCAL lock_timeout = {ms}")
            },
            description: format!(
                "{}{}",
                redact_url(&opts.url),
                opts.schema
                    .as_deref()
                    .map(|s| format!(" schema {s}"))
                    .unwrap_or_default()
            ),
        };
        store.migrate(opts.schema.as_deref()).await?;
        Ok(store)
    }

    /// Runs `read` (statements on `c`) in a read-only transaction of its own under the long
    /// reads' statement timeout.
    async fn long_read<C: GenericClient, T>(
        &self,
        c: &C,
        read: impl std::future::Future<Output = Result<T, LedgerError>>,
    ) -> Result<T, LedgerError> {
        // `read` prepares its statement first (a round trip of its own), so nothing may be
        // sent after it before it is answered: one step after another.
        c.batch_execute(&format!("BEGIN READ ONLY; {}", self.long_work))
            .await
            .map_err(pg_err)?;
        let rows = match read.await {
            Ok(rows) => rows,
            Err(e) => {
                // The connection goes back to the pool: never inside this transaction.
                let _ = c.batch_execute("ROLLBACK").await;
                return Err(e);
            }
        };
        c.batch_execute("COMMIT").await.map_err(pg_err)?;
        Ok(rows)
    }

    /// The database (password redacted) and schema, for logs.
    pub fn description(&self) -> &str {
        &self.description
    }

    /// A person's move of one attempt (a resolution, a decision on an approval): under its
    /// permit's row lock, the attempt read, passed through the pure `step`, and what it returns
    /// written with the counters it moves, in one transaction.
    async fn move_attempt<E, F>(&self, id: &str, step: F) -> Result<Attempt, E>
    where
        E: AttemptMoveError,
        F: FnOnce(&Attempt) -> Result<Attempt, E>,
    {
        self.timed(async |c: &mut deadpool_postgres::Object| {
            let tx = c.transaction().await.map_err(pg_err)?;
            lock_permit_of_attempt(&tx, id).await?;
            let Some(existing) = load_attempt(&tx, id).await? else {
                return Err(E::unknown_attempt());
            };
            let next = step(&existing)?;
            let mut moves = CounterMoves::default();
            write_attempt(&tx, &existing, &next, &mut moves).await?;
            write_counters(&tx, &moves).await?;
            tx.commit().await.map_err(pg_err)?;
            Ok(next)
        })
        .await
    }

    /// Runs `f` on a pooled connection under the operation deadline: a database that does not
    /// answer becomes an error, never a hang. An operation cut off mid-flight may still have
    /// statements (a `COMMIT` even) on their way to the server: its connection is closed,
    /// not returned to the pool, where the next user's statements would queue behind them.
    async fn timed<R, E, F>(&self, f: F) -> Result<R, E>
    where
        E: From<LedgerError>,
        F: AsyncFnOnce(&mut deadpool_postgres::Object) -> Result<R, E>,
    {
        let started = std::time::Instant::now();
        let cut_off = || {
            E::from(LedgerError::Unavailable(format!(
                "postgres did not answer within {} ms",
                self.op_timeout.as_millis()
            )))
        };
        let mut conn = match tokio::time::timeout(self.op_timeout, self.pool.get()).await {
            Ok(conn) => conn.map_err(pool_err)?,
            Err(_) => return Err(cut_off()),
        };
        let left = self.op_timeout.saturating_sub(started.elapsed());
        match tokio::time::timeout(left, f(&mut conn)).await {
            Ok(r) => r,
            Err(_) => {
                drop(deadpool_postgres::Object::take(conn));
                Err(cut_off())
            }
        }
    }
}

#[async_trait]
impl Decisions for PgStore {
    fn one_statement_counts(&self) -> Option<OneStatementCounts> {
        self.last_seen.as_ref().map(|c| c.counts())
    }

    async fn ping(&self) -> Result<(), LedgerError> {
        self.timed(async |c: &mut deadpool_postgres::Object| {
            query(&*c, "SELECT 1 FROM atmost_migrations LIMIT 1", &[]).await?;
            Ok::<_, LedgerError>(())
        })
        .await
    }

    async fn create_permit(&self, p: &Permit) -> Result<(), LedgerError> {
        let policy =
            serde_json::to_string(&p.policy).map_err(|e| LedgerError::Invalid(e.to_string()))?;
        self.timed(async |c: &mut deadpool_postgres::Object| {
            exec(
                &*c,
                "INSERT INTO permits (id, token_hash, label, created_at, expires_at, revoked_at, retention_ms, policy) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
                &[
                    &p.id,
                    &p.token_hash,
                    &p.label,
                    &p.created_at_ms,
                    &p.expires_at_ms,
                    &p.revoked_at_ms,
                    &p.policy.retention_ms,
                    &policy,
                ],
            )
            .await?;
            Ok(())
        })
        .await
    }

    async fn revoke_permit(&self, id: &str, now: Millis) -> Result<Option<Permit>, LedgerError> {
        self.timed(async |c: &mut deadpool_postgres::Object| {
            let tx = c.transaction().await.map_err(pg_err)?;
            exec(
                &tx,
                "UPDATE permits SET revoked_at = $2 WHERE id = $1 AND revoked_at IS NULL",
                &[&id, &now],
            )
            .await?;
            let p = load_permit(&tx, id).await?;
            tx.commit().await.map_err(pg_err)?;
            Ok(p)
        })
        .await
    }

    /// Decisions on one permit are queued and taken in groups: one transaction, one row lock
    /// and one commit for the whole group, the decisions made one after another inside it
    /// (each sees the writes of the ones before). No answer leaves before the group committed.
    async fn authorize_with(
        &self,
        req: &AuthorizeRequest,
        credential: Option<CredentialUse>,
        leases: Leases,
        now: Millis,
        deadline: Deadline,
    ) -> Result<Decision, LedgerError> {
        let params = DecideParams {
            lease_ms: leases.call_ms,
            approval_wait_ms: leases.approval_wait_ms,
            new_attempt_id: token::new_attempt_id()?,
            new_capability: token::new_capability()?,
            credential,
        };
        if token::permit_id_of(&req.permit_token).is_none() {
            // No permit is named: nothing to read or write.
            let snap = Snapshot {
                now_ms: now,
                ..Snapshot::default()
            };
            return Ok(decide::decide(req, &snap, &params));
        }
        let (reply, answer) = tokio::sync::oneshot::channel();
        let job = AuthJob {
            req: req.clone(),
            params,
            now,
            deadline,
            reply,
        };
        if self.decisions.join([job]) {
            tokio::spawn(decision_worker(
                self.worker_pool.clone(),
                self.states.clone(),
                self.op_timeout,
                Arc::clone(&self.decisions),
                self.last_seen.clone(),
            ));
        }
        // A queued decision waits for the group before it too: at most two deadlines.
        group_answer(answer, self.op_timeout * 2, "the decision was dropped").await
    }

    /// Reports are queued and applied in groups (see [`outcome_worker`]): one transaction and
    /// one commit per group; no answer leaves before its group committed.
    async fn record_outcome(
        &self,
        report: &OutcomeReport,
        now: Millis,
    ) -> Result<OutcomeResult, LedgerError> {
        let mut results = self
            .record_outcomes(std::slice::from_ref(report), now)
            .await?;
        results
            .pop()
            .ok_or_else(|| LedgerError::Invariant("the outcome report was dropped".into()))
    }

    /// The batch's reports join the queue together and in order (see [`outcome_worker`]), so
    /// batches sent at the same time share one transaction and one commit. If any report
    /// fails, the call fails: none of them is known to be recorded (retrying is safe: a
    /// report already applied is acknowledged again).
    async fn record_outcomes(
        &self,
        reports: &[OutcomeReport],
        now: Millis,
    ) -> Result<Vec<OutcomeResult>, LedgerError> {
        if reports.is_empty() {
            return Ok(Vec::new());
        }
        let mut answers = Vec::with_capacity(reports.len());
        let jobs: Vec<OutcomeJob> = reports
            .iter()
            .map(|report| {
                let (reply, answer) = tokio::sync::oneshot::channel();
                answers.push(answer);
                OutcomeJob {
                    report: report.clone(),
                    now,
                    reply,
                }
            })
            .collect();
        if self.outcomes.join(jobs) {
            tokio::spawn(outcome_worker(
                self.worker_pool.clone(),
                self.op_timeout,
                Arc::clone(&self.outcomes),
                self.last_seen.clone(),
            ));
        }
        let mut out = Vec::with_capacity(answers.len());
        for answer in answers {
            // A queued report waits for the group before it too: at most two deadlines.
            out.push(
                group_answer(
                    answer,
                    self.op_timeout * 2,
                    "the outcome report was dropped",
                )
                .await?,
            );
        }
        Ok(out)
    }

    async fn resolve_attempt(
        &self,
        id: &str,
        input: &ResolveInput,
        now: Millis,
    ) -> Result<Attempt, ResolveError> {
        self.move_attempt(id, |a| decide::resolve(a, input, now))
            .await
    }

    async fn decide_approval(
        &self,
        id: &str,
        input: &ApprovalInput,
        now: Millis,
    ) -> Result<Attempt, ApprovalError> {
        self.move_attempt(id, |a| {
            decide::decide_approval(a, input, now).map_err(ApprovalError::from)
        })
        .await
    }

    /// Safe with every replica sweeping at once (see [`PgStore::sweep_permits`]).
    async fn sweep(&self, now: Millis) -> Result<SweepReport, LedgerError> {
        self.sweep_permits(now).await
    }

    /// Safe with every replica purging at once: each batch re-reads, under the permit's row
    /// lock, whether the permit has ended and what is still under it.
    async fn purge(&self, ended_before: Millis, limit: u64) -> Result<PurgeReport, LedgerError> {
        self.timed(async |c: &mut deadpool_postgres::Object| {
            let mut report = PurgeReport::default();
            while report.attempts_purged < limit {
                let listed = purge::candidates(&*c, ended_before, CANDIDATES_PER_READ).await?;
                let before = report;
                for permit_id in &listed {
                    while let Some(batch) = next_batch(limit, report.attempts_purged) {
                        let tx = c.transaction().await.map_err(pg_err)?;
                        let (r, done) =
                            purge::purge_batch(&tx, permit_id, ended_before, batch).await?;
                        tx.commit().await.map_err(pg_err)?;
                        report.absorb(r);
                        if done {
                            break;
                        }
                    }
                }
                // Nothing listed, or nothing of it left to this replica (another one purged
                // it first): done for this sweep.
                if report == before {
                    break;
                }
            }
            Ok(report)
        })
        .await
    }

    async fn ensure_signing_key(&self, now: Millis) -> Result<SigningKey, LedgerError> {
        let (candidate, row) = SigningKey::generate(now)?;
        let active = self
            .timed(async |c: &mut deadpool_postgres::Object| {
                let tx = c.transaction().await.map_err(pg_err)?;
                keys::lock_keys(&tx).await?;
                let active = keys::ensure_key(&tx, &row).await?;
                tx.commit().await.map_err(pg_err)?;
                Ok::<_, LedgerError>(active)
            })
            .await?;
        if active.kid == candidate.kid() {
            return Ok(candidate);
        }
        SigningKey::from_stored(&active)
    }

    async fn put_credential(
        &self,
        cred: &StoredCredential,
    ) -> Result<StoredCredential, LedgerError> {
        self.timed(async |c: &mut deadpool_postgres::Object| {
            let tx = c.transaction().await.map_err(pg_err)?;
            let stored = credentials::put_credential(&tx, cred).await?;
            tx.commit().await.map_err(pg_err)?;
            Ok::<_, LedgerError>(stored)
        })
        .await
    }

    async fn rotate_signing_key(&self, now: Millis) -> Result<Rotation, LedgerError> {
        let (active, row) = SigningKey::generate(now)?;
        let retired = self
            .timed(async |c: &mut deadpool_postgres::Object| {
                let tx = c.transaction().await.map_err(pg_err)?;
                keys::lock_keys(&tx).await?;
                let retired = keys::rotate_key(&tx, &row, now).await?;
                tx.commit().await.map_err(pg_err)?;
                Ok::<_, LedgerError>(retired)
            })
            .await?;
        Ok(Rotation { active, retired })
    }

    async fn open_inbox_session(
        &self,
        id_hash: &str,
        now: Millis,
        expires_at: Millis,
    ) -> Result<(), LedgerError> {
        self.timed(async |c: &mut deadpool_postgres::Object| {
            let tx = c.transaction().await.map_err(pg_err)?;
            exec(
                &tx,
                "DELETE FROM inbox_sessions WHERE expires_at <= $1",
                &[&now],
            )
            .await?;
            exec(
                &tx,
                "INSERT INTO inbox_sessions (id_hash, created_at, expires_at) VALUES ($1, $2, $3) \
                 ON CONFLICT (id_hash) DO UPDATE SET created_at = $2, expires_at = $3",
                &[&id_hash, &now, &expires_at],
            )
            .await?;
            tx.commit().await.map_err(pg_err)?;
            Ok::<_, LedgerError>(())
        })
        .await
    }

    async fn inbox_session_open(&self, id_hash: &str, now: Millis) -> Result<bool, LedgerError> {
        self.timed(async |c: &mut deadpool_postgres::Object| {
            let rows = query(
                &*c,
                "SELECT 1 FROM inbox_sessions WHERE id_hash = $1 AND expires_at > $2",
                &[&id_hash, &now],
            )
            .await?;
            Ok::<_, LedgerError>(!rows.is_empty())
        })
        .await
    }

    async fn end_inbox_session(&self, id_hash: &str) -> Result<bool, LedgerError> {
        self.timed(async |c: &mut deadpool_postgres::Object| {
            let n = exec(
                &*c,
                "DELETE FROM inbox_sessions WHERE id_hash = $1",
                &[&id_hash],
            )
            .await?;
            Ok::<_, LedgerError>(n > 0)
        })
        .await
    }

    async fn end_all_inbox_sessions(&self, now: Millis) -> Result<u64, LedgerError> {
        self.timed(async |c: &mut deadpool_postgres::Object| {
            let rows = query(
                &*c,
                "WITH ended AS (DELETE FROM inbox_sessions RETURNING expires_at) \
                 SELECT COUNT(*) FILTER (WHERE expires_at > $1) FROM ended",
                &[&now],
            )
            .await?;
            let open: i64 = match rows.first() {
                Some(row) => row.try_get(0).map_err(pg_err)?,
                None => 0,
            };
            Ok::<_, LedgerError>(u64::try_from(open).unwrap_or(0))
        })
        .await
    }
}

#[cfg(test)]
mod tests;
