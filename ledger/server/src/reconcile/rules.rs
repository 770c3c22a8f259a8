//! The reconciliation rule file: parsed, then checked, before the ledger listens.
//!
//! A rule says which tool's uncertain attempts to look up, on which MCP server, with which
//! lookup tool and arguments, and how to read the answer. Credentials never come from the
//! file: a rule names an environment variable or a file that holds them.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Map, Value};

use atmost_ledger::clock::{rfc3339, Millis};
use atmost_ledger::model::{Attempt, KeyCarrier, KeyCarriers};

/// Every rule and the reconciler's timings, checked.
#[derive(Debug, Clone)]
pub struct RuleSet {
    /// An attempt is first looked up once it has been uncertain this long.
    pub delay: Duration,
    /// How often the reconciler looks for attempts to look up.
    pub interval: Duration,
    /// Longest one lookup (connect, initialize, call) may take.
    pub timeout: Duration,
    /// Lookups running at once, at most.
    pub concurrency: usize,
    /// After an answer that settles nothing, the next lookup of the attempt waits `delay`,
    /// then twice that, and so on, up to this.
    pub backoff_max: Duration,
    pub rules: Vec<Rule>,
}

/// One checked rule.
#[derive(Debug, Clone)]
pub struct Rule {
    pub name: String,
    pub tool: String,
    pub url: String,
    pub credential: Option<Credential>,
    pub lookup_tool: String,
    pub arguments: Map<String, Value>,
    /// The form of the key the provider's lookup finds a call by, when its arguments name
    /// `{{forwarded_key}}` (`lookup.key_carrier`, `header` by default); `None` when they do
    /// not, and the key's form does not matter to the lookup.
    pub key_carrier: Option<KeyCarrier>,
    pub pointer: String,
    pub executed: Vec<Value>,
    pub not_executed: Vec<Value>,
    /// The provider promises its lookup sees every call that reached it under the key's form,
    /// with no lag (`answer.not_found_authoritative`, false by default): only then does a
    /// `not_executed` answer give slot and budget back.
    pub not_found_authoritative: bool,
}

/// A credential read from the environment or a file when the rule file is loaded.
#[derive(Clone)]
pub struct Credential {
    /// `None`: `Authorization: Bearer <value>`; else this header carries the value as is.
    pub header: Option<String>,
    pub value: String,
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credential")
            .field("header", &self.header)
            .field("value", &"[redacted]")
            .finish()
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileRaw {
    #[serde(default)]
    delay: Option<String>,
    #[serde(default)]
    interval: Option<String>,
    #[serde(default)]
    timeout: Option<String>,
    #[serde(default)]
    concurrency: Option<usize>,
    #[serde(default)]
    backoff_max: Option<String>,
    rules: Vec<RuleRaw>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleRaw {
    name: String,
    tool: String,
    server: ServerRaw,
    lookup: LookupRaw,
    answer: AnswerRaw,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ServerRaw {
    url: String,
    #[serde(default)]
    credentials: Option<CredentialsRaw>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CredentialsRaw {
    #[serde(default)]
    env: Option<String>,
    #[serde(default)]
    file: Option<PathBuf>,
    #[serde(default)]
    header: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LookupRaw {
    tool: String,
    #[serde(default)]
    arguments: Map<String, Value>,
    #[serde(default)]
    key_carrier: Option<KeyCarrier>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AnswerRaw {
    pointer: String,
    executed: Vec<Value>,
    not_executed: Vec<Value>,
    #[serde(default)]
    not_found_authoritative: bool,
}

/// Where the ledger finds credentials: the process environment, or a stand-in in tests.
pub trait Env {
    fn var(&self, name: &str) -> Option<String>;
}

/// The process environment.
pub struct ProcessEnv;

impl Env for ProcessEnv {
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }
}

/// Reads and checks the rule file at `path`. The error says which rule and field is wrong.
pub fn load(path: &Path, env: &dyn Env) -> Result<RuleSet, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("reconcile rules {}: {e}", path.display()))?;
    parse(&text, env).map_err(|e| format!("reconcile rules {}: {e}", path.display()))
}

/// Parses (JSON) and checks a rule file's text.
pub fn parse(text: &str, env: &dyn Env) -> Result<RuleSet, String> {
    let raw: FileRaw = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let duration =
        |field: &str, v: &Option<String>, default: Duration| -> Result<Duration, String> {
            let d = match v {
                None => default,
                Some(s) => humantime::parse_duration(s).map_err(|e| format!("{field}: {e}"))?,
            };
            if d.is_zero() {
                return Err(format!("{field} must be positive"));
            }
            Ok(d)
        };
    let delay = duration("delay", &raw.delay, Duration::from_secs(60))?;
    let interval = duration("interval", &raw.interval, Duration::from_secs(5))?;
    let timeout = duration("timeout", &raw.timeout, Duration::from_secs(10))?;
    let backoff_max = duration("backoff_max", &raw.backoff_max, Duration::from_secs(3600))?;
    let concurrency = raw.concurrency.unwrap_or(4);
    if concurrency == 0 {
        return Err("concurrency must be at least 1".into());
    }
    if raw.rules.is_empty() {
        return Err("rules: at least one rule is needed".into());
    }
    let mut names = BTreeSet::new();
    let mut tools = BTreeSet::new();
    let mut rules = Vec::with_capacity(raw.rules.len());
    for (i, r) in raw.rules.into_iter().enumerate() {
        let at = if r.name.trim().is_empty() {
            format!("rules[{i}]")
        } else {
            format!("rule {:?}", r.name)
        };
        let rule = check_rule(r, env).map_err(|e| format!("{at}: {e}"))?;
        if !names.insert(rule.name.clone()) {
            return Err(format!("{at}: another rule has the same name"));
        }
        if !tools.insert(rule.tool.clone()) {
            return Err(format!("{at}: another rule is for tool {:?}", rule.tool));
        }
        rules.push(rule);
    }
    Ok(RuleSet {
        delay,
        interval,
        timeout,
        concurrency,
        backoff_max,
        rules,
    })
}

fn check_rule(r: RuleRaw, env: &dyn Env) -> Result<Rule, String> {
    if r.name.trim().is_empty() {
        return Err("name must not be empty".into());
    }
    if r.tool.trim().is_empty() {
        return Err("tool must not be empty".into());
    }
    if r.lookup.tool.trim().is_empty() {
        return Err("lookup.tool must not be empty".into());
    }
    let url = reqwest::Url::parse(&r.server.url).map_err(|e| format!("server.url: {e}"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err("server.url must be an http:// or https:// URL".into());
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(
            "server.url must not hold credentials: name them in server.credentials (env or file)"
                .into(),
        );
    }
    let credential = r
        .server
        .credentials
        .map(|c| credential(c, env))
        .transpose()?;
    for (name, v) in &r.lookup.arguments {
        check_template(v).map_err(|e| format!("lookup.arguments.{name}: {e}"))?;
    }
    let by_key = r.lookup.arguments.values().any(names_forwarded_key);
    let key_carrier = match (by_key, r.lookup.key_carrier) {
        (true, carrier) => Some(carrier.unwrap_or(KeyCarrier::Header)),
        (false, None) => None,
        (false, Some(_)) => {
            return Err(
                "lookup.key_carrier: the lookup's arguments do not name {{forwarded_key}}".into(),
            )
        }
    };
    if !(r.answer.pointer.is_empty() || r.answer.pointer.starts_with('/')) {
        return Err(format!(
            "answer.pointer {:?} is not a JSON Pointer (it starts with '/')",
            r.answer.pointer
        ));
    }
    if r.answer.executed.is_empty() || r.answer.not_executed.is_empty() {
        return Err("answer.executed and answer.not_executed each need at least one value".into());
    }
    if let Some(v) = r
        .answer
        .executed
        .iter()
        .find(|v| r.answer.not_executed.contains(v))
    {
        return Err(format!(
            "answer value {v} is in both executed and not_executed"
        ));
    }
    Ok(Rule {
        name: r.name,
        tool: r.tool,
        url: url.to_string(),
        credential,
        lookup_tool: r.lookup.tool,
        arguments: r.lookup.arguments,
        key_carrier,
        pointer: r.answer.pointer,
        executed: r.answer.executed,
        not_executed: r.answer.not_executed,
        not_found_authoritative: r.answer.not_found_authoritative,
    })
}

fn credential(c: CredentialsRaw, env: &dyn Env) -> Result<Credential, String> {
    let value =
        match (c.env, c.file) {
            (Some(name), None) => env
                .var(&name)
                .ok_or_else(|| format!("server.credentials.env: {name} is not set"))?,
            (None, Some(path)) => std::fs::read_to_string(&path)
                .map_err(|e| format!("server.credentials.file {}: {e}", path.display()))?,
            _ => return Err(
                "server.credentials needs exactly one of env (a variable's name) or file (a path)"
                    .into(),
            ),
        };
    let value = value.trim().to_string();
    if value.is_empty() {
        return Err("server.credentials: the credential is empty".into());
    }
    if reqwest::header::HeaderValue::from_str(&value).is_err() {
        return Err("server.credentials: the credential is not a valid header value".into());
    }
    if let Some(h) = &c.header {
        let name = reqwest::header::HeaderName::from_bytes(h.as_bytes())
            .map_err(|_| format!("server.credentials.header {h:?} is not a header name"))?;
        if name == reqwest::header::AUTHORIZATION {
            return Err("server.credentials.header: leave it out for Authorization: Bearer".into());
        }
    }
    Ok(Credential {
        header: c.header,
        value,
    })
}

/// What a template can name.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Placeholder {
    /// The `Idempotency-Key` value the upstream received.
    ForwardedKey,
    /// When the call was sent, RFC 3339.
    SentAt,
    /// When the call was sent, seconds since the Unix epoch.
    SentAtUnix,
    /// The call's arguments, or (with a JSON Pointer) one value in them.
    Arguments(String),
}

fn placeholder(name: &str) -> Result<Placeholder, String> {
    let name = name.trim();
    match name {
        "forwarded_key" => Ok(Placeholder::ForwardedKey),
        "sent_at" => Ok(Placeholder::SentAt),
        "sent_at_unix" => Ok(Placeholder::SentAtUnix),
        "arguments" => Ok(Placeholder::Arguments(String::new())),
        _ => match name.strip_prefix("arguments/") {
            Some(p) => Ok(Placeholder::Arguments(format!("/{p}"))),
            None => Err(format!(
                "unknown placeholder {{{{{name}}}}} (known: forwarded_key, sent_at, sent_at_unix, arguments, arguments/POINTER)"
            )),
        },
    }
}

/// A string split into literal text and placeholders.
enum Piece {
    Text(String),
    Hole(Placeholder),
}

fn pieces(s: &str) -> Result<Vec<Piece>, String> {
    let mut out = Vec::new();
    let mut rest = s;
    while let Some(start) = rest.find("{{") {
        if start > 0 {
            out.push(Piece::Text(rest[..start].to_string()));
        }
        let after = &rest[start + 2..];
        let end = after
            .find("}}")
            .ok_or_else(|| format!("unclosed placeholder in {s:?}"))?;
        out.push(Piece::Hole(placeholder(&after[..end])?));
        rest = &after[end + 2..];
    }
    if !rest.is_empty() {
        out.push(Piece::Text(rest.to_string()));
    }
    Ok(out)
}

/// Whether a (checked) template names `{{forwarded_key}}` anywhere.
fn names_forwarded_key(v: &Value) -> bool {
    match v {
        Value::String(s) => pieces(s)
            .unwrap_or_default()
            .iter()
            .any(|p| matches!(p, Piece::Hole(Placeholder::ForwardedKey))),
        Value::Array(items) => items.iter().any(names_forwarded_key),
        Value::Object(m) => m.values().any(names_forwarded_key),
        _ => false,
    }
}

fn check_template(v: &Value) -> Result<(), String> {
    match v {
        Value::String(s) => pieces(s).map(|_| ()),
        Value::Array(items) => items.iter().try_for_each(check_template),
        Value::Object(m) => m.values().try_for_each(check_template),
        _ => Ok(()),
    }
}

/// What fills a template: one attempt.
pub struct Facts<'a> {
    pub forwarded_key: Option<&'a str>,
    /// Where the upstream received the forwarded key.
    pub forwarded_key_carriers: KeyCarriers,
    pub sent_at_ms: Millis,
    /// The call's arguments, parsed; `None` when not kept (or pruned).
    pub arguments: Option<&'a Value>,
}

impl<'a> Facts<'a> {
    pub fn of(a: &'a Attempt, arguments: Option<&'a Value>) -> Self {
        Facts {
            forwarded_key: a.forwarded_key.as_deref(),
            forwarded_key_carriers: a.forwarded_key_carriers,
            sent_at_ms: a.created_at_ms,
            arguments,
        }
    }

    fn value(&self, p: &Placeholder) -> Result<Value, String> {
        match p {
            Placeholder::ForwardedKey => self
                .forwarded_key
                .map(|k| Value::String(k.to_string()))
                .ok_or_else(|| "the attempt has no forwarded key".to_string()),
            Placeholder::SentAt => Ok(Value::String(rfc3339(self.sent_at_ms))),
            Placeholder::SentAtUnix => Ok(Value::from(self.sent_at_ms.div_euclid(1000))),
            Placeholder::Arguments(pointer) => self
                .arguments
                .ok_or_else(|| "the attempt's arguments are not kept".to_string())?
                .pointer(pointer)
                .cloned()
                .ok_or_else(|| format!("the arguments have nothing at {pointer}")),
        }
    }
}

/// The lookup's arguments for one attempt. A string that is one placeholder becomes its value
/// (any JSON type); placeholders inside a longer string are written into it (a string as is,
/// anything else as JSON). `Err` names what the attempt lacks.
pub fn fill(
    template: &Map<String, Value>,
    facts: &Facts<'_>,
) -> Result<Map<String, Value>, String> {
    template
        .iter()
        .map(|(k, v)| Ok((k.clone(), fill_value(v, facts)?)))
        .collect()
}

fn fill_value(v: &Value, facts: &Facts<'_>) -> Result<Value, String> {
    match v {
        Value::String(s) => {
            let mut parts = pieces(s)?;
            if let [Piece::Hole(p)] = parts.as_slice() {
                return facts.value(p);
            }
            let mut out = String::new();
            for part in parts.drain(..) {
                match part {
                    Piece::Text(t) => out.push_str(&t),
                    Piece::Hole(p) => match facts.value(&p)? {
                        Value::String(s) => out.push_str(&s),
                        other => out.push_str(&other.to_string()),
                    },
                }
            }
            Ok(Value::String(out))
        }
        Value::Array(items) => items.iter().map(|i| fill_value(i, facts)).collect(),
        Value::Object(m) => Ok(Value::Object(fill(m, facts)?)),
        other => Ok(other.clone()),
    }
}

/// What an answer says.
#[derive(Debug, Clone, PartialEq)]
pub enum Reading {
    Executed(Value),
    NotExecuted(Value),
    /// A `not_executed` value from a lookup the rule does not call authoritative: the
    /// provider did not find the call, which does not show that it did not run.
    NotFoundUnconfirmed(Value),
    /// The tool answered with `isError: true`.
    ToolError,
    /// No `structuredContent`, or nothing at the pointer.
    MissingField,
    /// A value neither list holds.
    UnknownValue(Value),
}

impl Rule {
    /// The lookup's arguments for one attempt ([`fill`]), refused (`Err` says why) when the
    /// lookup finds calls by the forwarded key in a form this attempt's upstream did not
    /// receive it in: the provider could not have seen the call under that value, so its
    /// answer would say nothing about it. An attempt whose carriers were not recorded is
    /// refused alike.
    pub fn arguments_for(&self, facts: &Facts<'_>) -> Result<Map<String, Value>, String> {
        if let Some(carrier) = self.key_carrier {
            if facts.forwarded_key.is_some() && !facts.forwarded_key_carriers.contains(carrier) {
                return Err(format!(
                    "the lookup finds calls by the key in {carrier}, and this attempt's upstream \
                     received it in {}",
                    if facts.forwarded_key_carriers.is_empty() {
                        "no recorded carrier".to_string()
                    } else {
                        facts.forwarded_key_carriers.to_list()
                    }
                ));
            }
        }
        fill(&self.arguments, facts)
    }

    /// Reads a lookup's answer: only a value one of the lists holds settles the attempt, and
    /// a `not_executed` one only when the rule says the lookup is authoritative.
    pub fn read(&self, is_error: bool, structured: Option<&Value>) -> Reading {
        if is_error {
            return Reading::ToolError;
        }
        let Some(v) = structured.and_then(|s| s.pointer(&self.pointer)) else {
            return Reading::MissingField;
        };
        if self.executed.contains(v) {
            Reading::Executed(v.clone())
        } else if self.not_executed.contains(v) && self.not_found_authoritative {
            Reading::NotExecuted(v.clone())
        } else if self.not_executed.contains(v) {
            Reading::NotFoundUnconfirmed(v.clone())
        } else {
            Reading::UnknownValue(v.clone())
        }
    }
}
