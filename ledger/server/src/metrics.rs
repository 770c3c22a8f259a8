//! Prometheus metrics of the ledger.

use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

use atmost_ledger::decide::Headroom;
use atmost_ledger::error::LedgerError;
use atmost_ledger::store::OneStatementCounts;
use atmost_protocol::closed_set;

/// The buckets of `atmost_permit_left_ratio`: an alert picks its threshold among them
/// (`le="0.1"`: a reservation left a tenth or less).
pub const PERMIT_LEFT_BUCKETS: [f64; 6] = [0.0, 0.05, 0.1, 0.25, 0.5, 1.0];

closed_set! {
    /// What one reconciler lookup came to: the `result` label of
    /// `atmost_reconciler_lookups_total` ([`Metrics::count_lookup`]), which the shipped alert
    /// on failing lookups names (a test holds the rules to this set).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum LookupResult {
        /// The provider says the call ran: the attempt is resolved executed.
        Executed => "executed";
        /// The provider says it did not run, and the rule trusts it: resolved not executed.
        NotExecuted => "not_executed";
        /// The lookup failed (connection, HTTP or MCP error, `isError: true`).
        Error => "error";
        /// The lookup took longer than the rule's timeout.
        Timeout => "timeout";
        /// The answer has nothing at the rule's pointer.
        MissingField => "missing_field";
        /// The answer holds a value neither of the rule's lists holds.
        UnknownValue => "unknown_value";
        /// "Not found", from a lookup the rule does not call authoritative.
        NotFoundUnconfirmed => "not_found_unconfirmed";
        /// The attempt lacks what the rule's arguments name: nothing was asked.
        NoInput => "no_input";
        /// The resolution could not be recorded.
        StoreError => "store_error";
        /// Someone resolved the attempt first.
        AlreadyResolved => "already_resolved";
    }
}

closed_set! {
    /// What became of one approval event sent to `--approval-webhook`: the `result` label of
    /// `atmost_approval_webhook_deliveries_total` ([`Metrics::count_webhook_delivery`]).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum WebhookDelivery {
        /// A try was answered 2xx.
        Delivered => "delivered";
        /// Every try failed (an answer other than 2xx, a timeout, no connection): dropped.
        Failed => "failed";
        /// The queue was full when the event came: dropped unsent.
        DroppedQueueFull => "dropped_queue_full";
    }
}

pub struct Metrics {
    registry: Registry,
    /// Authorize answers by decision (dispatch, replay, deny) and denial code ("none" otherwise).
    pub authorize: IntCounterVec,
    pub authorize_seconds: Histogram,
    /// The share of a limit each new reservation left, by limit (`calls`: the tool's cap,
    /// `budget`: the permit's budget): what an alert on a permit near its limit reads.
    pub permit_left_ratio: HistogramVec,
    /// Outcome reports by kind (completed, released, uncertain) and ack.
    pub outcomes: IntCounterVec,
    /// Reports without the capability of the attempt's current round (forged, or from a
    /// party the round was not dispatched to), by reported kind.
    pub outcomes_refused: IntCounterVec,
    /// Reports that rode on an authorize, by whether the ledger took them (`taken`: applied
    /// and acknowledged in the answer, whatever each ack; `failed`: answered without acks).
    pub reports_ridden: IntCounterVec,
    /// Duplicate-guard hits by mode (log, enforce).
    pub duplicates: IntCounterVec,
    /// Admin resolutions by result (executed, not_executed).
    pub resolutions: IntCounterVec,
    /// Reconciler lookups by [`LookupResult`]: counted only through [`Metrics::count_lookup`],
    /// so no label outside the set reaches the alert that reads it.
    reconciler_lookups: IntCounterVec,
    /// Approval events sent to the webhook by [`WebhookDelivery`], counted only through
    /// [`Metrics::count_webhook_delivery`].
    webhook_deliveries: IntCounterVec,
    /// Requests refused for a missing or wrong bearer token, by api (service, admin).
    pub unauthorized: IntCounterVec,
    pub auth_limited: IntCounterVec,
    pub readiness_checks: IntCounterVec,
    /// Store failures by operation.
    pub store_errors: IntCounterVec,
    /// Authorize calls answered 503 without a commit because their caller's deadline passed
    /// first (queued too long, or too little time left to commit).
    pub decisions_past_deadline: IntCounter,
    pub sweeps: IntCounter,
    pub leases_expired: IntCounter,
    pub receipts_pruned: IntCounter,
    /// Attempts (with their keys) and permits the purge of ended permits deleted.
    pub attempts_purged: IntCounter,
    pub permits_purged: IntCounter,
    pub permits_created: IntCounter,
    pub permits_revoked: IntCounter,
    /// Dispatch answers this replica signed.
    pub dispatches_signed: IntCounter,
    /// Signing key rotations this replica made.
    pub key_rotations: IntCounter,
    /// Attempts per state, refreshed by the sweeper.
    pub attempts: IntGaugeVec,
    /// PostgreSQL's one-statement writes by kind and result, brought up to the store's own
    /// tally when scraped ([`Metrics::count_one_statement`]).
    pub pg_one_statement: IntCounterVec,
    /// How long the attempt uncertain the longest has been so (0 when none is), refreshed by
    /// the sweeper.
    pub uncertain_oldest_seconds: Gauge,
    /// 1 from the first stop signal on (crate::drain): /readyz reads this very value, so what
    /// is exported and what readiness answers cannot disagree.
    pub draining: IntGauge,
    /// Reloads of the TLS certificate after its files changed, by result (ok, error).
    pub tls_reloads: IntCounterVec,
    /// 1 while the certificate files on disk did not load and the previous pair is served.
    pub tls_reload_failing: IntGauge,
    /// Connections that failed or did not finish their TLS handshake.
    pub tls_handshake_failures: IntCounter,
    /// 1 while the admin tokens file on disk was refused and the previous admins are in force.
    pub admin_tokens_reload_failing: IntGauge,
    /// People's decisions on approvals, by decision (approved, rejected).
    pub approval_decisions: IntCounterVec,
    /// Seconds from a call's approval request to a person's decision.
    pub approval_decision_seconds: Histogram,
    /// Requests and approvals the sweeper expired (`approval_expired`).
    pub approvals_expired: IntCounter,
    /// How long the oldest call waiting for approval has waited (0 when none is), read from
    /// the store when scraped.
    pub approval_oldest_waiting_seconds: Gauge,
}

fn m<T>(r: Result<T, prometheus::Error>) -> Result<T, LedgerError> {
    r.map_err(|e| LedgerError::Invalid(format!("metrics: {e}")))
}

impl Metrics {
    pub fn new() -> Result<Self, LedgerError> {
        let registry = Registry::new();
        let counter_vec =
            |name: &str, help: &str, labels: &[&str]| -> Result<IntCounterVec, LedgerError> {
                let c = m(IntCounterVec::new(Opts::new(name, help), labels))?;
                m(registry.register(Box::new(c.clone())))?;
                Ok(c)
            };
        let counter = |name: &str, help: &str| -> Result<IntCounter, LedgerError> {
            let c = m(IntCounter::new(name, help))?;
            m(registry.register(Box::new(c.clone())))?;
            Ok(c)
        };
        let authorize = counter_vec(
            "atmost_authorize_total",
            "Authorize answers by decision and denial code.",
            &["decision", "code"],
        )?;
        let outcomes = counter_vec(
            "atmost_outcomes_total",
            "Outcome reports by kind and how they were taken.",
            &["kind", "ack"],
        )?;
        let outcomes_refused = counter_vec(
            "atmost_outcome_reports_refused_total",
            "Outcome reports refused because they did not carry the capability of the attempt's current round.",
            &["kind"],
        )?;
        let reports_ridden = counter_vec(
            "atmost_outcome_reports_ridden_total",
            "Outcome reports that rode on an authorize, by whether they were taken (their acks in its answer) or failed (answered without acks; the filter sends them again).",
            &["result"],
        )?;
        let duplicates = counter_vec(
            "atmost_duplicate_suspected_total",
            "New keys whose fingerprint matched a recent attempt, by guard mode.",
            &["mode"],
        )?;
        let resolutions = counter_vec(
            "atmost_resolutions_total",
            "Uncertain attempts resolved by a person or reconciler.",
            &["result"],
        )?;
        let reconciler_lookups = counter_vec(
            "atmost_reconciler_lookups_total",
            "Reconciler lookups at the provider by result; only executed and not_executed resolve an attempt.",
            &["result"],
        )?;
        let webhook_deliveries = counter_vec(
            "atmost_approval_webhook_deliveries_total",
            "Approval events for --approval-webhook by result: delivered (a 2xx answer), failed (every try failed) or dropped_queue_full.",
            &["result"],
        )?;
        let unauthorized = counter_vec(
            "atmost_unauthorized_requests_total",
            "Requests refused for a missing or wrong bearer token.",
            &["api"],
        )?;
        let auth_limited = counter_vec(
            "atmost_auth_failures_limited_total",
            "Failed authentications answered 429 because their source passed the failure limit.",
            &["api"],
        )?;
        let readiness_checks = counter_vec(
            "atmost_readiness_checks_total",
            "Store reads made in the background for /readyz, by result.",
            &["result"],
        )?;
        let store_errors = counter_vec(
            "atmost_store_errors_total",
            "Store failures by operation.",
            &["op"],
        )?;
        let decisions_past_deadline = counter(
            "atmost_decisions_past_deadline_total",
            "Authorize calls answered 503 and not committed because the filter's callout timeout would have passed first.",
        )?;
        let sweeps = counter("atmost_sweeps_total", "Sweeper runs.")?;
        let leases_expired = counter(
            "atmost_leases_expired_total",
            "In-flight attempts turned uncertain by the sweeper after their lease.",
        )?;
        let receipts_pruned = counter(
            "atmost_receipts_pruned_total",
            "Receipts dropped to a tombstone after the permit's retention.",
        )?;
        let attempts_purged = counter(
            "atmost_attempts_purged_total",
            "Attempts deleted, with their idempotency keys, by the purge of permits that ended (expired or revoked) longer ago than --purge-ended-permits-after.",
        )?;
        let permits_purged = counter(
            "atmost_permits_purged_total",
            "Permits deleted, with their counters, by the purge once nothing was left under them.",
        )?;
        let permits_created = counter("atmost_permits_created_total", "Permits created.")?;
        let permits_revoked = counter("atmost_permits_revoked_total", "Permits revoked.")?;
        let dispatches_signed = counter(
            "atmost_dispatches_signed_total",
            "Dispatch answers signed (RFC 9421) with the ledger's active key.",
        )?;
        let key_rotations = counter(
            "atmost_signing_key_rotations_total",
            "Signing key rotations made by this replica.",
        )?;
        let authorize_seconds = m(Histogram::with_opts(
            HistogramOpts::new(
                "atmost_authorize_seconds",
                "Time to answer an authorize call.",
            )
            .buckets(vec![
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
            ]),
        ))?;
        m(registry.register(Box::new(authorize_seconds.clone())))?;
        let permit_left_ratio = m(HistogramVec::new(
            HistogramOpts::new(
                "atmost_permit_left_ratio",
                "Share of the tool's call cap (limit=calls) or of the permit's budget (limit=budget) left after each new reservation, 0 to 1.",
            )
            .buckets(PERMIT_LEFT_BUCKETS.to_vec()),
            &["limit"],
        ))?;
        m(registry.register(Box::new(permit_left_ratio.clone())))?;
        let attempts = m(IntGaugeVec::new(
            Opts::new(
                "atmost_attempts",
                "Attempts per state, read from the store when scraped (at most once a second).",
            ),
            &["state"],
        ))?;
        m(registry.register(Box::new(attempts.clone())))?;
        let pg_one_statement = m(IntCounterVec::new(
            Opts::new(
                "atmost_pg_one_statement_total",
                "PostgreSQL: decisions and reports written by one statement (result applied), and statements that applied nothing, whose call or report then took the locked path (result not_applied).",
            ),
            &["kind", "result"],
        ))?;
        m(registry.register(Box::new(pg_one_statement.clone())))?;
        let uncertain_oldest_seconds = m(Gauge::new(
            "atmost_uncertain_oldest_seconds",
            "Seconds since the attempt uncertain the longest turned uncertain (0 when none is), read from the store when scraped (at most once a second).",
        ))?;
        m(registry.register(Box::new(uncertain_oldest_seconds.clone())))?;
        let draining = m(IntGauge::new(
            "atmost_draining",
            "1 while the ledger drains before a stop (/readyz answers 503), else 0.",
        ))?;
        m(registry.register(Box::new(draining.clone())))?;
        let tls_reloads = counter_vec(
            "atmost_tls_reloads_total",
            "Reloads of the TLS certificate and key after their files changed, by result.",
            &["result"],
        )?;
        let tls_reload_failing = m(IntGauge::new(
            "atmost_tls_reload_failing",
            "1 while the TLS certificate files on disk do not load and the previous certificate is served, else 0.",
        ))?;
        m(registry.register(Box::new(tls_reload_failing.clone())))?;
        let tls_handshake_failures = counter(
            "atmost_tls_handshake_failures_total",
            "Connections that failed or did not finish their TLS handshake.",
        )?;
        let admin_tokens_reload_failing = m(IntGauge::new(
            "atmost_admin_tokens_reload_failing",
            "1 while the admin tokens file on disk is refused and the admins read before stay in force, else 0.",
        ))?;
        m(registry.register(Box::new(admin_tokens_reload_failing.clone())))?;
        let approval_decisions = counter_vec(
            "atmost_approval_decisions_total",
            "People's decisions on calls waiting for approval, by decision (approved, rejected).",
            &["decision"],
        )?;
        let approval_decision_seconds = m(Histogram::with_opts(
            HistogramOpts::new(
                "atmost_approval_decision_seconds",
                "Seconds from a call's approval request to a person's decision.",
            )
            .buckets(vec![
                5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
            ]),
        ))?;
        m(registry.register(Box::new(approval_decision_seconds.clone())))?;
        let approvals_expired = counter(
            "atmost_approvals_expired_total",
            "Calls waiting for approval nobody decided in time, and approvals not used in time, expired by the sweeper (slot and cost back).",
        )?;
        let approval_oldest_waiting_seconds = m(Gauge::new(
            "atmost_approval_oldest_waiting_seconds",
            "Seconds the oldest call waiting for a person's approval has waited (0 when none is), read from the store when scraped (at most once a second).",
        ))?;
        m(registry.register(Box::new(approval_oldest_waiting_seconds.clone())))?;
        Ok(Metrics {
            registry,
            authorize,
            authorize_seconds,
            permit_left_ratio,
            outcomes,
            outcomes_refused,
            reports_ridden,
            duplicates,
            resolutions,
            reconciler_lookups,
            webhook_deliveries,
            unauthorized,
            auth_limited,
            readiness_checks,
            store_errors,
            decisions_past_deadline,
            sweeps,
            leases_expired,
            receipts_pruned,
            attempts_purged,
            permits_purged,
            permits_created,
            permits_revoked,
            dispatches_signed,
            key_rotations,
            attempts,
            pg_one_statement,
            uncertain_oldest_seconds,
            draining,
            tls_reloads,
            tls_reload_failing,
            tls_handshake_failures,
            admin_tokens_reload_failing,
            approval_decisions,
            approval_decision_seconds,
            approvals_expired,
            approval_oldest_waiting_seconds,
        })
    }

    /// The Prometheus text exposition of every metric.
    /// Brings `atmost_pg_one_statement_total` up to the store handle's tally (which only grows).
    pub fn count_one_statement(&self, counts: OneStatementCounts) {
        for (kind, tally) in [("decision", counts.decisions), ("report", counts.reports)] {
            for (result, n) in [
                ("applied", tally.applied),
                ("not_applied", tally.not_applied),
            ] {
                let counter = self.pg_one_statement.with_label_values(&[kind, result]);
                counter.inc_by(n.saturating_sub(counter.get()));
            }
        }
    }

    pub fn render(&self) -> Result<String, LedgerError> {
        let mut buf = Vec::new();
        m(TextEncoder::new().encode(&self.registry.gather(), &mut buf))?;
        String::from_utf8(buf).map_err(|e| LedgerError::Invalid(e.to_string()))
    }

    /// Records what a new reservation left of its permit's limits.
    pub fn observe_headroom(&self, headroom: &Headroom) {
        for (limit, share) in [("calls", headroom.calls), ("budget", headroom.budget)] {
            if let Some(share) = share {
                self.permit_left_ratio
                    .with_label_values(&[limit])
                    .observe(share);
            }
        }
    }

    /// Counts one reconciler lookup under its result.
    pub fn count_lookup(&self, result: LookupResult) {
        self.reconciler_lookups
            .with_label_values(&[result.as_str()])
            .inc();
    }

    /// Counts one approval event under what became of it.
    pub fn count_webhook_delivery(&self, result: WebhookDelivery) {
        self.webhook_deliveries
            .with_label_values(&[result.as_str()])
            .inc();
    }

    /// Exports every [`WebhookDelivery`] series at 0, so that a ledger with a webhook shows
    /// them (and a rate over them is 0, not absent) before the first event.
    pub fn show_webhook_deliveries(&self) {
        for result in WebhookDelivery::ALL {
            self.webhook_deliveries
                .with_label_values(&[result.as_str()]);
        }
    }

    /// Whether a stop signal has come: the ledger reports not ready while it drains.
    pub fn is_draining(&self) -> bool {
        self.draining.get() != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one-statement counters follow the store's tally, however often it is read, and
    /// never go back.
    #[test]
    fn one_statement_counters_follow_the_store_tally() {
        use atmost_ledger::store::Applied;
        let metrics = Metrics::new().unwrap();
        let tally = |applied, not_applied| Applied {
            applied,
            not_applied,
        };
        for (decisions, reports) in [(tally(10, 2), tally(4, 0)), (tally(15, 3), tally(4, 1))] {
            metrics.count_one_statement(OneStatementCounts { decisions, reports });
        }
        metrics.count_one_statement(OneStatementCounts::default());
        let text = metrics.render().unwrap();
        for line in [
            r#"atmost_pg_one_statement_total{kind="decision",result="applied"} 15"#,
            r#"atmost_pg_one_statement_total{kind="decision",result="not_applied"} 3"#,
            r#"atmost_pg_one_statement_total{kind="report",result="applied"} 4"#,
            r#"atmost_pg_one_statement_total{kind="report",result="not_applied"} 1"#,
        ] {
            assert!(text.contains(line), "{line} not in:\n{text}");
        }
    }

    /// Where the shipped alerts and their runbook name `atmost_reconciler_lookups_total`.
    const RULES: [(&str, &str); 3] = [
        (
            "monitoring/atmost-rules.yml",
            include_str!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../monitoring/atmost-rules.yml"
            )),
        ),
        (
            "monitoring/prometheusrule.yaml",
            include_str!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../monitoring/prometheusrule.yaml"
            )),
        ),
        (
            "docs/monitoring.md",
            include_str!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../docs/monitoring.md"
            )),
        ),
    ];

    /// The values every `result` matcher of a `atmost_reconciler_lookups_total{…}` selector
    /// in `text` names (`result="a"`, `result=~"a|b"`, and their negations).
    fn lookup_results_named(text: &str) -> Vec<&str> {
        const SELECTOR: &str = "atmost_reconciler_lookups_total{";
        text.match_indices(SELECTOR)
            .filter_map(|(at, _)| {
                let rest = &text[at + SELECTOR.len()..];
                rest.get(..rest.find('}')?)
            })
            .flat_map(|selector| selector.split(','))
            .filter_map(|matcher| {
                let value = matcher.trim().strip_prefix("result")?;
                let value = value.trim_start_matches(['=', '!', '~']);
                value.strip_prefix('"')?.strip_suffix('"')
            })
            .flat_map(|values| values.split('|'))
            .collect()
    }

    #[test]
    fn the_alerts_name_only_lookup_results_the_reconciler_counts() {
        for (file, text) in RULES {
            let named = lookup_results_named(text);
            assert!(!named.is_empty(), "{file} names no lookup result any more");
            for value in named {
                assert!(
                    LookupResult::from_wire(value).is_some(),
                    "{file} names the lookup result {value:?}, which the reconciler never counts \
                     (it counts {:?})",
                    LookupResult::NAMES
                );
            }
        }
    }

    #[test]
    fn the_reconciler_docs_name_every_lookup_result() {
        let doc = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/ledger.md"));
        let list = "Each lookup is counted in `atmost_reconciler_lookups_total{result}`:";
        let at = doc
            .find(list)
            .expect("docs/ledger.md lists the lookup results");
        let paragraph = doc[at..].split("\n\n").next().unwrap_or_default();
        for name in LookupResult::NAMES {
            assert!(
                paragraph.contains(&format!("`{name}`")),
                "docs/ledger.md's list of lookup results lacks `{name}`"
            );
        }
    }

    #[test]
    fn the_docs_name_every_webhook_delivery_result() {
        let docs = [
            (
                "docs/approvals.md",
                include_str!(concat!(
                    env!("CARGO_MANIFEST_DIR"),
                    "/../../docs/approvals.md"
                )),
            ),
            ("docs/monitoring.md", RULES[2].1),
        ];
        for (file, text) in docs {
            let at = text
                .find("atmost_approval_webhook_deliveries_total{result")
                .unwrap_or_else(|| panic!("{file} does not name the webhook's counter"));
            let paragraph = text[at..].split("\n\n").next().unwrap_or_default();
            for name in WebhookDelivery::NAMES {
                assert!(
                    paragraph.contains(&format!("`{name}`")),
                    "{file}'s paragraph on atmost_approval_webhook_deliveries_total lacks `{name}`"
                );
            }
        }
    }

    #[test]
    fn every_webhook_delivery_result_is_exported_before_the_first_event() {
        let metrics = Metrics::new().unwrap();
        metrics.show_webhook_deliveries();
        metrics.count_webhook_delivery(WebhookDelivery::Failed);
        let text = metrics.render().unwrap();
        for result in WebhookDelivery::ALL {
            let n = u8::from(result == WebhookDelivery::Failed);
            let series =
                format!("atmost_approval_webhook_deliveries_total{{result=\"{result}\"}} {n}");
            assert!(text.contains(&series), "no {series} in:\n{text}");
        }
    }

    #[test]
    fn a_result_outside_the_set_is_seen() {
        let named = lookup_results_named(
            r#"sum(atmost_reconciler_lookups_total{job="x", result=~"error|gone"}) + atmost_reconciler_lookups_total{result!="timeout"}"#,
        );
        assert_eq!(named, ["error", "gone", "timeout"]);
        assert!(LookupResult::from_wire("gone").is_none());
    }

    #[test]
    fn every_lookup_result_is_counted_under_its_name() {
        let metrics = Metrics::new().unwrap();
        for result in LookupResult::ALL {
            metrics.count_lookup(result);
        }
        let text = metrics.render().unwrap();
        for name in LookupResult::NAMES {
            let series = format!("atmost_reconciler_lookups_total{{result=\"{name}\"}} 1");
            assert!(text.contains(&series), "no {series} in:\n{text}");
        }
    }
}
