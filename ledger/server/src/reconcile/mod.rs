//! The reconciler: asks the provider whether an `uncertain` call ran, and resolves it only
//! on a definite answer.
//!
//! Every `interval` it lists the uncertain attempts whose tool has a rule and that have been
//! uncertain at least `delay`, and calls the rule's lookup tool on the provider's MCP server
//! (Streamable HTTP, the `rmcp` client), at most `concurrency` at once, each bounded by
//! `timeout`. A value the rule lists as executed or not executed resolves the attempt through
//! the store's atomic resolve (`uncertain` → `resolved_*`), so when another replica or a
//! person resolved it first, this resolution is refused and nothing changes; a `not_executed`
//! value does so only when the rule calls the lookup authoritative. Anything else (an error,
//! a timeout, an unknown value, a missing field, a "not found" the rule does not trust, an
//! attempt lacking what the arguments template names, or whose key its upstream did not
//! receive in the form the lookup searches) leaves it `uncertain`, is logged and counted in
//! `atmost_reconciler_lookups_total{result}` (a [`LookupResult`]), and the attempt is asked
//! again after a backoff.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rmcp::model::CallToolRequestParams;
use rmcp::transport::streamable_http_client::{
    StreamableHttpClientTransport, StreamableHttpClientTransportConfig,
};
use rmcp::ServiceExt;
use serde_json::{Map, Value};
use tokio::sync::Semaphore;
use tracing::{info, warn};

use crate::metrics::LookupResult;
use crate::resolution::resolved;
use crate::state::Shared;
use atmost_ledger::clock::Millis;
use atmost_ledger::decide::ResolveInput;
use atmost_ledger::error::ResolveError;
use atmost_ledger::model::{Attempt, ResolutionSource};

pub mod rules;
#[cfg(test)]
mod tests;

pub use rules::{Reading, Rule, RuleSet};

/// Uncertain attempts read per page of the walk, oldest first.
const SCAN_LIMIT: u32 = 500;
/// At most this many pages per pass, so one pass's reads stay bounded however many attempts
/// are uncertain; the next pass goes on from there.
const PAGES_PER_PASS: usize = 20;
/// The largest answer a lookup may return.
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// When each attempt may be looked up again, and how many lookups settled nothing.
#[derive(Debug, Clone, Copy)]
struct Backoff {
    failures: u32,
    next_at: Millis,
    running: bool,
}

/// The next wait after `failures` lookups that settled nothing: `delay`, doubled each time,
/// at most `max`.
pub fn backoff_after(delay: Duration, max: Duration, failures: u32) -> Duration {
    let factor = 1u32.checked_shl(failures.min(31)).unwrap_or(u32::MAX);
    delay.saturating_mul(factor).min(max)
}

/// Where the walk over uncertain attempts stands between passes.
#[derive(Debug)]
struct Walk {
    /// The order's key of the last attempt examined (`(Millis::MIN, "")`: from the start).
    after: (Millis, String),
    /// Attempts met since the walk last started over.
    seen: HashSet<String>,
}

/// What one page of the walk gives a pass.
#[derive(Debug, PartialEq)]
struct PageScan {
    /// Attempts to look up now, at most the free slots.
    due: Vec<Attempt>,
    /// How many of the page's attempts were examined (the walk goes on after the last).
    examined: usize,
    /// An attempt uncertain for less than the delay was met: every later one is too, so
    /// the walk is over.
    too_recent: bool,
}

/// Examines a page in order: stops at the first attempt too recent to look up, or when
/// `free` attempts are due (the next pass starts at the first one not examined).
fn take_due(
    page: &[Attempt],
    free: usize,
    is_due: impl Fn(&Attempt) -> bool,
    is_too_recent: impl Fn(&Attempt) -> bool,
) -> PageScan {
    let mut scan = PageScan {
        due: Vec::new(),
        examined: 0,
        too_recent: false,
    };
    for a in page {
        if is_too_recent(a) {
            scan.too_recent = true;
            break;
        }
        if scan.due.len() >= free {
            break;
        }
        if is_due(a) {
            scan.due.push(a.clone());
        }
        scan.examined += 1;
    }
    scan
}

struct Reconciler {
    state: Shared,
    walk: Mutex<Walk>,
    rules: RuleSet,
    http: reqwest::Client,
    slots: Arc<Semaphore>,
    backoff: Mutex<HashMap<String, Backoff>>,
}

/// Starts the reconciler on the current runtime.
pub fn spawn(state: Shared, rules: RuleSet) -> Result<tokio::task::JoinHandle<()>, String> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::builder()
        .timeout(rules.timeout)
        .build()
        .map_err(|e| format!("reconciler HTTP client: {e}"))?;
    let me = Arc::new(Reconciler {
        state,
        slots: Arc::new(Semaphore::new(rules.concurrency)),
        rules,
        http,
        backoff: Mutex::new(HashMap::new()),
        walk: Mutex::new(Walk {
            after: (Millis::MIN, String::new()),
            seen: HashSet::new(),
        }),
    });
    for r in &me.rules.rules {
        info!(rule = %r.name, tool = %r.tool, server = %r.url, lookup = %r.lookup_tool, "reconcile rule loaded");
    }
    Ok(tokio::spawn(async move {
        let mut tick = tokio::time::interval(me.rules.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            me.clone().pass().await;
        }
    }))
}

impl Reconciler {
    fn rule_for(&self, tool: &str) -> Option<&Rule> {
        self.rules.rules.iter().find(|r| r.tool == tool)
    }

    fn count(&self, result: LookupResult) {
        self.state.metrics.count_lookup(result);
    }

    /// One pass: starts a lookup for each attempt that is due, as slots allow. The pass goes
    /// on from where the last one stopped in the walk over every uncertain attempt (oldest
    /// first, a page at a time), so attempts of tools without a rule, or ones that stay
    /// unknown, never hide the ones behind them; a walk that reaches the end starts over.
    async fn pass(self: Arc<Self>) {
        let now = self.state.clock.now_ms();
        let free = self.slots.available_permits();
        if free == 0 {
            return;
        }
        let delay_ms = millis(self.rules.delay);
        let mut after = self
            .walk
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .after
            .clone();
        let mut due: Vec<Attempt> = Vec::new();
        let mut seen: Vec<String> = Vec::new();
        let mut wrapped = false;
        for _ in 0..PAGES_PER_PASS {
            let page = match self
                .state
                .store
                .uncertain_after((after.0, &after.1), SCAN_LIMIT)
                .await
            {
                Ok(a) => a,
                Err(e) => {
                    warn!(error = %e, "reconciler could not list uncertain attempts");
                    return;
                }
            };
            let full = page.len() == SCAN_LIMIT as usize;
            let scan = {
                let backoff = self.backoff.lock().unwrap_or_else(PoisonError::into_inner);
                take_due(
                    &page,
                    free - due.len(),
                    // Only called on attempts past the delay (`take_due` stops before the
                    // first one that is not).
                    |a| {
                        self.rule_for(&a.tool).is_some()
                            && backoff
                                .get(&a.id)
                                .is_none_or(|b| !b.running && now >= b.next_at)
                    },
                    |a| now.saturating_sub(a.updated_at_ms) < delay_ms,
                )
            };
            seen.extend(page[..scan.examined].iter().map(|a| a.id.clone()));
            if let Some(last) = scan.examined.checked_sub(1).and_then(|i| page.get(i)) {
                after = (last.updated_at_ms, last.id.clone());
            }
            due.extend(scan.due);
            if scan.too_recent || (!full && scan.examined == page.len()) {
                wrapped = true;
                break;
            }
            if due.len() >= free {
                break;
            }
        }
        {
            let mut walk = self.walk.lock().unwrap_or_else(PoisonError::into_inner);
            walk.seen.extend(seen);
            walk.after = if wrapped {
                (Millis::MIN, String::new())
            } else {
                after
            };
            if wrapped {
                // Forget attempts no longer uncertain (resolved here, elsewhere, or by a
                // person): the walk that just ended did not meet them.
                let seen = std::mem::take(&mut walk.seen);
                let mut backoff = self.backoff.lock().unwrap_or_else(PoisonError::into_inner);
                backoff.retain(|id, b| b.running || seen.contains(id));
            }
        }
        for a in due {
            let Ok(slot) = self.slots.clone().try_acquire_owned() else {
                break;
            };
            {
                let mut backoff = self.backoff.lock().unwrap_or_else(PoisonError::into_inner);
                let b = backoff.entry(a.id.clone()).or_insert(Backoff {
                    failures: 0,
                    next_at: now,
                    running: false,
                });
                b.running = true;
            }
            let me = self.clone();
            tokio::spawn(async move {
                let settled = me.reconcile(&a).await;
                let now = me.state.clock.now_ms();
                let mut backoff = me.backoff.lock().unwrap_or_else(PoisonError::into_inner);
                if settled {
                    backoff.remove(&a.id);
                } else if let Some(b) = backoff.get_mut(&a.id) {
                    b.running = false;
                    b.failures = b.failures.saturating_add(1);
                    let wait = backoff_after(me.rules.delay, me.rules.backoff_max, b.failures);
                    b.next_at = now.saturating_add(millis(wait));
                }
                drop(slot);
            });
        }
    }

    /// Looks one attempt up and resolves it on a definite answer. `true` when the attempt is
    /// no longer uncertain (resolved here or before).
    async fn reconcile(&self, a: &Attempt) -> bool {
        let Some(rule) = self.rule_for(&a.tool) else {
            return false;
        };
        let parsed = a
            .arguments
            .as_deref()
            .and_then(|t| serde_json::from_str::<Value>(t).ok());
        let facts = rules::Facts::of(a, parsed.as_ref());
        let arguments = match rule.arguments_for(&facts) {
            Ok(args) => args,
            Err(why) => {
                self.count(LookupResult::NoInput);
                warn!(attempt_id = %a.id, rule = %rule.name, why = %why,
                    "reconciler cannot look this attempt up; it stays uncertain");
                return false;
            }
        };
        let answer =
            tokio::time::timeout(self.rules.timeout, lookup(&self.http, rule, arguments)).await;
        let (is_error, structured) = match answer {
            Err(_) => {
                self.count(LookupResult::Timeout);
                warn!(attempt_id = %a.id, rule = %rule.name, timeout_ms = millis(self.rules.timeout),
                    "lookup timed out; the attempt stays uncertain");
                return false;
            }
            Ok(Err(e)) => {
                self.count(LookupResult::Error);
                warn!(attempt_id = %a.id, rule = %rule.name, error = %e,
                    "lookup failed; the attempt stays uncertain");
                return false;
            }
            Ok(Ok(answer)) => answer,
        };
        let evidence = structured
            .as_ref()
            .map_or_else(|| "null".to_string(), Value::to_string);
        let (executed, value) = match rule.read(is_error, structured.as_ref()) {
            Reading::Executed(v) => (true, v),
            Reading::NotExecuted(v) => (false, v),
            Reading::NotFoundUnconfirmed(v) => {
                self.count(LookupResult::NotFoundUnconfirmed);
                warn!(attempt_id = %a.id, rule = %rule.name, pointer = %rule.pointer, value = %v,
                    "lookup did not find the call, and the rule does not call its lookup authoritative (answer.not_found_authoritative); the attempt stays uncertain for a person");
                return false;
            }
            Reading::ToolError => {
                self.count(LookupResult::Error);
                warn!(attempt_id = %a.id, rule = %rule.name, answer = %evidence,
                    "lookup answered isError; the attempt stays uncertain");
                return false;
            }
            Reading::MissingField => {
                self.count(LookupResult::MissingField);
                warn!(attempt_id = %a.id, rule = %rule.name, pointer = %rule.pointer, answer = %evidence,
                    "lookup answer has nothing at the rule's pointer; the attempt stays uncertain");
                return false;
            }
            Reading::UnknownValue(v) => {
                self.count(LookupResult::UnknownValue);
                warn!(attempt_id = %a.id, rule = %rule.name, pointer = %rule.pointer, value = %v,
                    "lookup answered a value the rule does not list; the attempt stays uncertain");
                return false;
            }
        };
        let input = ResolveInput {
            executed,
            receipt: None,
            note: Some(format!(
                "{} answered {} = {value}",
                rule.lookup_tool,
                if rule.pointer.is_empty() {
                    "/"
                } else {
                    &rule.pointer
                }
            )),
            by: rule.name.clone(),
            source: ResolutionSource::Reconciler {
                provider_answer: evidence,
            },
        };
        let now = self.state.clock.now_ms();
        match self.state.store.resolve_attempt(&a.id, &input, now).await {
            Ok(done) => {
                self.count(if executed {
                    LookupResult::Executed
                } else {
                    LookupResult::NotExecuted
                });
                resolved(&self.state, &done, &input, "reconciler", None);
                true
            }
            Err(ResolveError::NotUncertain(s)) => {
                self.count(LookupResult::AlreadyResolved);
                info!(attempt_id = %a.id, rule = %rule.name, state = %s,
                    "attempt was resolved elsewhere first; this resolution is dropped");
                true
            }
            Err(ResolveError::UnknownAttempt) => {
                self.count(LookupResult::AlreadyResolved);
                true
            }
            Err(ResolveError::Ledger(e)) => {
                self.count(LookupResult::StoreError);
                warn!(attempt_id = %a.id, rule = %rule.name, error = %e,
                    "could not record the resolution; the attempt stays uncertain");
                false
            }
        }
    }
}

/// Calls the rule's lookup tool: one MCP session (initialize, `tools/call`, close). Answers
/// `isError` and `structuredContent`.
async fn lookup(
    http: &reqwest::Client,
    rule: &Rule,
    arguments: Map<String, Value>,
) -> Result<(bool, Option<Value>), String> {
    let mut config = StreamableHttpClientTransportConfig::with_uri(rule.url.as_str())
        .max_json_response_size(MAX_ANSWER_BYTES)
        .max_sse_event_size(MAX_ANSWER_BYTES);
    if let Some(c) = &rule.credential {
        match &c.header {
            None => config = config.auth_header(c.value.clone()),
            Some(h) => {
                let name = reqwest::header::HeaderName::from_bytes(h.as_bytes())
                    .map_err(|e| e.to_string())?;
                let value =
                    reqwest::header::HeaderValue::from_str(&c.value).map_err(|e| e.to_string())?;
                config = config.custom_headers(HashMap::from([(name, value)]));
            }
        }
    }
    let transport = StreamableHttpClientTransport::with_client(http.clone(), config);
    let client = ().serve(transport).await.map_err(|e| format!("initialize: {e}"))?;
    let called = client
        .call_tool(CallToolRequestParams::new(rule.lookup_tool.clone()).with_arguments(arguments))
        .await;
    let _ = client.cancel().await;
    let result = called.map_err(|e| format!("tools/call {}: {e}", rule.lookup_tool))?;
    Ok((result.is_error.unwrap_or(false), result.structured_content))
}

fn millis(d: Duration) -> Millis {
    Millis::try_from(d.as_millis()).unwrap_or(Millis::MAX)
}
