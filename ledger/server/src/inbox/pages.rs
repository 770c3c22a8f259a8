//! The inbox's pages as they are rendered: the askama templates and what each shows of an
//! attempt or a permit, the message pages, and the words a person reads about a key.

use std::collections::BTreeMap;

use askama::Template;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use tracing::error;

use super::figures::{span, PermitFigures, Timeline};
use super::session::Session;
use crate::api::key_carriers_text;
use crate::state::AppState;
use atmost_ledger::clock::{self, Millis};
use atmost_ledger::error::LedgerError;
use atmost_ledger::model::{Attempt, AttemptState, KeyCarrier, Permit};

/// How a person knows each place a key can go.
fn carrier_label(c: KeyCarrier) -> &'static str {
    match c {
        KeyCarrier::Header => "the Idempotency-Key header",
        KeyCarrier::Meta => "params._meta[\"dev.atmost/idempotency-key\"]",
        KeyCarrier::IdempotencyKeyParam => "params.idempotencyKey",
    }
}

/// What a person reads before choosing "not executed" when the provider could not have seen
/// the call under its forwarded key in the form its lookup searches (`form`): a search there
/// by that value finds nothing whether or not the call ran. `None` when the key reached that
/// form, or no key was forwarded (there is nothing to search by).
pub fn key_warning(a: &Attempt, form: KeyCarrier, from_rule: bool) -> Option<String> {
    a.forwarded_key.as_ref()?;
    if a.forwarded_key_carriers.contains(form) {
        return None;
    }
    let whose = if from_rule {
        " (where this tool's reconcile rule looks it up)"
    } else {
        ""
    };
    let what = if a.forwarded_key_carriers.is_empty() {
        format!(
            "The gateway did not record where this key went, so it may not have reached the provider in {}{whose}",
            carrier_label(form)
        )
    } else {
        format!(
            "The provider received this key only in {}, not in {}{whose}",
            a.forwarded_key_carriers
                .iter()
                .map(carrier_label)
                .collect::<Vec<_>>()
                .join(" and "),
            carrier_label(form)
        )
    };
    Some(format!(
        "{what}: a search there by this value cannot find the call, so \"not found\" does not show that it did not run. Find it by its arguments and the time it was sent before choosing not executed."
    ))
}

/// The navigation of a signed-in page (and the sign-out form's CSRF token).
pub(super) struct Nav {
    pub(super) here: &'static str,
    pub(super) name: String,
    pub(super) csrf: String,
    /// How many calls wait for approval, shown beside the Approvals link; `None` where the
    /// page did not count them (a message page, or the store could not say).
    pub(super) waiting: Option<u64>,
}

impl Nav {
    pub(super) fn new(here: &'static str, s: &Session) -> Option<Nav> {
        Some(Nav {
            here,
            name: s.name.clone(),
            csrf: s.csrf.clone(),
            waiting: None,
        })
    }
}

#[derive(Template)]
#[template(path = "inbox/sign_in.html")]
pub(super) struct SignInPage {
    pub(super) nav: Option<Nav>,
    pub(super) message: Option<String>,
    pub(super) csrf: String,
    pub(super) name: String,
}

#[derive(Template)]
#[template(path = "inbox/message.html")]
pub(super) struct MessagePage {
    pub(super) nav: Option<Nav>,
    pub(super) heading: String,
    pub(super) text: String,
}

/// One open attempt as the inbox shows it.
pub(super) struct OpenItem {
    pub(super) id: String,
    pub(super) tool: String,
    pub(super) permit_id: String,
    pub(super) permit_label: String,
    /// `uncertain` or `awaiting_input`.
    pub(super) state: &'static str,
    pub(super) state_label: &'static str,
    pub(super) uncertain: bool,
    pub(super) waiting_for: String,
    pub(super) since: String,
    pub(super) sent_at: String,
    pub(super) lease_ends: String,
    pub(super) forwarded_key: Option<String>,
    pub(super) key_went: String,
    pub(super) key_warning: Option<String>,
    pub(super) arguments: String,
    pub(super) reason: Option<String>,
    pub(super) cost: u64,
    pub(super) round: u32,
}

#[derive(Template)]
#[template(path = "inbox/inbox.html")]
pub(super) struct InboxPage {
    pub(super) nav: Option<Nav>,
    pub(super) csrf: String,
    pub(super) message: Option<String>,
    pub(super) items: Vec<OpenItem>,
    /// The page holds [`PAGE_LIMIT`] items: older ones may wait beyond it.
    pub(super) more: bool,
}

/// One resolved attempt as the history shows it.
pub(super) struct ResolvedItem {
    pub(super) id: String,
    pub(super) tool: String,
    pub(super) permit_label: String,
    pub(super) result: &'static str,
    pub(super) result_class: &'static str,
    pub(super) by: String,
    pub(super) by_reconciler: bool,
    pub(super) at: String,
    pub(super) note: Option<String>,
    pub(super) provider_answer: Option<String>,
    pub(super) sent_at: String,
    pub(super) forwarded_key: Option<String>,
    pub(super) key_went: String,
}

#[derive(Template)]
#[template(path = "inbox/history.html")]
pub(super) struct HistoryPage {
    pub(super) nav: Option<Nav>,
    pub(super) items: Vec<ResolvedItem>,
}

pub(super) struct PermitItem {
    pub(super) id: String,
    pub(super) label: String,
    pub(super) status: String,
    pub(super) expires_at: String,
    pub(super) figures: PermitFigures,
    pub(super) open: u64,
}

/// One attempt on its own page.
pub(super) struct AttemptDetail {
    pub(super) id: String,
    pub(super) tool: String,
    pub(super) permit_id: String,
    pub(super) permit_label: String,
    pub(super) state: &'static str,
    pub(super) uncertain: bool,
    pub(super) sent_at: String,
    pub(super) cost: u64,
    pub(super) reason: Option<String>,
    pub(super) forwarded_key: Option<String>,
    pub(super) key_went: String,
    pub(super) arguments: String,
    pub(super) resolution_note: Option<String>,
}

#[derive(Template)]
#[template(path = "inbox/attempt.html")]
pub(super) struct AttemptPage {
    pub(super) nav: Option<Nav>,
    pub(super) a: AttemptDetail,
    pub(super) timeline: Timeline,
}

#[derive(Template)]
#[template(path = "inbox/permits.html")]
pub(super) struct PermitsPage {
    pub(super) nav: Option<Nav>,
    pub(super) permits: Vec<PermitItem>,
}

pub(super) fn html(status: StatusCode, page: &impl Template) -> Response {
    match page.render() {
        Ok(body) => (
            status,
            [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
            body,
        )
            .into_response(),
        Err(e) => {
            error!(error = %e, bug = true, "inbox page failed to render");
            (StatusCode::INTERNAL_SERVER_ERROR, "internal error").into_response()
        }
    }
}

pub(super) fn message(
    status: StatusCode,
    nav: Option<Nav>,
    heading: &str,
    text: String,
) -> Response {
    html(
        status,
        &MessagePage {
            nav,
            heading: heading.into(),
            text,
        },
    )
}

/// The store failed: the page says so (and whether to retry), the log says why.
pub(super) fn store_failed(state: &AppState, op: &str, e: &LedgerError) -> Response {
    state.metrics.store_errors.with_label_values(&[op]).inc();
    error!(op, error = %e, "inbox: store operation failed");
    let (status, text) = if e.is_transient() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "The ledger's store is unavailable right now; try again in a moment.",
        )
    } else {
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            "The ledger hit an internal error; its log has the details.",
        )
    };
    message(status, None, "Not available", text.into())
}

pub(super) fn key_failed() -> Response {
    message(
        StatusCode::INTERNAL_SERVER_ERROR,
        None,
        "Not available",
        "The ledger could not set up sessions; its log has the details.".into(),
    )
}

pub(super) fn label_of(permits: &BTreeMap<String, Permit>, id: &str) -> String {
    permits
        .get(id)
        .map(|p| p.label.clone())
        .unwrap_or_else(|| id.to_string())
}

pub(super) fn open_item(
    a: &Attempt,
    state: &AppState,
    permits: &BTreeMap<String, Permit>,
    now: Millis,
) -> OpenItem {
    let uncertain = a.state == AttemptState::Uncertain;
    OpenItem {
        id: a.id.clone(),
        tool: a.tool.clone(),
        permit_id: a.permit_id.clone(),
        permit_label: label_of(permits, &a.permit_id),
        state: a.state.as_str(),
        state_label: if uncertain {
            "uncertain"
        } else {
            "waiting for input"
        },
        uncertain,
        waiting_for: span(now.saturating_sub(a.updated_at_ms)),
        since: clock::rfc3339(a.updated_at_ms),
        sent_at: clock::rfc3339(a.created_at_ms),
        lease_ends: clock::rfc3339(a.lease_expires_at_ms),
        forwarded_key: a.forwarded_key.clone(),
        key_went: key_carriers_text(a.forwarded_key.as_deref(), a.forwarded_key_carriers),
        key_warning: match state.config.inbox.lookup_forms.get(&a.tool) {
            Some(form) => key_warning(a, *form, true),
            None => key_warning(a, KeyCarrier::Header, false),
        },
        arguments: shown_arguments(a, state),
        reason: a.reason.clone(),
        cost: a.cost,
        round: a.round,
    }
}

/// An attempt's arguments as a page shows them: redacted as configured, indented.
pub(super) fn shown_arguments(a: &Attempt, state: &AppState) -> String {
    match a.arguments.as_deref() {
        Some(text) => {
            let shown = state.config.redaction.show(text);
            serde_json::to_string_pretty(&shown).unwrap_or_else(|_| shown.to_string())
        }
        None => "(not kept)".into(),
    }
}
