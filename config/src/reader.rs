//! Reading the configuration's JSON one object at a time, every error naming the dotted path
//! of its field; unknown fields refused.

use serde_json::{Map, Value};

use crate::choices::Choice;

/// Which tools a list names.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolSet {
    /// `"*"` was listed.
    All,
    /// Exactly these names.
    Only(Vec<String>),
}

impl ToolSet {
    /// Whether `tool` is in the set.
    pub fn contains(&self, tool: &str) -> bool {
        match self {
            ToolSet::All => true,
            ToolSet::Only(names) => names.iter().any(|n| n == tool),
        }
    }
}

/// A configuration the filter refuses. `field` is the dotted path of the offending field.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    pub field: String,
    pub message: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.field.is_empty() {
            write!(f, "atmost: bad plugin configuration: {}", self.message)
        } else {
            write!(
                f,
                "atmost: bad plugin configuration: field `{}`: {}",
                self.field, self.message
            )
        }
    }
}

pub(crate) fn err(field: &str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.to_string(),
        message: message.into(),
    }
}

/// One JSON object being read; remembers which keys were used to refuse the rest.
pub(crate) struct Obj<'a> {
    pub(crate) path: &'a str,
    pub(crate) map: &'a Map<String, Value>,
}

impl<'a> Obj<'a> {
    pub(crate) fn field_path(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_string()
        } else {
            format!("{}.{}", self.path, key)
        }
    }

    pub(crate) fn refuse_unknown(&self, known: &[&str]) -> Result<(), ConfigError> {
        // Report in a stable order.
        let mut unknown: Vec<&String> = self
            .map
            .keys()
            .filter(|k| !known.contains(&k.as_str()))
            .collect();
        unknown.sort();
        match unknown.first() {
            None => Ok(()),
            Some(k) => Err(err(
                &self.field_path(k),
                format!("unknown field (expected one of: {})", known.join(", ")),
            )),
        }
    }

    pub(crate) fn string(&self, key: &str) -> Result<Option<String>, ConfigError> {
        match self.map.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(err(&self.field_path(key), "must be a string")),
        }
    }

    pub(crate) fn required_string(&self, key: &str) -> Result<String, ConfigError> {
        match self.string(key)? {
            Some(s) if !s.is_empty() => Ok(s),
            Some(_) => Err(err(&self.field_path(key), "must not be empty")),
            None => Err(err(&self.field_path(key), "is required")),
        }
    }

    /// A secret given either in place (`key`) or by the name of an environment variable of
    /// the VM (`key` + `_env`), which Envoy fills from its own environment when the name is
    /// listed in `vm_config.environment_variables.host_env_keys`. The second form keeps the
    /// secret out of what Envoy's admin `/config_dump` shows.
    pub(crate) fn secret(
        &self,
        key: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<String, ConfigError> {
        let env_key = format!("{key}_env");
        match (self.map.contains_key(key), self.map.contains_key(&env_key)) {
            (true, true) => Err(err(
                &self.field_path(key),
                format!("is given twice: set `{key}` or `{env_key}`, not both"),
            )),
            (false, true) => {
                let name = self.required_string(&env_key)?;
                match env(&name) {
                    Some(v) if !v.is_empty() => Ok(v),
                    _ => Err(err(
                        &self.field_path(&env_key),
                        format!(
                            "names the environment variable `{name}`, which is unset or empty in the Wasm VM (list it in vm_config.environment_variables.host_env_keys and set it in Envoy's environment)"
                        ),
                    )),
                }
            }
            _ => self.required_string(key),
        }
    }

    pub(crate) fn integer(
        &self,
        key: &str,
        default: u64,
        min: u64,
        max: u64,
    ) -> Result<u64, ConfigError> {
        let n = match self.map.get(key) {
            None => return Ok(default),
            Some(v) => v
                .as_u64()
                .ok_or_else(|| err(&self.field_path(key), "must be a non-negative integer"))?,
        };
        if n < min || n > max {
            return Err(err(
                &self.field_path(key),
                format!("must be between {min} and {max} (got {n})"),
            ));
        }
        Ok(n)
    }

    pub(crate) fn boolean(&self, key: &str, default: bool) -> Result<bool, ConfigError> {
        match self.map.get(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(err(&self.field_path(key), "must be true or false")),
        }
    }

    pub(crate) fn object(&self, key: &str) -> Result<Option<&'a Map<String, Value>>, ConfigError> {
        match self.map.get(key) {
            None => Ok(None),
            Some(Value::Object(m)) => Ok(Some(m)),
            Some(_) => Err(err(&self.field_path(key), "must be an object")),
        }
    }

    /// A field whose value names one row of a closed set ([`Choice`]); absent, the set's
    /// default.
    pub(crate) fn choice<T: Choice>(&self, key: &str) -> Result<T, ConfigError> {
        Ok(T::row(self.index_of_name(key, T::names())?.unwrap_or(0)))
    }

    /// Which of `names` the field holds (`None`: absent); one body for every closed set.
    fn index_of_name(&self, key: &str, names: &[&str]) -> Result<Option<usize>, ConfigError> {
        let Some(name) = self.string(key)? else {
            return Ok(None);
        };
        match names.iter().position(|n| *n == name) {
            Some(index) => Ok(Some(index)),
            None => {
                let listed: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
                Err(err(
                    &self.field_path(key),
                    format!("must be one of {}", listed.join(", ")),
                ))
            }
        }
    }

    pub(crate) fn tool_set(&self, key: &str, default: ToolSet) -> Result<ToolSet, ConfigError> {
        let path = self.field_path(key);
        let items = match self.map.get(key) {
            None => return Ok(default),
            Some(Value::Array(items)) => items,
            Some(_) => return Err(err(&path, "must be an array of tool names")),
        };
        let mut names = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            match item {
                Value::String(s) if !s.is_empty() => names.push(s.clone()),
                _ => {
                    return Err(err(
                        &format!("{path}[{i}]"),
                        "must be a non-empty string (a tool name or \"*\")",
                    ))
                }
            }
        }
        if names.iter().any(|n| n == "*") {
            Ok(ToolSet::All)
        } else {
            Ok(ToolSet::Only(names))
        }
    }
}

pub(crate) fn is_token_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

pub(crate) fn printable_ascii(s: &str) -> bool {
    s.bytes().all(|b| (0x20..=0x7e).contains(&b))
}

/// The configuration bytes as JSON; an empty or unreadable configuration is refused.
pub(crate) fn json_object(bytes: &[u8]) -> Result<Value, ConfigError> {
    if bytes.iter().all(|b| b.is_ascii_whitespace()) {
        return Err(err(
            "",
            "configuration is empty; `ledger.cluster` and `ledger.service_token` are required",
        ));
    }
    serde_json::from_slice(bytes).map_err(|e| {
        err(
            "",
            format!("not valid JSON (line {}, column {})", e.line(), e.column()),
        )
    })
}
