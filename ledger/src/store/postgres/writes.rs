//! Writes of attempts and of the counters that move with them, one statement per kind.

use deadpool_postgres::GenericClient;

use super::rows::{exec, prepared, rounds};
use super::to_i64;
use crate::clock::Millis;
use crate::error::LedgerError;
use crate::model::{Attempt, Resolution};
use crate::store::counters::CounterMoves;
use crate::store::rows::carriers_column;

const INSERT_ATTEMPTS_SQL: &str = "WITH ins AS (INSERT INTO attempts (id, permit_id, tool, key_hash, fingerprint, cost, state, created_at, \
         updated_at, lease_expires_at, finished_at, receipt, reason, replay_count, pruned_at, round, capability_hash, \
         forwarded_key, arguments, forwarded_key_carriers, dispatch_body_sha256, credential) \
         SELECT * FROM unnest($1::TEXT[], $2::TEXT[], $3::TEXT[], $4::TEXT[], $5::TEXT[], $6::BIGINT[], \
         $7::TEXT[], $8::BIGINT[], $9::BIGINT[], $10::BIGINT[], $11::BIGINT[], $12::TEXT[], $13::TEXT[], \
         $14::BIGINT[], $15::BIGINT[], $16::INTEGER[], $17::TEXT[], $18::TEXT[], $19::TEXT[], $20::TEXT[], \
         $21::TEXT[], $22::TEXT[]) \
         RETURNING id, permit_id, key_hash) \
         INSERT INTO idempotency_keys (permit_id, key_hash, attempt_id) \
         SELECT permit_id, key_hash, id FROM ins WHERE key_hash IS NOT NULL \
         ON CONFLICT (permit_id, key_hash) DO UPDATE SET attempt_id = excluded.attempt_id";

const UPSERT_ATTEMPTS_SQL: &str = "INSERT INTO attempts (id, state, updated_at, lease_expires_at, finished_at, receipt, reason, replay_count, \
         pruned_at, resolved_executed, resolved_by, resolved_at, resolution_note, round, capability_hash, \
         resolution_source, provider_answer, forwarded_key, arguments, permit_id, tool, key_hash, fingerprint, cost, \
         created_at, forwarded_key_carriers, dispatch_body_sha256) \
         SELECT * FROM unnest($1::TEXT[], $2::TEXT[], $3::BIGINT[], $4::BIGINT[], $5::BIGINT[], $6::TEXT[], $7::TEXT[], \
         $8::BIGINT[], $9::BIGINT[], $10::BOOLEAN[], $11::TEXT[], $12::BIGINT[], $13::TEXT[], $14::INTEGER[], \
         $15::TEXT[], $16::TEXT[], $17::TEXT[], $18::TEXT[], $19::TEXT[], $20::TEXT[], $21::TEXT[], $22::TEXT[], \
         $23::TEXT[], $24::BIGINT[], $25::BIGINT[], $26::TEXT[], $27::TEXT[]) \
         ON CONFLICT (id) DO UPDATE SET state = excluded.state, updated_at = excluded.updated_at, \
         lease_expires_at = excluded.lease_expires_at, finished_at = excluded.finished_at, receipt = excluded.receipt, \
         reason = excluded.reason, replay_count = excluded.replay_count, pruned_at = excluded.pruned_at, \
         resolved_executed = excluded.resolved_executed, resolved_by = excluded.resolved_by, \
         resolved_at = excluded.resolved_at, resolution_note = excluded.resolution_note, round = excluded.round, \
         capability_hash = excluded.capability_hash, resolution_source = excluded.resolution_source, \
         provider_answer = excluded.provider_answer, forwarded_key = excluded.forwarded_key, \
         arguments = excluded.arguments, forwarded_key_carriers = excluded.forwarded_key_carriers, \
         dispatch_body_sha256 = excluded.dispatch_body_sha256";

const ADD_SLOTS_SQL: &str = "INSERT INTO permit_tool_usage (permit_id, tool, slots_held) \
             SELECT * FROM unnest($1::TEXT[], $2::TEXT[], $3::BIGINT[]) \
             ON CONFLICT (permit_id, tool) DO UPDATE SET slots_held = permit_tool_usage.slots_held + excluded.slots_held";

/// `p.id = ANY($1)` gives the planner an index condition on `permits`: without it, a generic
/// plan cached while the table was small joins the unnested rows to a sequential scan of every
/// permit, for as long as the connection lives (`EXPLAIN` of the cached plan showed
/// `Seq Scan on permits`; with it, `Bitmap Index Scan on permits_pkey`).
const ADD_BUDGET_SQL: &str =
    "UPDATE permits p SET reserved = p.reserved + m.r, spent = p.spent + m.s \
                 FROM unnest($1::TEXT[], $2::BIGINT[], $3::BIGINT[]) AS m(id, r, s) \
                 WHERE p.id = m.id AND p.id = ANY($1)";

const ADD_STATE_COUNTS_SQL: &str = "INSERT INTO permit_state_counts (permit_id, state, n) \
             SELECT * FROM unnest($1::TEXT[], $2::TEXT[], $3::BIGINT[]) \
             ON CONFLICT (permit_id, state) DO UPDATE SET n = permit_state_counts.n + excluded.n";

/// Prepares every write statement on this connection (from its cache after the first time).
/// A group sends its writes and `COMMIT` in one flight, and a write's request leaves at its
/// first poll only when its statement is already prepared: one still to be prepared would
/// wait for that round trip while `COMMIT` went ahead, and run after it, outside the
/// transaction. So the group workers call this before their first flight.
pub(super) async fn prepare_writes<C: GenericClient>(c: &C) -> Result<(), LedgerError> {
    for sql in [
        INSERT_ATTEMPTS_SQL,
        UPSERT_ATTEMPTS_SQL,
        ADD_SLOTS_SQL,
        ADD_BUDGET_SQL,
        ADD_STATE_COUNTS_SQL,
    ] {
        prepared(c, sql).await?;
    }
    Ok(())
}

/// Inserts attempts and points their keys at them in ONE statement (one round trip under the
/// lock, however many). No two of them may have the same key.
pub(super) async fn insert_attempts<C: GenericClient>(
    c: &C,
    attempts: &[Attempt],
) -> Result<(), LedgerError> {
    if attempts.is_empty() {
        return Ok(());
    }
    let mut costs = Vec::with_capacity(attempts.len());
    let mut replays = Vec::with_capacity(attempts.len());
    for a in attempts {
        costs.push(to_i64(a.cost)?);
        replays.push(to_i64(a.replay_count)?);
    }
    let carriers = column(attempts, |a| carriers_column(a.forwarded_key_carriers));
    let credentials = column(attempts, |a| a.credential.as_ref().map(|c| c.to_column()));
    let col = |f: fn(&Attempt) -> &str| attempts.iter().map(f).collect::<Vec<&str>>();
    let opt =
        |f: fn(&Attempt) -> Option<&str>| attempts.iter().map(f).collect::<Vec<Option<&str>>>();
    let num = |f: fn(&Attempt) -> Millis| attempts.iter().map(f).collect::<Vec<Millis>>();
    let opt_num =
        |f: fn(&Attempt) -> Option<Millis>| attempts.iter().map(f).collect::<Vec<Option<Millis>>>();
    exec(
        c,
        INSERT_ATTEMPTS_SQL,
        &[
            &col(|a| &a.id),
            &col(|a| &a.permit_id),
            &col(|a| &a.tool),
            &opt(|a| a.key_hash.as_deref()),
            &col(|a| &a.fingerprint),
            &costs,
            &col(|a| a.state.as_str()),
            &num(|a| a.created_at_ms),
            &num(|a| a.updated_at_ms),
            &num(|a| a.lease_expires_at_ms),
            &opt_num(|a| a.finished_at_ms),
            &opt(|a| a.receipt.as_deref()),
            &opt(|a| a.reason.as_deref()),
            &replays,
            &opt_num(|a| a.pruned_at_ms),
            &rounds(attempts),
            &opt(|a| a.capability_hash.as_deref()),
            &opt(|a| a.forwarded_key.as_deref()),
            &opt(|a| a.arguments.as_deref()),
            &carriers,
            &opt(|a| a.dispatch_body_sha256.as_deref()),
            &credentials,
        ],
    )
    .await?;
    Ok(())
}

/// Writes the new versions of attempts in ONE statement (one round trip, however many). No
/// two of them may be the same attempt (PostgreSQL refuses an upsert that changes a row twice).
///
/// Written as an upsert on the primary key although every attempt written here exists (it
/// was read under its permit's row lock): `ON CONFLICT (id)` finds each row by a probe of
/// the primary key index whatever the plan. The `UPDATE … FROM unnest(…)` it replaces joins
/// the arrays to the table, and its generic plan (the group transactions force generic
/// plans, see `group_tx`) is chosen once per connection on the statistics of that moment: on
/// a table created or grown since its last ANALYZE that was a sequential scan of `attempts`
/// on every write, its cost growing with the table (docs/postgresql.md has the numbers).
/// Only the columns an attempt's transitions change are set on conflict; the others are
/// sent because an INSERT needs them (NOT NULL) and are ignored.
pub(super) async fn update_attempts<C: GenericClient>(
    c: &C,
    attempts: &[Attempt],
) -> Result<(), LedgerError> {
    if attempts.is_empty() {
        return Ok(());
    }
    let mut costs = Vec::with_capacity(attempts.len());
    let mut replays = Vec::with_capacity(attempts.len());
    for a in attempts {
        costs.push(to_i64(a.cost)?);
        replays.push(to_i64(a.replay_count)?);
    }
    fn res(a: &Attempt) -> Option<&Resolution> {
        a.resolution.as_ref()
    }
    exec(
        c,
        UPSERT_ATTEMPTS_SQL,
        &[
            &column(attempts, |a| a.id.as_str()),
            &column(attempts, |a| a.state.as_str()),
            &column(attempts, |a| a.updated_at_ms),
            &column(attempts, |a| a.lease_expires_at_ms),
            &column(attempts, |a| a.finished_at_ms),
            &column(attempts, |a| a.receipt.as_deref()),
            &column(attempts, |a| a.reason.as_deref()),
            &replays,
            &column(attempts, |a| a.pruned_at_ms),
            &column(attempts, |a| res(a).map(|r| r.executed)),
            &column(attempts, |a| res(a).map(|r| r.by.as_str())),
            &column(attempts, |a| res(a).map(|r| r.at_ms)),
            &column(attempts, |a| res(a).and_then(|r| r.note.as_deref())),
            &rounds(attempts),
            &column(attempts, |a| a.capability_hash.as_deref()),
            &column(attempts, |a| res(a).map(|r| r.source.as_str())),
            &column(attempts, |a| {
                res(a).and_then(|r| r.source.provider_answer())
            }),
            &column(attempts, |a| a.forwarded_key.as_deref()),
            &column(attempts, |a| a.arguments.as_deref()),
            &column(attempts, |a| a.permit_id.as_str()),
            &column(attempts, |a| a.tool.as_str()),
            &column(attempts, |a| a.key_hash.as_deref()),
            &column(attempts, |a| a.fingerprint.as_str()),
            &costs,
            &column(attempts, |a| a.created_at_ms),
            &column(attempts, |a| carriers_column(a.forwarded_key_carriers)),
            &column(attempts, |a| a.dispatch_body_sha256.as_deref()),
        ],
    )
    .await?;
    Ok(())
}

/// One column of the attempts, as an array parameter.
fn column<'a, T>(attempts: &'a [Attempt], field: impl Fn(&'a Attempt) -> T) -> Vec<T> {
    attempts.iter().map(field).collect()
}

/// Writes the counter moves a transaction summed ([`CounterMoves`]), in the caller's
/// transaction (which holds the row locks of the permits involved), just before it commits:
/// each counter row once, however many attempts moved it. The statements are sent together
/// (pipelined; the server runs them in order).
pub(super) async fn write_counters<C: GenericClient>(
    c: &C,
    moves: &CounterMoves,
) -> Result<(), LedgerError> {
    let (mut sp, mut st, mut sn) = (Vec::new(), Vec::new(), Vec::new());
    for (p, t, n) in moves.slot_rows() {
        sp.push(p);
        st.push(t);
        sn.push(n);
    }
    let (mut bp, mut br, mut bs) = (Vec::new(), Vec::new(), Vec::new());
    for (p, r, s) in moves.budget_rows() {
        bp.push(p);
        br.push(r);
        bs.push(s);
    }
    let (mut cp, mut cs, mut cn) = (Vec::new(), Vec::new(), Vec::new());
    for (p, s, n) in moves.state_rows() {
        cp.push(p);
        cs.push(s.as_str());
        cn.push(n);
    }
    let (slots, budget, states) = tokio::join!(
        biased;
        add_to_rows(
            c,
            ADD_SLOTS_SQL,
            (&sp, &st, &sn),
        ),
        async {
            if bp.is_empty() {
                return Ok(0);
            }
            exec(
                c,
                ADD_BUDGET_SQL,
                &[&bp, &br, &bs],
            )
            .await
        },
        add_to_rows(
            c,
            ADD_STATE_COUNTS_SQL,
            (&cp, &cs, &cn),
        )
    );
    slots?;
    budget?;
    states?;
    Ok(())
}

/// Adds to counter rows keyed by two texts (created at the amount when missing); nothing is
/// sent when there is nothing to add.
pub(super) async fn add_to_rows<C: GenericClient>(
    c: &C,
    upsert: &str,
    (first, second, amounts): (&Vec<&str>, &Vec<&str>, &Vec<i64>),
) -> Result<u64, LedgerError> {
    if first.is_empty() {
        return Ok(0);
    }
    exec(c, upsert, &[first, second, amounts]).await
}

/// Writes a new version of an attempt in the caller's transaction (which holds the permit's
/// row lock) and adds what it moves to `moves`, which the transaction writes with
/// [`write_counters`] before it commits.
pub(super) async fn write_attempt<C: GenericClient>(
    c: &C,
    old: &Attempt,
    new: &Attempt,
    moves: &mut CounterMoves,
) -> Result<(), LedgerError> {
    // Checked before anything is sent, so a value that cannot be stored leaves no half write.
    storable(new)?;
    update_attempts(c, std::slice::from_ref(new)).await?;
    moves.record(Some(old), new);
    Ok(())
}

/// A value the attempts table cannot hold is refused before anything is sent.
pub(super) fn storable(a: &Attempt) -> Result<(), LedgerError> {
    to_i64(a.cost)?;
    to_i64(a.replay_count)?;
    Ok(())
}
