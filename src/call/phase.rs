//! The phases a request goes through. Each is its own type in its own file, which handles
//! the events that reach it and says what the request steps to; [`Call`](super::Call)
//! only routes each event to the phase the request is in.
//!
//! ```text
//! Start ──non-POST / bodiless POST──────────────────────────────────▶ Passing
//!   │ POST
//!   ▼
//! ReadingBody ──too large / unreadable / batch with tools/call──────▶ Answered (local reply)
//!   │ ──not tools/call / ungoverned tool────────────────────────────▶ Passing
//!   │     (carrying a key: Forwarding, the key rewritten for upstream)
//!   │ ──no permit / bad key─────────────────────────────────────────▶ Answered (denial)
//!   ▼ governed tools/call: ONE authorize callout
//! Authorizing ──deny / replay / ledger unavailable──────────────────▶ Answered
//!   │ ──approval_required, `approval_hold_ms`: held, the ledger asked again on the root's
//!   │   tick after `retry_after`; its next answer is handled as this one; at the bound
//!   │   the last approval_required is answered────────────────────────────────▶ Answered
//!   │ ──dispatch under another permit than the token names, or (`request_hold: headers`)
//!   │   without a signature over what was asked: deny, report `released`──▶ Answered
//!   │ dispatch: rewrite the key, add the ledger's signature, then resume the request
//!   │ ──the host refused a rewrite (on_rewrite_failed): deny, report `released`──▶ Answered
//!   ▼
//! Dispatched(response watch) ──receipt found──▶ report `completed`, hold the chunk ──▶ Settled
//!   │ (`answer_release: at_once`, `completed` / `accepted`: the report to the root's batch,
//!   │  nothing held ──▶ Settled at once)
//!   └─ on_log without an acknowledged report ──▶ queue completed / released / uncertain
//!
//! ReadingBody ──tools/list with a permit, `tools_list_limits` on──▶ Listing(response watch)
//!   ──answer found: ONE limits callout, the answer held──▶ figures written in ──▶ done
//! ```
//!
//! A GET that resumes the stream of a call an earlier POST dispatched goes from `Start` to
//! `Dispatched` at once ([`crate::call::resume`]).
//!
//! Every answer to a governed call carries the permit's figures the ledger gave
//! ([`crate::call::permit_meta`]): a local reply gets them as it is built, a dispatched call's
//! upstream answer as an edit of its body (JSON or the SSE event), with the headers.
//!
//! With `request_hold: headers` (the default) nothing of a governed call leaves before the
//! decision, so the authorize request names the exact request that will leave and the
//! ledger signs it ([`crate::call::signing`]).
//!
//! With `request_hold: body` ([`crate::call::body_hold`]) a POST's headers go upstream at
//! once from `Start` (without the permit header, `content-length`, or a governed call's key
//! header, which would be derived before the ledger confirmed the permit) and only its body
//! waits in `ReadingBody` and `Authorizing`; a response before the decision leads to
//! `Overtaken`, where the body is held for good and a reserved attempt is released.

pub(super) mod authorizing;
pub(super) mod dispatched;
pub(super) mod listing;
pub(super) mod passing;
pub(super) mod reading_body;
pub(super) mod start;

use authorizing::Authorizing;
use dispatched::Dispatched;
use listing::Listing;
use passing::Forwarding;
use reading_body::ReadingBody;

#[derive(Debug, Clone)]
pub(super) enum Phase {
    Start,
    /// Not governed: passes untouched (permit header already removed).
    Passing,
    /// Not governed, passing with its idempotency key rewritten for upstream.
    Forwarding(Forwarding),
    ReadingBody(Box<ReadingBody>),
    Authorizing(Authorizing),
    Dispatched(Box<Dispatched>),
    /// A `tools/list` passing, its answer watched for the permit's figures.
    Listing(Box<Listing>),
    /// A local reply was sent.
    Answered,
    /// `request_hold: body`: the upstream answered before the decision. The body is held
    /// for good (never sent); the upstream's answer goes to the client.
    Overtaken,
}

atmost_protocol::closed_set! {
    /// The name of each phase, and of each step of a watched response, as tests, the fuzz
    /// target and debug logs read them ([`Call::state_name`](super::Call::state_name)).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum PhaseName {
        Start => "start";
        /// `Passing` and `Forwarding` alike.
        Passing => "passing";
        ReadingBody => "reading_body";
        Authorizing => "authorizing";
        /// Authorizing, held for a person's approval until the ledger is asked again.
        HeldForApproval => "held_for_approval";
        Answered => "answered";
        Overtaken => "overtaken";
        Listing => "listing";
        /// Listing, the limits callout out.
        ListingAsking => "listing_asking";
        /// Dispatched, upstream has not answered yet.
        Dispatched => "dispatched";
        BufferingJson => "buffering_json";
        StreamingSse => "streaming_sse";
        NoReceipt => "no_receipt";
        RefusedAtTool => "refused_at_tool";
        Reporting => "reporting";
        Settled => "settled";
    }
}

impl Phase {
    pub(super) fn name(&self) -> PhaseName {
        match self {
            Phase::Start => PhaseName::Start,
            Phase::Passing | Phase::Forwarding(_) => PhaseName::Passing,
            Phase::ReadingBody(_) => PhaseName::ReadingBody,
            Phase::Authorizing(a) if a.is_held() => PhaseName::HeldForApproval,
            Phase::Authorizing(_) => PhaseName::Authorizing,
            Phase::Answered => PhaseName::Answered,
            Phase::Overtaken => PhaseName::Overtaken,
            Phase::Listing(l) => l.name(),
            Phase::Dispatched(d) => d.name(),
        }
    }

    /// The request goes on upstream as the client sent it, apart from header edits: only
    /// such a request may get the session's credential
    /// ([`crate::call::session_credential`]).
    pub(super) fn lets_request_pass(&self) -> bool {
        match self {
            Phase::Passing | Phase::Forwarding(_) | Phase::Listing(_) => true,
            Phase::Dispatched(d) => d.resumes_unanswered(),
            _ => false,
        }
    }
}
