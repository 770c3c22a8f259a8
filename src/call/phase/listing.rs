//! `Listing`: a `tools/list` passes, and its answer is watched (`tools_list_limits`). Once
//! the answer is found, the governed tools it lists are asked about in ONE limits callout,
//! the answer held until the ledger answers, and the figures are written into it.

use super::{Phase, PhaseName};
use crate::call::permit_meta::{self, TextAt};
use crate::call::receipt::{SseCapture, SseProgress};
use crate::call::refusal::rewrite_failed;
use crate::call::{usize_of, BodyStep, Effect, Flow, Level, ResponseHead, Step};
use crate::ledger_client::{Callout, LedgerReply};
use crate::stats::Stat;
use atmost_config::Config;
use atmost_protocol::{LimitsRequest, LimitsResponse, MAX_LIMITS_TOOLS};
use serde_json::Value;

/// A `tools/list` whose answer may gain the permit's figures (`tools_list_limits`).
#[derive(Debug, Clone)]
pub(in crate::call) struct Listing {
    id: Value,
    permit_token: String,
    watch: ListWatch,
}

#[derive(Debug, Clone)]
pub(in crate::call) enum ListWatch {
    AwaitingHeaders,
    /// `application/json`: buffering the body.
    BufferingJson {
        size: usize,
    },
    /// `text/event-stream`: looking for the answer's event.
    StreamingSse(Box<SseCapture>),
    /// The limits callout is out; Envoy holds these bytes, where the answer's text is.
    Asking(Box<(Vec<u8>, TextAt)>),
    /// Nothing (more) to do.
    Done,
}

impl Listing {
    /// The `tools/list` with this id, under the permit `permit_token`.
    pub(super) fn of(id: Value, permit_token: String) -> Phase {
        Phase::Listing(Box::new(Listing {
            id,
            permit_token,
            watch: ListWatch::AwaitingHeaders,
        }))
    }

    /// The phase's name: whether the limits callout is out.
    pub(super) fn name(&self) -> PhaseName {
        match self.watch {
            ListWatch::Asking(_) => PhaseName::ListingAsking,
            _ => PhaseName::Listing,
        }
    }

    /// Upstream has not answered yet.
    pub(in crate::call) fn awaits_response_headers(&self) -> bool {
        matches!(self.watch, ListWatch::AwaitingHeaders)
    }

    /// The host refused a request edit: the `tools/list` is refused.
    pub(in crate::call) fn on_rewrite_failed(self) -> Step {
        rewrite_failed(Some(&self.id))
    }

    /// The upstream's response headers: how its body is watched for the answer.
    pub(in crate::call) fn on_response_headers(
        &mut self,
        config: &Config,
        head: &ResponseHead,
    ) -> Step {
        if !self.awaits_response_headers() {
            return Step::cont();
        }
        let kind = head.body_kind();
        let max = usize_of(config.max_receipt_bytes);
        self.watch = match kind {
            Some(true) => ListWatch::BufferingJson { size: 0 },
            Some(false) => ListWatch::StreamingSse(Box::new(SseCapture::new(self.id.clone(), max))),
            None => ListWatch::Done,
        };
        // The body will grow by the figures: its length is Envoy's to frame.
        Step::cont().with_all(kind.map(|_| Effect::RemoveResponseHeader("content-length".into())))
    }

    /// The host refused a response edit: the answer goes on as it is.
    pub(in crate::call) fn on_response_edit_refused(&mut self) {
        if let ListWatch::StreamingSse(cap) = &mut self.watch {
            cap.stop_holding();
        }
        if !matches!(self.watch, ListWatch::Asking(_)) {
            self.watch = ListWatch::Done;
        }
    }

    /// Part of the response body arrived (`size` bytes so far): JSON is read once whole
    /// (up to `max` bytes, or left unchanged), each SSE chunk as it comes.
    pub(in crate::call) fn on_response_body(
        &mut self,
        max: u64,
        size: usize,
        end_of_stream: bool,
    ) -> BodyStep {
        match &mut self.watch {
            ListWatch::BufferingJson { size: seen } => {
                if size as u64 > max {
                    self.watch = ListWatch::Done;
                    BodyStep::Done(Step::cont())
                } else if end_of_stream {
                    BodyStep::Read { len: size }
                } else {
                    *seen = size;
                    BodyStep::Done(Step::pause())
                }
            }
            ListWatch::StreamingSse(_) => BodyStep::Read { len: size },
            ListWatch::Asking(_) => BodyStep::Done(Step::pause()),
            ListWatch::AwaitingHeaders | ListWatch::Done => BodyStep::Done(Step::cont()),
        }
    }

    /// Trailers end the stream: a watched body is read as at its end.
    pub(in crate::call) fn on_response_trailers(&self) -> BodyStep {
        match &self.watch {
            ListWatch::BufferingJson { size } => BodyStep::Read { len: *size },
            ListWatch::StreamingSse(cap) => BodyStep::Read { len: cap.held() },
            ListWatch::Asking(_) => BodyStep::Done(Step::pause()),
            _ => BodyStep::Done(Step::cont()),
        }
    }

    /// Response bytes after [`BodyStep::Read`]: once the answer is found, ONE limits
    /// callout for the governed tools it lists.
    pub(in crate::call) fn on_response_body_data(
        &mut self,
        config: &Config,
        bytes: &[u8],
        end_of_stream: bool,
    ) -> Step {
        let (body, at) = match &mut self.watch {
            ListWatch::BufferingJson { .. } => {
                // Only a body that is JSON is edited.
                if serde_json::from_slice::<Value>(bytes).is_err() {
                    self.watch = ListWatch::Done;
                    return Step::cont();
                }
                (bytes.to_vec(), TextAt::Whole)
            }
            ListWatch::StreamingSse(cap) => {
                let passed = cap.pass(bytes, end_of_stream);
                match (passed.progress, passed.found) {
                    (SseProgress::Found(_), Some((event, base))) => {
                        (bytes.to_vec(), TextAt::Event(event, base))
                    }
                    (SseProgress::Pending, _) if passed.hold => return Step::pause(),
                    (SseProgress::Pending, _) if !end_of_stream => return Step::cont(),
                    _ => {
                        self.watch = ListWatch::Done;
                        return Step::cont();
                    }
                }
            }
            _ => return Step::cont(),
        };
        let mut tools = permit_meta::listed_tools(at.text(&body), &self.id, |t| {
            config.governed_tools.contains(t)
        });
        tools.truncate(MAX_LIMITS_TOOLS);
        if tools.is_empty() {
            self.watch = ListWatch::Done;
            return Step::cont();
        }
        let callout = Callout::limits(&LimitsRequest {
            permit_token: self.permit_token.clone(),
            tools,
        });
        self.watch = ListWatch::Asking(Box::new((body, at)));
        Step {
            flow: Flow::Pause,
            effects: Vec::new(),
            callout: Some(callout),
        }
    }

    /// The ledger's answer to the limits callout: the held answer gains the figures of each
    /// governed tool it lists, or goes on unchanged.
    pub(in crate::call) fn on_limits_reply(&mut self, reply: &LedgerReply) -> Step {
        let ListWatch::Asking(held) = std::mem::replace(&mut self.watch, ListWatch::Done) else {
            return Step::cont();
        };
        let (body, at) = *held;
        let step = match reply.limits() {
            Ok(LimitsResponse { tools }) => {
                let edits = permit_meta::tools_list_edits(at.text(&body), &self.id, &tools);
                let edited = at
                    .edited(&body, &edits)
                    .map(|new| Effect::ReplaceResponseBody {
                        original_len: body.len(),
                        body: new,
                    });
                Step::cont()
                    .with_all(edited)
                    .with(Effect::Count(Stat::ToolsListFigures))
            }
            // The ledger does not authenticate the permit: nothing to show.
            Err(e) if e.is_permit_invalid() => unchanged(Level::Info, "permit_invalid"),
            Err(e) => unchanged(Level::Warn, &e.to_string()),
        };
        step.with(Effect::ResumeResponse)
    }

    /// The limits callout could not be dispatched: still in the body callback, going on
    /// releases the held answer.
    pub(in crate::call) fn on_callout_failed(&mut self) -> Step {
        if !matches!(self.watch, ListWatch::Asking(_)) {
            return Step::cont();
        }
        self.watch = ListWatch::Done;
        unchanged(Level::Warn, "could not dispatch the limits callout")
    }
}

/// A `tools/list` answer goes on without figures, for `why`.
fn unchanged(level: Level, why: &str) -> Step {
    Step::cont()
        .with(Effect::Count(Stat::ToolsListUnchanged))
        .with(Effect::Log(
            level,
            format!("atmost: tools/list answer passes without the permit's figures: {why}"),
        ))
}

#[cfg(test)]
mod tests;
