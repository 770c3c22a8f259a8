//! What the permit still allows, where the agent sees it: every answer to a governed
//! `tools/call` carries the figures of the ledger's decision ([`PermitLimits`]) in
//! `result._meta["dev.atmost/permit"]` (a JSON-RPC error, such as the `error` denial format,
//! in `error.data["dev.atmost/permit"]`) and in three response headers; with
//! `tools_list_limits`, each governed tool of a `tools/list` answer carries its figures in
//! its own `_meta`.
//!
//! Answers the filter builds itself (replays, denials) get them as JSON values. An upstream
//! answer gets them as [`Edit`]s of its text: the figures go in, every other byte stays as
//! the upstream sent it.

use crate::parse::json_text::{self, member, Member};
use crate::parse::sse::Event;
use atmost_protocol::PermitLimits;
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// `_meta` key of the figures.
pub const PERMIT_META: &str = "dev.atmost/permit";
/// Response header: calls of the tool the permit still allows, or [`UNLIMITED`].
pub const CALLS_LEFT_HEADER: &str = "atmost-calls-left";
/// Response header: budget left in minor units, or [`UNLIMITED`].
pub const BUDGET_LEFT_HEADER: &str = "atmost-budget-left";
/// Response header: when the permit expires (RFC 3339).
pub const EXPIRES_HEADER: &str = "atmost-permit-expires";
/// Header value of a figure without a limit (JSON `null` in `_meta`).
pub const UNLIMITED: &str = "unlimited";

/// The three response headers carrying the figures.
pub fn headers(limits: &PermitLimits) -> [(&'static str, String); 3] {
    let figure = |n: Option<u64>| n.map_or_else(|| UNLIMITED.to_string(), |n| n.to_string());
    [
        (CALLS_LEFT_HEADER, figure(limits.calls_left)),
        (BUDGET_LEFT_HEADER, figure(limits.budget_left)),
        (EXPIRES_HEADER, limits.expires_at.clone()),
    ]
}

/// The figures as a JSON value, for an answer the filter builds: a figure without a limit is
/// `null`. Writing plain numbers and a string cannot fail.
fn figures(limits: &PermitLimits) -> Value {
    serde_json::to_value(limits).unwrap_or(Value::Null)
}

/// The figures as JSON text, without building the tree: it goes into every dispatched
/// call's answer. [`PermitLimits`] declares its fields in key order, so this text and the
/// text of [`figures`] agree byte for byte. Writing plain numbers and a string cannot fail.
fn figures_text(limits: &PermitLimits) -> String {
    serde_json::to_string(limits).unwrap_or_else(|_| "null".into())
}

/// Puts the figures into a JSON-RPC response the filter built: `result._meta` (created, or
/// replacing a `_meta` that is not an object), else `error.data` (created when absent; a
/// `data` that is not an object is left as it is).
pub fn insert(message: &mut Value, limits: &PermitLimits) {
    let Some(obj) = message.as_object_mut() else {
        return;
    };
    let (slot, replace_other) = if let Some(Value::Object(result)) = obj.get_mut("result") {
        (result.entry("_meta"), true)
    } else if let Some(Value::Object(error)) = obj.get_mut("error") {
        (error.entry("data"), false)
    } else {
        return;
    };
    let holder = slot.or_insert_with(|| Value::Object(Map::new()));
    if !holder.is_object() && replace_other {
        *holder = Value::Object(Map::new());
    }
    if let Value::Object(holder) = holder {
        holder.insert(PERMIT_META.into(), figures(limits));
    }
}

/// One change of a JSON text: the bytes `start..end` become `text`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Edit {
    pub start: usize,
    pub end: usize,
    pub text: String,
}

/// `text` with `edits` made (in text order, never overlapping, as this module makes them).
pub fn apply(text: &[u8], edits: &[Edit]) -> Vec<u8> {
    apply_at(text, edits, Some).unwrap_or_else(|| text.to_vec())
}

/// `buffer` with `edits` of a JSON text made, where `at(i)` is the offset in `buffer` of
/// byte `i` of the text. `None` when an edit falls outside `buffer` or the edits are not in
/// text order.
fn apply_at(buffer: &[u8], edits: &[Edit], at: impl Fn(usize) -> Option<usize>) -> Option<Vec<u8>> {
    let mut spans = Vec::with_capacity(edits.len());
    for e in edits {
        spans.push((at(e.start)?, at(e.end)?, e.text.as_bytes()));
    }
    let mut out =
        Vec::with_capacity(buffer.len() + edits.iter().map(|e| e.text.len()).sum::<usize>());
    let mut from = 0;
    for (start, end, text) in spans {
        // An edit before the end of the last one: out of order or overlapping.
        out.extend_from_slice(buffer.get(from..start)?);
        out.extend_from_slice(text);
        from = end;
    }
    out.extend_from_slice(buffer.get(from..)?);
    Some(out)
}

/// Where an answer's JSON text sits in the bytes Envoy holds for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TextAt {
    /// The whole body is the text.
    Whole,
    /// The text is the data of an SSE event; the bytes begin at this stream offset.
    Event(Event, u64),
}

impl TextAt {
    /// The JSON text in `buffer`.
    pub fn text<'a>(&'a self, buffer: &'a [u8]) -> &'a [u8] {
        match self {
            TextAt::Whole => buffer,
            TextAt::Event(e, _) => e.data.as_bytes(),
        }
    }

    /// `buffer` with `edits` of its text made; `None` when there is nothing to change (or
    /// an edit would fall outside the buffer).
    pub fn edited(&self, buffer: &[u8], edits: &[Edit]) -> Option<Vec<u8>> {
        if edits.is_empty() {
            return None;
        }
        match self {
            TextAt::Whole => apply_at(buffer, edits, Some),
            TextAt::Event(e, base) => apply_at(buffer, edits, |i| {
                usize::try_from(e.stream_offset(i)?.checked_sub(*base)?).ok()
            }),
        }
    }
}

/// The edit that sets `key` to `value` (JSON text) inside member `child` of the object at
/// `obj`: `child` is created when absent; when it is not an object it is replaced if
/// `replace_other`, else nothing is done.
fn put(
    text: &[u8],
    obj: usize,
    child: &str,
    key: &str,
    value: &str,
    replace_other: bool,
) -> Option<Edit> {
    // `"key":value`, or `{"key":value}`, or `"child":{"key":value}`: written piece by piece,
    // as `format!` costs several times as much for this on every dispatched call.
    let pair = |child: Option<&str>, braces: bool| {
        let mut out =
            String::with_capacity(key.len() + value.len() + child.map_or(0, str::len) + 8);
        if let Some(child) = child {
            json_text::push_string(&mut out, child);
            out.push(':');
        }
        if braces {
            out.push('{');
        }
        json_text::push_string(&mut out, key);
        out.push(':');
        out.push_str(value);
        if braces {
            out.push('}');
        }
        out
    };
    let insert_first = |at: usize, mut member_text: String| {
        // Right after the opening brace; a comma when other members follow.
        if !json_text::is_empty_object(text, at)? {
            member_text.push(',');
        }
        Some(Edit {
            start: at + 1,
            end: at + 1,
            text: member_text,
        })
    };
    match member(text, obj, child) {
        None => insert_first(obj, pair(Some(child), true)),
        Some(m) if m.value_opens(text) == Some(b'{') => match member(text, m.value_start, key) {
            Some(k) => Some(Edit {
                start: k.value_start,
                end: k.value_end,
                text: value.to_string(),
            }),
            None => insert_first(m.value_start, pair(None, false)),
        },
        Some(m) if replace_other => Some(Edit {
            start: m.value_start,
            end: m.value_end,
            text: pair(None, true),
        }),
        Some(_) => None,
    }
}

/// The value of `m` read as JSON.
fn value_of(text: &[u8], m: &Member) -> Option<Value> {
    serde_json::from_slice(text.get(m.value_start..m.value_end)?).ok()
}

/// The `result` and `error` members of the object at `at` if it is the response to request
/// `id`: its `id`, no `method`, and a `result` or an `error`. One walk over the object.
fn response_members(text: &[u8], at: usize, id: &Value) -> Option<ResponseMembers> {
    let [id_member, method, result, error] =
        json_text::last_members(text, at, ["id", "method", "result", "error"])?;
    let is_response = id_member.and_then(|m| value_of(text, &m)).as_ref() == Some(id)
        && method.is_none()
        && (result.is_some() || error.is_some());
    is_response.then_some(ResponseMembers { result, error })
}

/// Where the figures may go in a response.
struct ResponseMembers {
    result: Option<Member>,
    error: Option<Member>,
}

/// The response to `id` in a JSON text that parsed: the message itself, or its element of a
/// batch.
fn response_to(text: &[u8], id: &Value) -> Option<ResponseMembers> {
    let at = json_text::first_value(text);
    match text.get(at)? {
        b'{' => response_members(text, at, id),
        b'[' => json_text::elements(text, at)?
            .into_iter()
            .filter(|&(start, _)| text.get(start) == Some(&b'{'))
            .find_map(|(start, _)| response_members(text, start, id)),
        _ => None,
    }
}

/// The edits putting the figures into the response to `id` in `text`, a JSON text that
/// already parsed: `result._meta["dev.atmost/permit"]`, or `error.data[…]` for an error
/// response (not when its `data` is something other than an object). None when `text` holds
/// no response to `id`.
pub fn response_edits(text: &[u8], id: &Value, limits: &PermitLimits) -> Vec<Edit> {
    let figures = figures_text(limits);
    let edit = response_to(text, id).and_then(|response| {
        let object = |m: Option<Member>| m.filter(|m| m.value_opens(text) == Some(b'{'));
        if let Some(result) = object(response.result) {
            put(
                text,
                result.value_start,
                "_meta",
                PERMIT_META,
                &figures,
                true,
            )
        } else {
            let error = object(response.error)?;
            put(
                text,
                error.value_start,
                "data",
                PERMIT_META,
                &figures,
                false,
            )
        }
    });
    edit.into_iter().collect()
}

/// The `tools` array of the `tools/list` response to `id` in `text`: each tool object's
/// offset and name.
fn listed(text: &[u8], id: &Value) -> Vec<(usize, String)> {
    let tools = response_to(text, id)
        .and_then(|response| response.result)
        .filter(|r| r.value_opens(text) == Some(b'{'))
        .and_then(|r| member(text, r.value_start, "tools"))
        .and_then(|t| json_text::elements(text, t.value_start));
    tools
        .unwrap_or_default()
        .into_iter()
        .filter(|&(start, _)| text.get(start) == Some(&b'{'))
        .filter_map(|(start, _)| {
            let name = member(text, start, "name").and_then(|m| value_of(text, &m))?;
            Some((start, name.as_str()?.to_string()))
        })
        .collect()
}

/// The names of the tools a `tools/list` response to `id` lists, in order (a name listed
/// twice once), for which `wanted` holds.
pub fn listed_tools(text: &[u8], id: &Value, wanted: impl Fn(&str) -> bool) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for (_, name) in listed(text, id) {
        if wanted(&name) && !names.contains(&name) {
            names.push(name);
        }
    }
    names
}

/// The edits putting each listed tool's figures into its `_meta["dev.atmost/permit"]`
/// (a `_meta` that is not an object is replaced); tools without figures are left as they are.
pub fn tools_list_edits(
    text: &[u8],
    id: &Value,
    by_tool: &BTreeMap<String, PermitLimits>,
) -> Vec<Edit> {
    listed(text, id)
        .into_iter()
        .filter_map(|(at, name)| {
            let limits = by_tool.get(&name)?;
            put(text, at, "_meta", PERMIT_META, &figures_text(limits), true)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn limits() -> PermitLimits {
        PermitLimits::until("2030-01-01T00:00:00.000Z").with_calls_left(Some(2))
    }

    fn meta() -> Value {
        json!({"calls_left": 2, "budget_left": null, "expires_at": "2030-01-01T00:00:00.000Z"})
    }

    fn edited(text: &str, id: Value) -> String {
        let edits = response_edits(text.as_bytes(), &id, &limits());
        String::from_utf8(apply(text.as_bytes(), &edits)).unwrap_or_default()
    }

    #[test]
    fn figures_text_is_the_figures_as_serde_json_writes_them() {
        for limits in [
            limits(),
            PermitLimits::until("2030-01-01T00:00:00Z \"\\\u{1}\u{e9}")
                .with_budget_left(Some(u64::MAX)),
            PermitLimits::until(String::new())
                .with_calls_left(Some(0))
                .with_budget_left(Some(0)),
        ] {
            assert_eq!(figures_text(&limits), figures(&limits).to_string());
        }
    }

    #[test]
    fn figures_are_written_in_key_order_with_null_for_no_limit() {
        assert_eq!(
            figures_text(&limits()),
            r#"{"budget_left":null,"calls_left":2,"expires_at":"2030-01-01T00:00:00.000Z"}"#
        );
        let most = PermitLimits::until("a\"b\\c\u{1}\u{7f}\u{e9}")
            .with_calls_left(Some(u64::MAX))
            .with_budget_left(Some(48_750));
        assert_eq!(
            figures_text(&most),
            "{\"budget_left\":48750,\"calls_left\":18446744073709551615,\"expires_at\":\"a\\\"b\\\\c\\u0001\u{7f}\u{e9}\"}"
        );
    }

    #[test]
    fn headers_spell_unlimited_figures() {
        assert_eq!(
            headers(&limits()),
            [
                ("atmost-calls-left", "2".to_string()),
                ("atmost-budget-left", "unlimited".to_string()),
                (
                    "atmost-permit-expires",
                    "2030-01-01T00:00:00.000Z".to_string()
                ),
            ]
        );
    }

    #[test]
    fn inserted_into_results_and_errors_the_filter_builds() {
        let mut v = json!({"jsonrpc": "2.0", "id": 1, "result": {"content": []}});
        insert(&mut v, &limits());
        assert_eq!(v["result"]["_meta"], json!({"dev.atmost/permit": meta()}));
        let mut v = json!({"id": 1, "result": {"_meta": {"x": 1, "dev.atmost/permit": "forged"}}});
        insert(&mut v, &limits());
        assert_eq!(
            v["result"]["_meta"],
            json!({"x": 1, "dev.atmost/permit": meta()})
        );
        let mut v = json!({"id": 1, "result": {"_meta": 7}});
        insert(&mut v, &limits());
        assert_eq!(v["result"]["_meta"], json!({"dev.atmost/permit": meta()}));
        let mut v =
            json!({"id": 1, "error": {"code": -31004, "message": "m", "data": {"code": "x"}}});
        insert(&mut v, &limits());
        assert_eq!(
            v["error"]["data"],
            json!({"code": "x", "dev.atmost/permit": meta()})
        );
        let mut v = json!({"id": 1, "error": {"code": 1, "message": "m"}});
        insert(&mut v, &limits());
        assert_eq!(v["error"]["data"], json!({"dev.atmost/permit": meta()}));
        // An error's own data that is not an object stays the server's.
        let mut v = json!({"id": 1, "error": {"code": 1, "message": "m", "data": "text"}});
        insert(&mut v, &limits());
        assert_eq!(v["error"]["data"], "text");
    }

    #[test]
    fn an_upstream_response_gains_the_figures_and_keeps_every_other_byte() {
        let text = r#"{"jsonrpc":"2.0","id":5,"result":{"content":[{"type":"text","text":"paid 10.50"}],"n":1.50}}"#;
        let out = edited(text, json!(5));
        assert_eq!(
            out,
            text.replacen(
                r#""result":{"#,
                &format!(r#""result":{{"_meta":{{"dev.atmost/permit":{}}},"#, meta()),
                1
            )
        );
        // Pretty text, an existing _meta, a forged figure, an empty result.
        for (text, want) in [
            (
                "{ \"id\" : 5 ,\n \"result\" : { \"_meta\" : { \"a\" : 1 } } }",
                json!({"a": 1, "dev.atmost/permit": meta()}),
            ),
            (
                r#"{"id":5,"result":{"_meta":{"dev.atmost/permit":{"calls_left":99}}}}"#,
                json!({"dev.atmost/permit": meta()}),
            ),
            (
                r#"{"id":5,"result":{}}"#,
                json!({"dev.atmost/permit": meta()}),
            ),
            (
                r#"{"id":5,"result":{"_meta":{}}}"#,
                json!({"dev.atmost/permit": meta()}),
            ),
            (
                r#"{"id":5,"result":{"_meta":[1]}}"#,
                json!({"dev.atmost/permit": meta()}),
            ),
        ] {
            let v: Value = serde_json::from_str(&edited(text, json!(5))).unwrap_or_default();
            assert_eq!(v["result"]["_meta"], want, "{text}");
        }
        let pretty = "{ \"id\" : 5 ,\n \"result\" : { \"_meta\" : { \"a\" : 1 } } }";
        let out = edited(pretty, json!(5));
        assert!(
            out.starts_with("{ \"id\" : 5 ,\n \"result\" : { \"_meta\" : {\"dev.atmost/permit\":{")
        );
        assert!(out.ends_with("}, \"a\" : 1 } } }"), "{out}");
    }

    #[test]
    fn error_responses_and_batches() {
        let text = r#"{"jsonrpc":"2.0","id":"a","error":{"code":-32602,"message":"bad"}}"#;
        let v: Value = serde_json::from_str(&edited(text, json!("a"))).unwrap_or_default();
        assert_eq!(v["error"]["data"], json!({"dev.atmost/permit": meta()}));
        assert_eq!(v["error"]["code"], -32602);
        let kept = r#"{"id":"a","error":{"code":1,"message":"m","data":[1]}}"#;
        assert_eq!(edited(kept, json!("a")), kept);
        let batch = r#"[{"jsonrpc":"2.0","id":4,"result":{}},{"jsonrpc":"2.0","id":5,"method":"x","params":{}},{"jsonrpc":"2.0","id":5,"result":{"n":1}}]"#;
        let v: Value = serde_json::from_str(&edited(batch, json!(5))).unwrap_or_default();
        assert_eq!(v[0], json!({"jsonrpc":"2.0","id":4,"result":{}}));
        assert!(v[1].get("result").is_none());
        assert_eq!(
            v[2]["result"],
            json!({"n": 1, "_meta": {"dev.atmost/permit": meta()}})
        );
    }

    #[test]
    fn nothing_changes_without_the_response() {
        for (text, id) in [
            (r#"{"id":6,"result":{}}"#, json!(5)),
            (r#"{"id":"5","result":{}}"#, json!(5)),
            (
                r#"{"id":5,"method":"elicitation/create","params":{}}"#,
                json!(5),
            ),
            (r#"{"id":5,"result":7}"#, json!(5)),
            (r#""text""#, json!(5)),
        ] {
            assert!(
                response_edits(text.as_bytes(), &id, &limits()).is_empty(),
                "{text}"
            );
        }
    }

    #[test]
    fn each_listed_tool_with_figures_gets_its_own() {
        let text = r#"{"jsonrpc":"2.0","id":2,"result":{"tools":[{"name":"pay","inputSchema":{}},{"name":"echo","_meta":{"x":true}},{"name":"free"},{"name":"pay"},7],"nextCursor":"c"}}"#;
        let id = json!(2);
        assert_eq!(
            listed_tools(text.as_bytes(), &id, |t| t != "free"),
            ["pay", "echo"]
        );
        let mut other = limits();
        other.calls_left = None;
        let by_tool: BTreeMap<String, PermitLimits> =
            [("pay".to_string(), limits()), ("echo".to_string(), other)]
                .into_iter()
                .collect();
        let out = apply(
            text.as_bytes(),
            &tools_list_edits(text.as_bytes(), &id, &by_tool),
        );
        let v: Value = serde_json::from_slice(&out).unwrap_or_default();
        let tools = &v["result"]["tools"];
        assert_eq!(tools[0]["_meta"], json!({"dev.atmost/permit": meta()}));
        assert_eq!(tools[0]["inputSchema"], json!({}));
        assert_eq!(tools[1]["_meta"]["x"], true);
        assert_eq!(
            tools[1]["_meta"]["dev.atmost/permit"]["calls_left"],
            Value::Null
        );
        assert!(tools[2].get("_meta").is_none());
        assert_eq!(tools[3]["_meta"], json!({"dev.atmost/permit": meta()}));
        assert_eq!(tools[4], 7);
        assert_eq!(v["result"]["nextCursor"], "c");
        assert!(listed_tools(text.as_bytes(), &json!(3), |_| true).is_empty());
    }

    #[test]
    fn edits_land_in_an_sse_event_split_over_data_lines() {
        let mut parser = crate::parse::sse::SseParser::new(1 << 20);
        let mut events = Vec::new();
        let stream = b"data: x\n\nid: 7\r\ndata: {\"id\":5,\r\ndata:\"result\":{}}\r\n\r\n";
        let base = 9;
        assert!(parser.feed_events(stream, &mut events).is_ok());
        let event = events.pop().unwrap_or_else(|| panic!("no event"));
        let at = TextAt::Event(event, base);
        let buffer = &stream[9..];
        let text = at.text(buffer).to_vec();
        let edits = response_edits(&text, &json!(5), &limits());
        let out = at.edited(buffer, &edits).unwrap_or_default();
        let want = format!(
            "id: 7\r\ndata: {{\"id\":5,\r\ndata:\"result\":{{\"_meta\":{{\"dev.atmost/permit\":{}}}}}}}\r\n\r\n",
            meta()
        );
        assert_eq!(String::from_utf8_lossy(&out), want);
        assert_eq!(at.edited(buffer, &[]), None);
        assert_eq!(
            TextAt::Whole.edited(
                b"{}",
                &[Edit {
                    start: 5,
                    end: 6,
                    text: "x".into()
                }]
            ),
            None
        );
    }
}
