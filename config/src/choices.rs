//! The configuration's enumerations, each one table ([`closed_set!`]): the names a field
//! takes, in the order the documentation lists them, the first being the default. The parser
//! reads every one the same way ([`Obj::choice`](crate::reader::Obj)), so a refusal always
//! lists the names the table holds and nothing else can spell them.

use atmost_protocol::closed_set;

/// A configuration field whose value is one name of a closed set.
pub(crate) trait Choice: Copy + Sized + 'static {
    /// Every name, in table order; the first is the default.
    fn names() -> &'static [&'static str];
    /// The row at `index` of [`Choice::names`] (the first when out of range).
    fn row(index: usize) -> Self;
}

/// Implements [`Choice`] for a closed set from its table.
macro_rules! choice {
    ($($set:ident),+ $(,)?) => {$(
        impl Choice for $set {
            fn names() -> &'static [&'static str] {
                &$set::NAMES
            }
            fn row(index: usize) -> Self {
                $set::ALL.get(index).copied().unwrap_or($set::ALL[0])
            }
        }
    )+};
}

closed_set! {
    /// `role`: what one plugin instance is.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Role {
        /// Asks the ledger before a governed call goes out.
        Gateway => "gateway";
        /// In front of a tool server, refuses governed calls without a valid dispatch
        /// signature.
        Verify => "verify";
    }
}

closed_set! {
    /// `request_hold`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum RequestHold {
        /// Hold the whole request, headers included, until the decision.
        Headers => "headers";
        /// Let the headers go at once; hold the body until the decision.
        Body => "body";
    }
}

closed_set! {
    /// `completion_reports`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum CompletionReports {
        Batched => "batched";
        PerCall => "per_call";
    }
}

closed_set! {
    /// `answer_release`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum AnswerRelease {
        /// The answer waits until the ledger has acknowledged its report (or the report could
        /// not be delivered and was queued).
        AfterReceipt => "after_receipt";
        /// The answer goes on as soon as it is whole; its report follows through the root.
        AtOnce => "at_once";
    }
}

closed_set! {
    /// `denial_format`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum DenialFormat {
        Result => "result";
        Error => "error";
    }
}

closed_set! {
    /// `upstream_key.mode`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum UpstreamKeyMode {
        /// The upstream gets lowercase hex `HMAC-SHA256(secret, permit_id + ":" + key)`.
        Hmac => "hmac";
        /// The upstream gets the client's key as sent.
        Raw => "raw";
        /// The `Idempotency-Key` header is removed.
        Off => "off";
    }
}

choice!(
    Role,
    RequestHold,
    CompletionReports,
    AnswerRelease,
    DenialFormat,
    UpstreamKeyMode
);
