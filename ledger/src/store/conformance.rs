//! The store conformance suite, written once over `Arc<dyn Store>`.
//!
//! A store's test module implements [`Harness`] and calls [`conformance_suite!`] once; every
//! check below then runs against it: SQLite's in `store/sqlite/tests.rs` (always built),
//! PostgreSQL's in `store/postgres/tests.rs` (built with the `postgres-tests` feature). Both
//! the decisions and the shared reads are checked through `dyn Store`.
//!
//! The checks are grouped by what they are about: decisions (`decisions.rs`), reports
//! (`reports.rs`), races between two handles (`races.rs`), attempts and permits over time
//! (`lifecycle.rs`), the shared reads (`reads.rs`), signing keys and credentials
//! (`keys_and_credentials.rs`), approvals (`approvals.rs`); what they share is `support.rs`.

mod approvals;
mod decisions;
mod keys_and_credentials;
mod lifecycle;
mod races;
mod reads;
mod reports;
mod support;

pub use approvals::*;
pub use decisions::*;
pub use keys_and_credentials::*;
pub use lifecycle::*;
pub use races::*;
pub use reads::*;
pub use reports::*;
pub use support::*;

/// Instantiates every conformance test for a harness expression.
#[macro_export]
macro_rules! conformance_suite {
    ($make:expr) => {
        $crate::conformance_suite!(@tests $make;
            decision_table, expiry_scope_and_key_required, budget_reserve_spend_release,
            duplicate_guard_modes, outcome_acks, outcome_batch, race_cap_of_one_distinct_keys, race_cap_of_three_distinct_keys, race_same_key,
            race_duplicate_guard, race_budget, sweeper_expires_leases_to_uncertain, retention_tombstones_and_uncertain_kept,
            resolution, durability_across_reopen, permit_admin, input_required_continuations,
            accepted_task_handles, race_continuations, counters_match_recount_after_random_operations,
            state_counts_and_pruning_per_permit_retention, rounds_and_capabilities,
            race_report_against_lease_expiry, race_conflicting_reports_from_two_handles,
            race_resolution_against_late_report, race_revocation_against_authorization,
            race_released_key_dispatched_again, permit_limits_in_answers, inbox_reads,
            uncertain_pages, signing_keys_rotation_and_publication, race_signing_keys,
            inbox_sessions, decisions_past_their_deadline_commit_nothing, purge_of_ended_permits,
            purge_in_bounded_batches, refusals_at_the_tool, dispatch_bodies_recorded,
            credentials_versions_and_reads, race_credential_versions, attempts_keep_their_credential,
            approvals, approvals_rejected_and_lapsed, race_approved_key_dispatched_once,
            race_two_decisions);
    };
    (@tests $make:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                let h = $make;
                $crate::store::conformance::$name(&h).await;
            }
        )*
    };
}
