//! Reading an MCP request body: what kind of JSON-RPC message it is, and for a
//! `tools/call` the parts atmost needs. Refusals are JSON-RPC errors as local replies.

use crate::call::reply::{rpc_code, LocalReply};
use crate::parse::fold;
use crate::parse::idempotency::{carries_key, BodyKeys, KeyMember, BODY_KEY_SOURCES};
use crate::parse::strict_json;
use serde_json::{Map, Value};

/// Message of the refusal of a batch that holds a `tools/call`.
pub const BATCH_REFUSED: &str =
    "batches containing tools/call are refused by atmost; send each call alone";

/// First protocol version that mirrors the method and name into `Mcp-Method` / `Mcp-Name`
/// headers (and requires them on `tools/call`).
pub const MIRRORING_VERSION: &str = "2026-07-28";
/// `params._meta` key carrying the per-request protocol version (2026-07-28).
pub const PROTOCOL_VERSION_META: &str = "io.modelcontextprotocol/protocolVersion";

/// Request headers that describe the message: the 2026-07-28 mirrored headers
/// (`Mcp-Method`, `Mcp-Name`) and `MCP-Protocol-Version`, when the client sent them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Mirrored {
    pub method: Option<String>,
    pub name: Option<String>,
    /// `MCP-Protocol-Version`.
    pub protocol_version: Option<String>,
    /// `Mcp-Method` or `Mcp-Name` was sent more than once.
    pub duplicated: bool,
}

/// What the body is, as far as atmost cares.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    /// Anything that is not a single `tools/call` request (initialize, lists,
    /// notifications, responses to the server, batches without `tools/call`): it passes.
    Other,
    /// Like [`Message::Other`], but some message in the body carries an idempotency key in
    /// one of the body's key members ([`BODY_KEY_SOURCES`]): it passes with that key
    /// rewritten. Holds
    /// the request's id (`null` for a notification or a batch), should a refusal be needed.
    KeyedOther(Value),
    /// One `tools/call` request.
    ToolCall(ToolCall),
    /// One `tools/list` request with a string or number id: it passes (its key rewritten
    /// when `keyed`, as for [`Message::KeyedOther`]); its answer may gain the permit's
    /// figures (`tools_list_limits`).
    ToolsList { id: Value, keyed: bool },
}

/// The parts of a `tools/call` request atmost uses.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// JSON-RPC `id` (a string or a number).
    pub id: Value,
    /// `params.name`.
    pub name: String,
    /// `params.arguments`; an empty object when absent.
    pub arguments: Map<String, Value>,
    /// What each of the body's key members ([`BODY_KEY_SOURCES`]) holds.
    pub keys: BodyKeys,
    /// MCP 2026-07-28 multi-round-trip: `params` carries `inputResponses` or
    /// `requestState`, so this is the retry of a call that answered `input_required`.
    pub continuation: bool,
}

fn bad(status: u32, id: Option<&Value>, code: i64, message: &str) -> Box<LocalReply> {
    Box::new(LocalReply::rpc_error(status, id, code, message))
}

/// The id usable in an error reply: a string or a number, else none (`null`).
fn reply_id(obj: &Map<String, Value>) -> Option<&Value> {
    obj.get("id").filter(|v| v.is_string() || v.is_number())
}

fn is_tools_call(v: &Value) -> bool {
    v.get("method").and_then(Value::as_str) == Some("tools/call")
}

/// Whether a message's `params` are an object holding an idempotency key member.
fn keyed(params: Option<&Value>) -> bool {
    params.and_then(Value::as_object).is_some_and(carries_key)
}

fn other(keyed: bool, id: Option<&Value>) -> Message {
    if keyed {
        Message::KeyedOther(id.cloned().unwrap_or(Value::Null))
    } else {
        Message::Other
    }
}

/// The member names the gateway reads, where it reads them: of a JSON-RPC message, of its
/// `params`, and of `params._meta`. Besides these it reads the idempotency key members
/// ([`BODY_KEY_SOURCES`]) and the members of `params` holding them: [`PARAMS_READ`] and
/// [`META_READ`] add them.
const MESSAGE_MEMBERS: [&str; 6] = ["jsonrpc", "id", "method", "params", "result", "error"];
const PARAMS_MEMBERS: [&str; 6] = [
    "name",
    "arguments",
    "_meta",
    "inputResponses",
    "requestState",
    "task",
];
const META: &str = "_meta";
const META_MEMBERS: [&str; 1] = [PROTOCOL_VERSION_META];

/// Every member of `params` the gateway reads (`_meta` twice does no harm).
const PARAMS_READ: [&str; PARAMS_MEMBERS.len() + BODY_KEY_SOURCES.len()] = {
    let mut names = [""; PARAMS_MEMBERS.len() + BODY_KEY_SOURCES.len()];
    let mut i = 0;
    while i < names.len() {
        names[i] = if i < PARAMS_MEMBERS.len() {
            PARAMS_MEMBERS[i]
        } else {
            BODY_KEY_SOURCES[i - PARAMS_MEMBERS.len()].params_member()
        };
        i += 1;
    }
    names
};

/// Whether a key source sits in `params._meta`.
const fn in_meta(source: &KeyMember) -> bool {
    let Some(object) = source.within else {
        return false;
    };
    let (a, b) = (object.as_bytes(), META.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

const META_KEY_SOURCES: usize = {
    let mut n = 0;
    let mut i = 0;
    while i < BODY_KEY_SOURCES.len() {
        if in_meta(&BODY_KEY_SOURCES[i]) {
            n += 1;
        }
        i += 1;
    }
    n
};

/// Every member of `params._meta` the gateway reads.
const META_READ: [&str; META_MEMBERS.len() + META_KEY_SOURCES] = {
    let mut names = [""; META_MEMBERS.len() + META_KEY_SOURCES];
    let mut n = 0;
    while n < META_MEMBERS.len() {
        names[n] = META_MEMBERS[n];
        n += 1;
    }
    let mut i = 0;
    while i < BODY_KEY_SOURCES.len() {
        if in_meta(&BODY_KEY_SOURCES[i]) {
            names[n] = BODY_KEY_SOURCES[i].name;
            n += 1;
        }
        i += 1;
    }
    names
};

/// A key of `obj` that is not one of `names` but equal to one of them under case folding.
fn case_variant<'a>(
    obj: &'a Map<String, Value>,
    names: &[&'static str],
) -> Option<(&'a str, &'static str)> {
    obj.keys().find_map(|k| {
        // Every name is ASCII, and an ASCII key folds only onto ASCII of its own length: most
        // pairs are told apart without folding.
        let ascii = k.is_ascii();
        names
            .iter()
            .find(|n| k != *n && (!ascii || k.len() == n.len()) && fold::eq_fold(k, n))
            .map(|n| (k.as_str(), *n))
    })
}

/// A key that a case-insensitive decoder (Go's `encoding/json`) reads as a member the
/// gateway reads, though the gateway, matching exactly, does not: `{"Method":"tools/call"}`
/// alone would pass the gateway as a response and run upstream as a call. Refused wherever
/// the gateway looks: in the message, its `params` and their `_meta`.
fn misspelled_member(message: &Value) -> Option<(&str, &'static str)> {
    let obj = message.as_object()?;
    case_variant(obj, &MESSAGE_MEMBERS).or_else(|| {
        let params = obj.get("params").and_then(Value::as_object)?;
        case_variant(params, &PARAMS_READ).or_else(|| {
            let meta = params.get(META).and_then(Value::as_object)?;
            case_variant(meta, &META_READ)
        })
    })
}

fn refuse_misspelled_members(value: &Value) -> Result<(), Box<LocalReply>> {
    let messages: &[Value] = match value {
        Value::Array(items) => items,
        other => std::slice::from_ref(other),
    };
    for m in messages {
        if let Some((found, member)) = misspelled_member(m) {
            return Err(bad(
                400,
                m.as_object().and_then(reply_id),
                rpc_code::INVALID_REQUEST,
                &format!(
                    "Invalid Request: the key {found:?} differs from the member {member:?} only in letter case (under Unicode simple case folding); some servers read it as {member:?}"
                ),
            ));
        }
    }
    Ok(())
}

/// Reads a request body. `Err` is the local reply refusing it (HTTP 400).
pub fn parse(body: &[u8], mirrored: &Mirrored) -> Result<Message, Box<LocalReply>> {
    let value: Value = strict_json::from_slice(body).map_err(|e| {
        let text = e.to_string();
        let message = if !text.starts_with(strict_json::DUPLICATE_KEY) {
            "Parse error"
        } else if text.contains(strict_json::FOLDED) {
            // Named apart from an exact repeat: a client that meant two keys learns why.
            "Parse error: an object names the same key twice (keys that differ only in letter case, under Unicode simple case folding, are one key to some servers)"
        } else {
            "Parse error: an object names the same key twice"
        };
        bad(400, None, rpc_code::PARSE_ERROR, message)
    })?;
    refuse_misspelled_members(&value)?;
    match value {
        Value::Array(items) => {
            if items.iter().any(is_tools_call) {
                Err(bad(400, None, rpc_code::INVALID_REQUEST, BATCH_REFUSED))
            } else {
                Ok(other(items.iter().any(|m| keyed(m.get("params"))), None))
            }
        }
        Value::Object(obj) => parse_object(obj, mirrored),
        _ => Err(bad(
            400,
            None,
            rpc_code::INVALID_REQUEST,
            "Invalid Request: not a JSON-RPC message",
        )),
    }
}

fn parse_object(
    mut obj: Map<String, Value>,
    mirrored: &Mirrored,
) -> Result<Message, Box<LocalReply>> {
    let invalid = |obj: &Map<String, Value>, msg: &str| {
        bad(400, reply_id(obj), rpc_code::INVALID_REQUEST, msg)
    };
    if obj.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Err(invalid(
            &obj,
            "Invalid Request: \"jsonrpc\" must be \"2.0\"",
        ));
    }
    if let Some(id) = obj.get("id") {
        if !(id.is_string() || id.is_number() || id.is_null()) {
            return Err(invalid(
                &obj,
                "Invalid Request: \"id\" must be a string or a number",
            ));
        }
    }
    let method = match obj.get("method") {
        None => {
            // A response the client sends back to the server (sampling, elicitation, …).
            if obj.contains_key("id") && (obj.contains_key("result") || obj.contains_key("error")) {
                return Ok(Message::Other);
            }
            return Err(invalid(&obj, "Invalid Request: no \"method\""));
        }
        Some(Value::String(m)) => m.clone(),
        Some(_) => {
            return Err(invalid(
                &obj,
                "Invalid Request: \"method\" must be a string",
            ))
        }
    };
    match obj.get("params") {
        None | Some(Value::Object(_)) | Some(Value::Array(_)) => {}
        Some(_) => {
            return Err(invalid(
                &obj,
                "Invalid Request: \"params\" must be an object or an array",
            ))
        }
    }
    if let Some(h) = &mirrored.method {
        if *h != method {
            return Err(bad(
                400,
                reply_id(&obj),
                rpc_code::HEADER_MISMATCH,
                "HeaderMismatch: the Mcp-Method header does not match the body's method",
            ));
        }
    }
    if method == "tools/list" {
        if let Some(id) = reply_id(&obj) {
            return Ok(Message::ToolsList {
                id: id.clone(),
                keyed: keyed(obj.get("params")),
            });
        }
    }
    if method != "tools/call" {
        return Ok(other(keyed(obj.get("params")), reply_id(&obj)));
    }
    let id = match obj.get("id") {
        Some(id) if id.is_string() || id.is_number() => id.clone(),
        _ => {
            return Err(invalid(
                &obj,
                "Invalid Request: tools/call must be a request with a string or number \"id\"",
            ))
        }
    };
    let invalid_params = |msg: &str| bad(400, Some(&id), rpc_code::INVALID_PARAMS, msg);
    let Some(Value::Object(mut params)) = obj.remove("params") else {
        return Err(invalid_params(
            "Invalid params: tools/call needs a params object",
        ));
    };
    let name = match params.get("name") {
        Some(Value::String(n)) => n.clone(),
        _ => {
            return Err(invalid_params(
                "Invalid params: params.name must be a string",
            ))
        }
    };
    let arguments = match params.remove("arguments") {
        None => Map::new(),
        Some(Value::Object(a)) => a,
        Some(_) => {
            return Err(invalid_params(
                "Invalid params: params.arguments must be an object",
            ))
        }
    };
    let mismatch = |msg: &str| bad(400, Some(&id), rpc_code::HEADER_MISMATCH, msg);
    if mirrored.duplicated {
        return Err(mismatch(
            "HeaderMismatch: the Mcp-Method or Mcp-Name header appears more than once",
        ));
    }
    if let Some(h) = &mirrored.name {
        if *h != name {
            return Err(mismatch(
                "HeaderMismatch: the Mcp-Name header does not match params.name",
            ));
        }
    }
    let meta = match params.get("_meta") {
        Some(Value::Object(meta)) => Some(meta),
        _ => None,
    };
    let body_version = meta
        .and_then(|m| m.get(PROTOCOL_VERSION_META))
        .and_then(Value::as_str);
    if let (Some(h), Some(b)) = (mirrored.protocol_version.as_deref(), body_version) {
        if h != b {
            return Err(mismatch(
                "HeaderMismatch: the MCP-Protocol-Version header does not match params._meta's protocol version",
            ));
        }
    }
    // From 2026-07-28 on, a tools/call must mirror its method and tool name in headers.
    let version = mirrored.protocol_version.as_deref().or(body_version);
    if version.is_some_and(|v| v >= MIRRORING_VERSION)
        && (mirrored.method.is_none() || mirrored.name.is_none())
    {
        return Err(mismatch(
            "HeaderMismatch: MCP 2026-07-28 requires the Mcp-Method and Mcp-Name headers on tools/call",
        ));
    }
    let keys = BodyKeys::read(&params);
    let continuation = params.contains_key("inputResponses") || params.contains_key("requestState");
    Ok(Message::ToolCall(ToolCall {
        id,
        name,
        arguments,
        keys,
        continuation,
    }))
}

#[cfg(test)]
mod tests;
