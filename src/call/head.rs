//! Reading a request's headers as the machine needs them ([`RequestHead::from_headers`]):
//! the values atmost acts on, the steering headers Envoy's router would obey, names that
//! alias a header atmost reads, and whether a resume ticket is this request's to take
//! ([`RequestHead::admit_resume`]); and a response's ([`ResponseHead::from_content_type`]).
//! Which value of a request header counts when it repeats is decided here, not by the host.

use super::signing::SIGNATURE_HEADERS;
use super::step::{RequestHead, ResponseHead, Upgrade, IDEMPOTENCY_HEADER};
use crate::call::resume::Ticket;

/// Request headers by which a client steers what Envoy's router does with the request
/// after every HTTP filter has run. The filter removes them from every request, at
/// request-headers time, before any byte can leave:
///
/// - retries and hedges (`x-envoy-retry-on`, `x-envoy-retry-grpc-on`,
///   `x-envoy-max-retries`, `x-envoy-retriable-status-codes`,
///   `x-envoy-retriable-header-names`, `x-envoy-hedge-on-per-try-timeout`): a retry or a
///   hedge is a second dispatch of a call the ledger authorized once;
/// - timeouts (`x-envoy-upstream-rq-timeout-ms`, `x-envoy-upstream-rq-per-try-timeout-ms`,
///   `x-envoy-expected-rq-timeout-ms`, `x-envoy-upstream-stream-duration-ms`): a call cut
///   short by its own client turns `uncertain`, and a per-try timeout is what a hedge
///   fires on;
/// - `x-envoy-upstream-rq-timeout-alt-response`: a timed-out call would be answered 204,
///   which a client can take for success;
/// - `x-envoy-upstream-alt-stat-name`: counts the call in stats under a name the client
///   picks;
/// - `x-envoy-original-dst-host`: picks the upstream host, on a cluster that reads it.
///
/// Envoy drops them itself only from requests it considers external, a judgement made
/// from `x-forwarded-for`, `use_remote_address` and `internal_address_config`, which a
/// client in the pod can sway; the filter does not depend on it. Not listed: the headers
/// the connection manager acts on before any filter runs (`x-envoy-force-trace`,
/// `x-envoy-internal`, `x-envoy-ip-tags`, `x-envoy-decorator-operation`), which removing
/// here would not undo, and those Istio's own filters add on the outbound path
/// (`x-envoy-peer-metadata`, `x-envoy-peer-metadata-id`).
pub const ENVOY_CONTROL_HEADERS: [&str; 13] = [
    "x-envoy-retry-on",
    "x-envoy-retry-grpc-on",
    MAX_RETRIES_HEADER,
    "x-envoy-retriable-status-codes",
    "x-envoy-retriable-header-names",
    "x-envoy-hedge-on-per-try-timeout",
    "x-envoy-upstream-rq-timeout-ms",
    "x-envoy-upstream-rq-per-try-timeout-ms",
    "x-envoy-expected-rq-timeout-ms",
    "x-envoy-upstream-stream-duration-ms",
    "x-envoy-upstream-rq-timeout-alt-response",
    "x-envoy-upstream-alt-stat-name",
    "x-envoy-original-dst-host",
];

/// Set to `0` on every POST the filter lets through: a filter's value of it overrides the
/// route's retry policy (Envoy 1.40 reads it in the router and removes it, so the upstream
/// never sees it), and a route whose policy retries (Istio's default does, on
/// connect-failure and 503) would otherwise send a governed call twice.
pub const MAX_RETRIES_HEADER: &str = "x-envoy-max-retries";

/// The headers atmost reads or writes besides the permit header (one table with the
/// configuration's check of `permit_header`).
pub use atmost_config::HEADERS_ATMOST_READS;

/// `name` (lowercase) is `target` under another spelling: equal once `_` is read as `-`,
/// but not the same bytes.
fn aliases(name: &str, target: &str) -> bool {
    name.len() == target.len()
        && name != target
        && name
            .bytes()
            .zip(target.bytes())
            .all(|(a, b)| dash(a) == dash(b))
}

fn dash(b: u8) -> u8 {
    match b {
        b'_' => b'-',
        other => other,
    }
}

/// The entry of [`ENVOY_CONTROL_HEADERS`] that `name` (lowercase) is.
fn control_header(name: &str) -> Option<&'static str> {
    if !name.starts_with("x-envoy-") {
        return None;
    }
    ENVOY_CONTROL_HEADERS.iter().copied().find(|h| *h == name)
}

fn text(value: &[u8]) -> String {
    String::from_utf8_lossy(value).trim().to_string()
}

impl RequestHead {
    /// Reads Envoy's request header map (names in any letter case, in the order Envoy
    /// holds them). The permit header, `Idempotency-Key`, `Content-Type` and
    /// `Content-Encoding` keep every value, so a repeat can be refused; of the mirrored
    /// `Mcp-Method` / `Mcp-Name` the first is kept and a repeat marked; of
    /// `MCP-Protocol-Version`, `Mcp-Session-Id` and `Last-Event-ID` the first value counts.
    /// `resume` is left to the caller, which holds the shared data it comes from.
    pub fn from_headers<N: AsRef<str>, V: Into<Vec<u8>>>(
        headers: impl IntoIterator<Item = (N, V)>,
        permit_header: &str,
        end_of_stream: bool,
    ) -> RequestHead {
        let mut head = RequestHead {
            end_of_stream,
            ..RequestHead::default()
        };
        for (name, value) in headers {
            let name = name.as_ref().to_ascii_lowercase();
            let value: Vec<u8> = value.into();
            if head.upgrade.is_none() {
                head.upgrade = Upgrade::of_header(&name, &value);
            }
            if head.alias.is_none()
                && (aliases(&name, permit_header)
                    || HEADERS_ATMOST_READS.iter().any(|h| aliases(&name, h)))
            {
                head.alias = Some(name.clone());
            }
            if name == permit_header {
                head.permit.push(value);
            } else if name == IDEMPOTENCY_HEADER {
                head.idempotency_key.push(value);
            } else if name == ":method" {
                head.method = String::from_utf8_lossy(&value).into_owned();
            } else if name == ":path" {
                head.path = String::from_utf8_lossy(&value).into_owned();
            } else if name == ":authority" {
                head.authority = String::from_utf8_lossy(&value).into_owned();
            } else if name == "mcp-method" || name == "mcp-name" {
                let slot = if name == "mcp-method" {
                    &mut head.mirrored.method
                } else {
                    &mut head.mirrored.name
                };
                if slot.is_some() {
                    head.mirrored.duplicated = true;
                } else {
                    *slot = Some(text(&value));
                }
            } else if name == "mcp-protocol-version" {
                if head.mirrored.protocol_version.is_none() {
                    head.mirrored.protocol_version = Some(text(&value));
                }
            } else if name == "mcp-session-id" {
                if head.session_id.is_none() {
                    head.session_id = Some(text(&value));
                }
            } else if name == "last-event-id" {
                if head.last_event_id.is_none() {
                    head.last_event_id = Some(text(&value));
                }
            } else if name == "content-type" {
                head.content_type.push(value);
            } else if name == "content-encoding" {
                head.content_encoding.push(value);
            } else if name == "content-length" {
                head.content_length = std::str::from_utf8(&value)
                    .ok()
                    .and_then(|v| v.trim().parse().ok());
            } else if let Some(control) = control_header(&name) {
                if !head.control_headers.contains(&control) {
                    head.control_headers.push(control);
                }
            } else if let Some(signature) = SIGNATURE_HEADERS.iter().find(|h| **h == name) {
                if !head.signature_headers.contains(signature) {
                    head.signature_headers.push(signature);
                }
            }
        }
        head
    }

    /// The shared-data key of the resume ticket this request may take: a GET with
    /// `Last-Event-ID` that will not be refused for an alias and does not ask to upgrade
    /// (taking the ticket uses it up).
    pub fn resume_key(&self) -> Option<String> {
        if !self.method.eq_ignore_ascii_case("GET")
            || self.alias.is_some()
            || self.upgrade.is_some()
        {
            return None;
        }
        let last = self.last_event_id.as_deref()?;
        Some(crate::call::resume::key(self.session_id.as_deref(), last))
    }

    /// The ticket stored under [`RequestHead::resume_key`], if this request may take it: a
    /// readable ticket that [`Ticket::admits`] this request's permit and path. `None` leaves
    /// the stored value where it is (an empty value is a ticket already taken).
    pub fn admit_resume(&self, stored: &[u8]) -> Option<Ticket> {
        Ticket::from_bytes(stored).filter(|t| t.admits(&self.permit, &self.path))
    }
}

impl ResponseHead {
    /// A response's head from the first `Content-Type` value Envoy holds (its one-value
    /// lookup answers the first), kept as sent and read lossily as text.
    pub fn from_content_type(value: Option<&[u8]>, end_of_stream: bool) -> ResponseHead {
        ResponseHead {
            content_type: value.map(|v| String::from_utf8_lossy(v).into_owned()),
            end_of_stream,
            tool_refusal: None,
        }
    }

    /// What the response's body is, when it is one the machine reads for an answer: JSON
    /// (`Some(true)`) or an SSE stream (`Some(false)`); `None` when it has no body to read.
    pub(super) fn body_kind(&self) -> Option<bool> {
        if self.end_of_stream {
            return None;
        }
        let media = self
            .content_type
            .as_deref()?
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        match media.as_str() {
            "application/json" => Some(true),
            "text/event-stream" => Some(false),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse::mcp::Mirrored;

    fn read(headers: &[(&str, &str)]) -> RequestHead {
        RequestHead::from_headers(headers.iter().copied(), "atmost-permit", false)
    }

    #[test]
    fn reads_what_the_machine_acts_on() {
        let head = read(&[
            (":method", "POST"),
            (":path", "/mcp"),
            ("Atmost-Permit", "tok"),
            ("idempotency-key", "\"k1\""),
            ("mcp-method", " tools/call "),
            ("mcp-name", "pay"),
            ("MCP-Protocol-Version", "2026-07-28"),
            ("mcp-session-id", "s1"),
            ("content-type", "application/json"),
            ("content-length", " 42 "),
            ("accept", "application/json"),
        ]);
        assert_eq!(
            head,
            RequestHead {
                method: "POST".into(),
                path: "/mcp".into(),
                permit: vec![b"tok".to_vec()],
                idempotency_key: vec![b"\"k1\"".to_vec()],
                mirrored: Mirrored {
                    method: Some("tools/call".into()),
                    name: Some("pay".into()),
                    protocol_version: Some("2026-07-28".into()),
                    duplicated: false,
                },
                session_id: Some("s1".into()),
                content_type: vec![b"application/json".to_vec()],
                content_length: Some(42),
                ..RequestHead::default()
            }
        );
        assert!(RequestHead::from_headers(Vec::<(&str, &str)>::new(), "p", true).end_of_stream);
    }

    #[test]
    fn repeats_keep_every_value_or_the_first() {
        let head = read(&[
            ("atmost-permit", "a"),
            ("atmost-permit", "b"),
            ("idempotency-key", "\"k1\""),
            ("Idempotency-Key", "\"k2\""),
            ("content-type", "application/json"),
            ("content-type", "text/plain"),
            ("content-encoding", "gzip"),
            ("content-encoding", "identity"),
            ("mcp-session-id", "first"),
            ("mcp-session-id", "second"),
            ("mcp-protocol-version", "2026-07-28"),
            ("mcp-protocol-version", "2025-06-18"),
            ("last-event-id", "e1"),
            ("last-event-id", "e2"),
            ("mcp-name", "pay"),
            ("mcp-name", "echo"),
        ]);
        assert_eq!(head.permit, vec![b"a".to_vec(), b"b".to_vec()]);
        assert_eq!(head.idempotency_key.len(), 2);
        assert_eq!(head.content_type.len(), 2);
        assert_eq!(head.content_encoding.len(), 2);
        assert_eq!(head.session_id.as_deref(), Some("first"));
        assert_eq!(
            head.mirrored.protocol_version.as_deref(),
            Some("2026-07-28")
        );
        assert_eq!(head.last_event_id.as_deref(), Some("e1"));
        assert_eq!(head.mirrored.name.as_deref(), Some("pay"));
        assert!(head.mirrored.duplicated);
        assert!(!read(&[("mcp-method", "tools/call")]).mirrored.duplicated);
        assert!(
            read(&[("mcp-method", "tools/call"), ("mcp-method", "x")])
                .mirrored
                .duplicated
        );
    }

    #[test]
    fn an_alias_of_a_header_atmost_reads_is_named() {
        for name in [
            "Idempotency_Key",
            "idempotency_key",
            "atmost_permit",
            "Mcp_Name",
            "mcp_method",
            "mcp-protocol_version",
            "MCP_SESSION_ID",
            "last_event_id",
            "content_type",
            "content_length",
            "content_encoding",
        ] {
            let head = read(&[("idempotency-key", "\"k\""), (name, "RAWKEY")]);
            assert_eq!(head.alias, Some(name.to_ascii_lowercase()), "{name}");
            // The alias is not read as the header it imitates.
            assert_eq!(head.idempotency_key.len(), 1, "{name}");
            assert!(head.permit.is_empty() && head.mirrored == Mirrored::default());
        }
        assert!(HEADERS_ATMOST_READS.contains(&IDEMPOTENCY_HEADER));
        let first = read(&[("mcp_name", "a"), ("content_type", "b")]);
        assert_eq!(first.alias.as_deref(), Some("mcp_name"));
        // The permit header is whatever the configuration names, aliased either way round.
        let custom =
            |name: &str| RequestHead::from_headers([(name, "tok")], "x-agent_permit", false);
        assert_eq!(
            custom("x-agent-permit").alias.as_deref(),
            Some("x-agent-permit")
        );
        assert_eq!(
            custom("x_agent_permit").alias.as_deref(),
            Some("x_agent_permit")
        );
        assert_eq!(custom("x-agent_permit").alias, None);
        assert_eq!(custom("x-agent_permit").permit, vec![b"tok".to_vec()]);
    }

    #[test]
    fn names_that_are_no_alias_pass() {
        for name in [
            "idempotency-key",
            "Idempotency-Key",
            "idempotency-keys",
            "idempotency__key",
            "x_idempotency_key",
            "mcp_names",
            "x_custom_header",
            "atmost-permit",
            "authorization",
        ] {
            assert_eq!(read(&[(name, "v")]).alias, None, "{name}");
        }
    }

    #[test]
    fn envoys_control_headers_are_listed_once_each() {
        let head = read(&[
            ("x-envoy-retry-on", "5xx"),
            ("X-Envoy-Max-Retries", "3"),
            ("x-envoy-retry-on", "reset"),
            ("x-envoy-upstream-rq-timeout-ms", "1"),
            ("x-envoy-original-dst-host", "10.0.0.1:80"),
            // Not steering: Istio's own, or acted on before any filter.
            ("x-envoy-peer-metadata", "CgwK"),
            ("x-envoy-peer-metadata-id", "sidecar~10.0.0.2"),
            ("x-envoy-internal", "true"),
            ("x-envoy-force-trace", "1"),
            ("x-envoy-retry_on", "5xx"),
        ]);
        assert_eq!(
            head.control_headers,
            vec![
                "x-envoy-retry-on",
                "x-envoy-max-retries",
                "x-envoy-upstream-rq-timeout-ms",
                "x-envoy-original-dst-host"
            ]
        );
        for name in ENVOY_CONTROL_HEADERS {
            assert_eq!(read(&[(name, "1")]).control_headers, vec![name]);
        }
        assert!(read(&[("accept", "*/*")]).control_headers.is_empty());
    }

    #[test]
    fn a_stored_ticket_is_taken_only_by_the_calls_permit_on_the_calls_path() {
        let ticket = Ticket {
            grant: atmost_protocol::DispatchGrant {
                attempt_id: "att_1".into(),
                round: 1,
                capability: "cap".into(),
            },
            id: serde_json::json!(7),
            tool: "pay".into(),
            permit_hash: crate::call::resume::permit_hash(b"tok"),
            path: "/mcp".into(),
            limits: None,
        };
        let stored = ticket.to_bytes();
        let get = |extra: &[(&str, &str)]| {
            read(
                &[
                    &[
                        (":method", "GET"),
                        (":path", "/mcp"),
                        ("last-event-id", "e7"),
                    ],
                    extra,
                ]
                .concat(),
            )
        };
        assert_eq!(
            get(&[("atmost-permit", " tok ")]).admit_resume(&stored),
            Some(ticket.clone())
        );
        for refused in [
            get(&[]),
            get(&[("atmost-permit", "other")]),
            get(&[("atmost-permit", "tok"), ("atmost-permit", "tok")]),
            read(&[
                (":method", "GET"),
                (":path", "/other"),
                ("atmost-permit", "tok"),
            ]),
        ] {
            assert_eq!(refused.admit_resume(&stored), None, "{refused:?}");
        }
        // A ticket already taken (emptied) or unreadable is no ticket.
        let head = get(&[("atmost-permit", "tok")]);
        assert_eq!(head.admit_resume(b""), None);
        assert_eq!(head.admit_resume(b"{"), None);
    }

    #[test]
    fn a_responses_content_type_is_kept_as_sent() {
        let head = |value: Option<&[u8]>, end| ResponseHead::from_content_type(value, end);
        assert_eq!(
            head(Some(b"text/event-stream"), false),
            ResponseHead {
                content_type: Some("text/event-stream".into()),
                end_of_stream: false,
                tool_refusal: None,
            }
        );
        // Kept as sent (the machine reads the media type itself); not UTF-8 is read lossily.
        assert_eq!(
            head(Some(b" application/json; charset=utf-8"), true).content_type,
            Some(" application/json; charset=utf-8".into())
        );
        assert_eq!(
            head(Some(b"text/\xff"), false).content_type,
            Some("text/\u{fffd}".into())
        );
        assert_eq!(
            head(None, true),
            ResponseHead {
                content_type: None,
                end_of_stream: true,
                tool_refusal: None,
            }
        );
    }

    #[test]
    fn a_resume_key_only_for_a_get_with_a_last_event_id_and_no_alias() {
        let get = |extra: &[(&str, &str)]| {
            read(
                &[
                    &[
                        (":method", "GET"),
                        ("mcp-session-id", "s1"),
                        ("last-event-id", "e7"),
                    ],
                    extra,
                ]
                .concat(),
            )
        };
        assert_eq!(
            get(&[]).resume_key(),
            Some(crate::call::resume::key(Some("s1"), "e7"))
        );
        assert_eq!(get(&[("mcp_session_id", "s2")]).resume_key(), None);
        assert_eq!(get(&[("upgrade", "websocket")]).resume_key(), None);
        assert_eq!(read(&[(":method", "GET")]).resume_key(), None);
        assert_eq!(
            read(&[(":method", "POST"), ("last-event-id", "e7")]).resume_key(),
            None
        );
    }
}
