//! A request body as a plain `serde_json` reading sees it, written apart from the filter's
//! own reader (`mcp::parse`, on top of `strict_json`), so the checks can compare the two.
//!
//! `serde_json` keeps the last of two equal keys and matches names exactly; this module
//! adds only what the comparison needs to name the filter's refusals: whether an object
//! repeats a key (exactly, or under case folding) and whether a member the gateway reads is
//! spelled in another letter case.

use atmost_filter::parse::fold;
use serde::de::{Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};
use std::fmt;

/// A `tools/call` request as JSON-RPC 2.0 and MCP define it.
#[derive(Debug, Clone, PartialEq)]
pub struct PlainCall {
    pub id: Value,
    pub name: String,
    /// `params.arguments`; absent is the empty object.
    pub arguments: Map<String, Value>,
}

/// The body as `serde_json::Value`, or `None` when `serde_json` refuses it.
pub fn read(body: &[u8]) -> Option<Value> {
    serde_json::from_slice(body).ok()
}

/// The body is one well-formed `tools/call` request: an object with `"jsonrpc":"2.0"`,
/// `"method"` exactly `"tools/call"`, an `id` that is a string or a number, `params` an
/// object whose `name` is a string and whose `arguments`, if present, are an object.
pub fn as_call(v: &Value) -> Option<PlainCall> {
    let obj = v.as_object()?;
    if obj.get("jsonrpc")?.as_str()? != "2.0" || obj.get("method")?.as_str()? != "tools/call" {
        return None;
    }
    let id = obj
        .get("id")
        .filter(|id| id.is_string() || id.is_number())?;
    let params = obj.get("params")?.as_object()?;
    let name = params.get("name")?.as_str()?;
    let arguments = match params.get("arguments") {
        None => Map::new(),
        Some(Value::Object(a)) => a.clone(),
        Some(_) => return None,
    };
    Some(PlainCall {
        id: id.clone(),
        name: name.to_string(),
        arguments,
    })
}

/// Some message of the body (the body itself, or an element of a batch) has a `method`
/// member, spelled in any letter case, whose value is `"tools/call"`: a server that reads
/// member names exactly or case-insensitively could run it as a call.
pub fn could_be_call(v: &Value) -> bool {
    let messages: &[Value] = match v {
        Value::Array(items) => items,
        other => std::slice::from_ref(other),
    };
    messages.iter().filter_map(Value::as_object).any(|m| {
        m.iter()
            .any(|(k, v)| fold::eq_fold(k, "method") && v.as_str() == Some("tools/call"))
    })
}

/// The members the gateway reads: of a message, of its `params`, of `params._meta`.
/// Written here apart from the filter's own list on purpose: a member dropped from that
/// list would otherwise drop out of the check as well.
const MESSAGE_MEMBERS: [&str; 6] = ["jsonrpc", "id", "method", "params", "result", "error"];
const PARAMS_MEMBERS: [&str; 7] = [
    "name",
    "arguments",
    "_meta",
    "inputResponses",
    "requestState",
    "idempotencyKey",
    "task",
];
const META_MEMBERS: [&str; 2] = [
    "dev.atmost/idempotency-key",
    "io.modelcontextprotocol/protocolVersion",
];

fn has_variant(obj: &Map<String, Value>, names: &[&str]) -> bool {
    obj.keys()
        .any(|k| names.iter().any(|n| k != n && fold::eq_fold(k, n)))
}

/// Some message has a key that is not one of the members the gateway reads but equals one
/// of them under case folding (`"Method"`, `"ARGUMENTS"` in `params`, …).
pub fn misspelled_member(v: &Value) -> bool {
    let messages: &[Value] = match v {
        Value::Array(items) => items,
        other => std::slice::from_ref(other),
    };
    messages.iter().filter_map(Value::as_object).any(|m| {
        if has_variant(m, &MESSAGE_MEMBERS) {
            return true;
        }
        let Some(params) = m.get("params").and_then(Value::as_object) else {
            return false;
        };
        if has_variant(params, &PARAMS_MEMBERS) {
            return true;
        }
        params
            .get("_meta")
            .and_then(Value::as_object)
            .is_some_and(|meta| has_variant(meta, &META_MEMBERS))
    })
}

/// Where a key sits: in a message, its `params`, or their `_meta`.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Level {
    Message,
    Params,
    Meta,
}

const LEVELS: [(Level, &[&str]); 3] = [
    (Level::Message, &MESSAGE_MEMBERS),
    (Level::Params, &PARAMS_MEMBERS),
    (Level::Meta, &META_MEMBERS),
];

/// The object at `level` of message `index` (the body itself, or an element of a batch).
fn object_at(v: &mut Value, index: usize, level: Level) -> Option<&mut Map<String, Value>> {
    let message = match v {
        Value::Array(items) => items.get_mut(index)?,
        other if index == 0 => other,
        _ => return None,
    };
    let obj = message.as_object_mut()?;
    if level == Level::Message {
        return Some(obj);
    }
    let params = obj.get_mut("params")?.as_object_mut()?;
    if level == Level::Params {
        return Some(params);
    }
    params.get_mut("_meta")?.as_object_mut()
}

/// `key` in another letter case: its first ASCII letter flipped (`method` → `Method`).
fn recased(key: &str) -> Option<String> {
    let i = key.find(|c: char| c.is_ascii_alphabetic())?;
    let c = char::from(key.as_bytes()[i]);
    let flipped = if c.is_ascii_lowercase() {
        c.to_ascii_uppercase()
    } else {
        c.to_ascii_lowercase()
    };
    let mut out = key.to_string();
    out.replace_range(i..=i, flipped.encode_utf8(&mut [0; 4]));
    Some(out)
}

/// Bodies one step from `v` that a case-insensitive reader sees alike: a member the
/// gateway reads renamed to another letter case (`"method"` → `"Method"`), or given a
/// twin in another letter case beside it. The checks run on these too, so a reader that
/// confuses letter cases is found from any seed, not only once the fuzzer happens to flip
/// that one byte. At most `max` bodies.
pub fn case_variants(v: &Value, max: usize) -> Vec<Vec<u8>> {
    let count = match v {
        Value::Array(items) => items.len(),
        _ => 1,
    };
    let mut out = Vec::new();
    for index in 0..count {
        for (level, names) in LEVELS {
            for name in names {
                let Some(other) = recased(name) else {
                    continue;
                };
                for twin in [false, true] {
                    if out.len() >= max {
                        return out;
                    }
                    let mut copy = v.clone();
                    let Some(obj) = object_at(&mut copy, index, level) else {
                        continue;
                    };
                    let Some(value) = obj.get(*name).cloned() else {
                        continue;
                    };
                    if !twin {
                        obj.remove(*name);
                    }
                    obj.insert(other.clone(), value);
                    if let Ok(bytes) = serde_json::to_vec(&copy) {
                        out.push(bytes);
                    }
                }
            }
        }
    }
    out
}

/// How an object of the text repeats a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Repeat {
    None,
    /// Two keys differ but are equal under case folding (`"amount"`, `"Amount"`).
    Folded,
    /// The same key twice.
    Exact,
}

/// The worst repeat of a key in any object of the text (`None` also when it is not JSON).
pub fn repeated_key(body: &[u8]) -> Repeat {
    let mut de = serde_json::Deserializer::from_slice(body);
    match de.deserialize_any(Walk) {
        Ok(r) => r,
        Err(_) => Repeat::None,
    }
}

struct Walk;

/// One value's worst repeat (what a nested element deserializes to).
struct Walkd(Repeat);

impl<'de> serde::Deserialize<'de> for Walkd {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(Walk).map(Walkd)
    }
}

impl<'de> Visitor<'de> for Walk {
    type Value = Repeat;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<Repeat, E> {
        Ok(Repeat::None)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Repeat, E> {
        Ok(Repeat::None)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Repeat, E> {
        Ok(Repeat::None)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Repeat, E> {
        Ok(Repeat::None)
    }
    fn visit_str<E>(self, _: &str) -> Result<Repeat, E> {
        Ok(Repeat::None)
    }
    fn visit_unit<E>(self) -> Result<Repeat, E> {
        Ok(Repeat::None)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Repeat, A::Error> {
        let mut worst = Repeat::None;
        while let Some(Walkd(r)) = seq.next_element()? {
            worst = worst.max(r);
        }
        Ok(worst)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Repeat, A::Error> {
        let mut worst = Repeat::None;
        let mut keys: Vec<String> = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            let Walkd(r) = map.next_value()?;
            worst = worst.max(r);
            for k in &keys {
                if *k == key {
                    worst = Repeat::Exact;
                } else if fold::eq_fold(k, &key) {
                    worst = worst.max(Repeat::Folded);
                }
            }
            keys.push(key);
        }
        Ok(worst)
    }
}
