//! Counters the filter keeps (proxy-wasm metrics; Envoy shows them with its
//! `wasmcustom.` prefix).

use atmost_protocol::DenialCode;

/// Defines [`Stat`] from one table: a counter per row plus one per denial code.
macro_rules! stat_table {
    ($( $(#[$doc:meta])* $variant:ident => $name:literal; )+) => {
        /// One counter.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Stat {
            $( $(#[$doc])* $variant, )+
            /// Denials with one code: `atmost_denied_<code>`.
            DeniedCode(DenialCode),
        }

        impl Stat {
            /// The counters of the table's rows (the per-code ones come from [`DenialCode::ALL`]).
            const ROWS: [Stat; [$($name),+].len()] = [$(Stat::$variant),+];

            /// The metric's name.
            pub fn name(self) -> String {
                match self {
                    $( Stat::$variant => $name.into(), )+
                    Stat::DeniedCode(code) => format!("atmost_denied_{}", code.as_str()),
                }
            }
        }
    };
}

stat_table! {
    /// A governed call the ledger let through (sent upstream).
    Dispatched => "atmost_dispatched";
    /// A governed call answered from a stored receipt.
    Replayed => "atmost_replayed";
    /// Any denial (local or from the ledger).
    Denied => "atmost_denied";
    /// The ledger could not be asked (unreachable, timeout, bad answer): the call was denied.
    GatewayUnavailable => "atmost_gateway_unavailable";
    /// A request refused because its body could not be read (413/400 JSON-RPC errors).
    BadRequest => "atmost_bad_request";
    /// A dispatched call reported `completed`.
    Completed => "atmost_completed";
    /// A dispatched call reported `released` (Envoy proves it never reached upstream).
    Released => "atmost_released";
    /// A dispatched call reported `uncertain`.
    Uncertain => "atmost_uncertain";
    /// A dispatched call a verifier at the tool refused (reported `refused_at_tool`; the
    /// ledger gives its slot back only on the refusal's proof).
    RefusedAtTool => "atmost_refused_at_tool";
    /// A receipt was larger than `max_receipt_bytes` (the call becomes `uncertain`).
    ReceiptTooLarge => "atmost_receipt_too_large";
    /// An outcome report could not be delivered and was queued for the root context.
    ReportDeferred => "atmost_report_deferred";
    /// A batch of queued outcome reports was delivered.
    ReportBatchSent => "atmost_report_batch_sent";
    /// A batch of queued outcome reports failed and stays queued.
    ReportBatchFailed => "atmost_report_batch_failed";
    /// A queued outcome report was dropped because the queue was full.
    ReportDropped => "atmost_report_dropped";
    /// A released call's report delivered on the next authorize callout (`report_ride_ms`).
    ReportRode => "atmost_report_rode";
    /// A report that rode on an authorize callout not answered with its ack: sent again in
    /// a batch of its own.
    ReportRideMissed => "atmost_report_ride_missed";
    /// A dispatched call answered `input_required` (MCP 2026-07-28); the attempt awaits its continuation.
    InputRequired => "atmost_input_required";
    /// A dispatched call answered with a task handle (`CreateTaskResult`): reported `accepted`.
    Accepted => "atmost_accepted";
    /// A resumable SSE response (events with ids) ended cleanly before the call's answer:
    /// the attempt is left in flight for the resumed GET stream (or the lease sweeper).
    StreamAwaitingResume => "atmost_stream_awaiting_resume";
    /// A resumed GET stream (`Last-Event-ID`) carried the answer of a call whose POST stream
    /// closed early; it was reported.
    ResumedReceipt => "atmost_resumed_receipt";
    /// A `tools/list` answer gained the permit's figures (`tools_list_limits`).
    ToolsListFigures => "atmost_tools_list_figures";
    /// A `tools/list` answer whose figures were asked for passed unchanged: the ledger did
    /// not authenticate the permit, or could not be asked.
    ToolsListUnchanged => "atmost_tools_list_unchanged";
    /// `request_hold: body`: the upstream answered (or its connection failed) before the
    /// decision; the body was not sent and a reserved attempt was released.
    UpstreamAnsweredEarly => "atmost_upstream_answered_early";
    /// `request_hold: headers`: a Dispatch answer without a signature the filter could send
    /// (none, malformed, or not over this request): the call was denied
    /// `gateway_unavailable` and its round reported never sent.
    DispatchUnsigned => "atmost_dispatch_unsigned";
    /// A request that asked to switch protocols (an `Upgrade` header, `CONNECT`) on a route
    /// `upgrade_routes` does not name was refused ([`crate::call::upgrade`]).
    UpgradeRefused => "atmost_upgrade_refused";
    /// One of Envoy's steering headers ([`crate::call::ENVOY_CONTROL_HEADERS`]) was removed
    /// from a request.
    ControlHeaderRemoved => "atmost_control_header_removed";
    /// `approval_hold_ms`: a call the ledger answered `approval_required` was held open, the
    /// ledger to be asked again (once per call, at its first such answer).
    ApprovalHeld => "atmost_approval_held";
    /// A held call the ledger then dispatched (a person approved it while it waited).
    ApprovalHoldDispatched => "atmost_approval_hold_dispatched";
    /// A held call the ledger then answered otherwise (`approval_rejected`,
    /// `approval_expired`, any other denial or a replay; the ledger unreachable): that
    /// answer was given.
    ApprovalHoldAnswered => "atmost_approval_hold_answered";
    /// A held call still `approval_required` at `approval_hold_ms`: that denial was given.
    ApprovalHoldTimedOut => "atmost_approval_hold_timed_out";
    /// A held call whose request ended (the client went away) before the hold did: the
    /// ledger is not asked again.
    ApprovalHoldAbandoned => "atmost_approval_hold_abandoned";
    /// `role: "verify"`: a governed call whose dispatch signature verified; it went to the tool.
    Verified => "atmost_verified";
    /// `role: "verify"`: a fetch of the ledger's JWKS that answered a key set.
    KeysRefreshed => "atmost_keys_refreshed";
    /// `role: "verify"`: a fetch of the JWKS that failed (unreachable, timeout, not 200, not
    /// a JWK Set); the keys of the last good fetch stay.
    KeysRefreshFailed => "atmost_keys_refresh_failed";
}

impl Stat {
    /// Every counter, for defining them up front.
    pub fn all() -> Vec<Stat> {
        Stat::ROWS
            .into_iter()
            .chain(DenialCode::ALL.map(Stat::DeniedCode))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_prefixed() {
        let mut seen = std::collections::HashSet::new();
        for s in Stat::all() {
            let n = s.name();
            assert!(n.starts_with("atmost_"));
            assert!(seen.insert(n));
        }
        assert_eq!(seen.len(), Stat::ROWS.len() + DenialCode::ALL.len());
        for code in DenialCode::ALL {
            assert!(seen.contains(&format!("atmost_denied_{code}")), "{code}");
        }
    }

    #[test]
    fn every_counter_has_its_row_in_the_documented_table() {
        let docs = include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/docs/configuration.md"
        ));
        for s in Stat::ROWS {
            let row = format!("| `{}` |", s.name());
            assert!(
                docs.lines().any(|l| l.starts_with(&row)),
                "docs/configuration.md's counter table has no row starting {row:?}"
            );
        }
        assert!(docs
            .lines()
            .any(|l| l.starts_with("| `atmost_denied_<code>` |")));
    }
}
