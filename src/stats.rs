//! Counters the filter keeps (proxy-wasm metrics; Envoy shows them with its
//! `wasmcustom.` prefix).

use atmost_protocol::DenialCode;

/// One counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stat {
    /// A governed call the ledger let through (sent upstream).
    Dispatched,
    /// A governed call answered from a stored receipt.
    Replayed,
    /// Any denial (local or from the ledger).
    Denied,
    /// Denials with one code.
    DeniedCode(DenialCode),
    /// The ledger could not be asked (unreachable, timeout, bad answer): the call was denied.
    GatewayUnavailable,
    /// A request refused because its body could not be read (413/400 JSON-RPC errors).
    BadRequest,
    /// A dispatched call reported `completed`.
    Completed,
    /// A dispatched call reported `released` (Envoy proves it never reached upstream).
    Released,
    /// A dispatched call reported `uncertain`.
    Uncertain,
    /// A receipt was larger than `max_receipt_bytes` (the call becomes `uncertain`).
    ReceiptTooLarge,
    /// An outcome report could not be delivered and was queued for the root context.
    ReportDeferred,
    /// A batch of queued outcome reports was delivered.
    ReportBatchSent,
    /// A batch of queued outcome reports failed and stays queued.
    ReportBatchFailed,
    /// A queued outcome report was dropped because the queue was full.
    ReportDropped,
    /// A dispatched call answered `input_required` (MCP 2026-07-28); the attempt awaits its continuation.
    InputRequired,
    /// A dispatched call answered with a task handle (`CreateTaskResult`): reported `accepted`.
    Accepted,
    /// A resumable SSE response (events with ids) ended cleanly before the call's answer:
    /// the attempt is left in flight for the resumed GET stream (or the lease sweeper).
    StreamAwaitingResume,
    /// A resumed GET stream (`Last-Event-ID`) carried the answer of a call whose POST stream
    /// closed early; it was reported.
    ResumedReceipt,
    /// A `tools/list` answer gained the permit's figures (`tools_list_limits`).
    ToolsListFigures,
    /// A `tools/list` answer whose figures were asked for passed unchanged: the ledger did
    /// not authenticate the permit, or could not be asked.
    ToolsListUnchanged,
    /// `request_hold: body`: the upstream answered (or its connection failed) before the
    /// decision; the body was not sent and a reserved attempt was released.
    UpstreamAnsweredEarly,
    /// One of Envoy's steering headers ([`crate::call::ENVOY_CONTROL_HEADERS`]) was removed
    /// from a request.
    ControlHeaderRemoved,
}

impl Stat {
    /// Every counter, for defining them up front.
    pub fn all() -> Vec<Stat> {
        let mut all = vec![
            Stat::Dispatched,
            Stat::Replayed,
            Stat::Denied,
            Stat::GatewayUnavailable,
            Stat::BadRequest,
            Stat::Completed,
            Stat::Released,
            Stat::Uncertain,
            Stat::ReceiptTooLarge,
            Stat::ReportDeferred,
            Stat::ReportBatchSent,
            Stat::ReportBatchFailed,
            Stat::ReportDropped,
            Stat::InputRequired,
            Stat::Accepted,
            Stat::StreamAwaitingResume,
            Stat::ResumedReceipt,
            Stat::ToolsListFigures,
            Stat::ToolsListUnchanged,
            Stat::UpstreamAnsweredEarly,
            Stat::ControlHeaderRemoved,
        ];
        all.extend(DenialCode::ALL.iter().map(|c| Stat::DeniedCode(*c)));
        all
    }

    /// The metric's name.
    pub fn name(self) -> String {
        match self {
            Stat::Dispatched => "atmost_dispatched".into(),
            Stat::Replayed => "atmost_replayed".into(),
            Stat::Denied => "atmost_denied".into(),
            Stat::DeniedCode(code) => format!("atmost_denied_{}", code.as_str()),
            Stat::GatewayUnavailable => "atmost_gateway_unavailable".into(),
            Stat::BadRequest => "atmost_bad_request".into(),
            Stat::Completed => "atmost_completed".into(),
            Stat::Released => "atmost_released".into(),
            Stat::Uncertain => "atmost_uncertain".into(),
            Stat::ReceiptTooLarge => "atmost_receipt_too_large".into(),
            Stat::ReportDeferred => "atmost_report_deferred".into(),
            Stat::ReportBatchSent => "atmost_report_batch_sent".into(),
            Stat::ReportBatchFailed => "atmost_report_batch_failed".into(),
            Stat::ReportDropped => "atmost_report_dropped".into(),
            Stat::InputRequired => "atmost_input_required".into(),
            Stat::Accepted => "atmost_accepted".into(),
            Stat::StreamAwaitingResume => "atmost_stream_awaiting_resume".into(),
            Stat::ResumedReceipt => "atmost_resumed_receipt".into(),
            Stat::ToolsListFigures => "atmost_tools_list_figures".into(),
            Stat::ToolsListUnchanged => "atmost_tools_list_unchanged".into(),
            Stat::UpstreamAnsweredEarly => "atmost_upstream_answered_early".into(),
            Stat::ControlHeaderRemoved => "atmost_control_header_removed".into(),
        }
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
        assert!(seen.contains("atmost_denied_permit_invalid"));
        assert_eq!(seen.len(), 21 + DenialCode::ALL.len());
    }
}
