//! The configuration's defaults and bounds, and the headers the filter reads.

/// Default `permit_header`.
pub const DEFAULT_PERMIT_HEADER: &str = "atmost-permit";
/// Default `ledger.authority`.
pub const DEFAULT_AUTHORITY: &str = "atmost-ledger";
/// Default `ledger.timeout_ms`.
pub const DEFAULT_TIMEOUT_MS: u64 = 1000;
/// Longest `credential_cache_ms`: five minutes, the longest a rotation or a revocation may
/// take to reach a session's requests other than a dispatched call.
pub const MAX_CREDENTIAL_CACHE_MS: u64 = 300_000;

/// Longest `approval_hold_ms`: four minutes, a minute under Envoy's default
/// `stream_idle_timeout` (five minutes), which a held request counts against: nothing moves
/// on its stream while it waits, and the route's timeout has not begun (the router has not
/// had the request yet).
pub const MAX_APPROVAL_HOLD_MS: u64 = 240_000;
/// Longest `report_interval_ms` with `approval_hold_ms` above 0: the root's tick re-asks the
/// ledger for held calls, so a re-ask is never more than this late.
pub const MAX_HOLD_TICK_MS: u64 = 1_000;

/// Longest `report_ride_ms`: a report that waits is an attempt left `in_flight`, which the
/// ledger's lease (300 s by default) must outlast.
pub const MAX_REPORT_RIDE_MS: u64 = 5_000;

/// Default `max_body_bytes` and `max_receipt_bytes` (1 MiB).
pub const DEFAULT_MAX_BYTES: u64 = 1_048_576;
/// Largest accepted `max_body_bytes` / `max_receipt_bytes` (64 MiB).
pub const MAX_MAX_BYTES: u64 = 64 * 1_048_576;
/// Default `report_interval_ms`.
pub const DEFAULT_REPORT_INTERVAL_MS: u64 = 200;
/// Shortest accepted `upstream_key.secret`, in bytes.
pub const MIN_SECRET_BYTES: usize = 16;
/// Default `signature_validity_s`: Envoy's default route timeout.
pub const DEFAULT_SIGNATURE_VALIDITY_S: u64 = 15;
/// Longest accepted `signature_validity_s`: the longest validity the ledger signs.
pub use atmost_protocol::signature::MAX_VALIDITY_S;
/// Shortest accepted `ledger.service_token`, in bytes: the ledger's own minimum.
pub use atmost_protocol::MIN_SERVICE_TOKEN_BYTES;
/// The request headers the filter reads or writes besides the permit header. The permit
/// header may not be one of them, and the filter refuses a request that carries one under
/// another spelling (`_` for `-`): WSGI, Rack and CGI servers read `Idempotency_Key` and
/// `Idempotency-Key` as one header, so the upstream could take the alias's value for the
/// one the filter checked. The last three are the dispatch signature's: the filter writes
/// them on a signed dispatch and removes a client's own from every request.
pub const HEADERS_ATMOST_READS: [&str; 12] = [
    atmost_protocol::IDEMPOTENCY_KEY_HEADER,
    "mcp-method",
    "mcp-name",
    "mcp-protocol-version",
    "mcp-session-id",
    "last-event-id",
    "content-type",
    "content-length",
    "content-encoding",
    "content-digest",
    "signature-input",
    "signature",
];
