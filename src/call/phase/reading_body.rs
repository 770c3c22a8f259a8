//! `ReadingBody`: a POST's body is buffered whole, then parsed; what the message is decides
//! where the request goes: it passes, its `tools/list` answer is watched (`Listing`), a
//! governed `tools/call` asks the ledger (`Authorizing`), or it is refused.

use super::authorizing::Authorizing;
use super::listing::Listing;
use super::passing::pass;
use super::Phase;
use crate::call::refusal::{bad_request, too_large};
use crate::call::{permit, BodyStep, Context, Effect, Level, RequestHead, Step};
use crate::parse::mcp::{self, Message};
use crate::stats::Stat;
use atmost_config::Config;
use serde_json::Value;

/// The request's head, kept while its body is read.
#[derive(Debug, Clone)]
pub(in crate::call) struct ReadingBody {
    head: RequestHead,
}

impl ReadingBody {
    /// The phase that reads the body of the request with this head.
    pub(in crate::call) fn of(head: RequestHead) -> Phase {
        Phase::ReadingBody(Box::new(ReadingBody { head }))
    }

    /// Part of the body arrived (`size` bytes so far): it is read once whole. Past
    /// `max_body_bytes` it is refused (`Err`), and the request is answered.
    pub(in crate::call) fn on_request_body(
        &self,
        config: &Config,
        size: usize,
        end_of_stream: bool,
    ) -> Result<BodyStep, Step> {
        if size as u64 > config.max_body_bytes {
            Err(too_large(config.max_body_bytes))
        } else if end_of_stream {
            Ok(BodyStep::Read { len: size })
        } else {
            Ok(BodyStep::Done(Step::pause()))
        }
    }

    /// `request_hold: body`: the upstream answered before the body was read, which is
    /// then never sent (the request is `Overtaken`).
    pub(in crate::call) fn on_response_before_decision() -> Step {
        Step::cont()
            .with(Effect::Count(Stat::UpstreamAnsweredEarly))
            .with(Effect::Log(
                Level::Info,
                "atmost: the upstream answered before the request body was read; the body is not sent".into(),
            ))
    }

    /// The whole body, after [`BodyStep::Read`].
    pub(in crate::call) fn on_body(self, cx: &mut Context, body: &[u8]) -> (Phase, Step) {
        let head = self.head;
        let call = match mcp::parse(body, &head.mirrored) {
            Err(reply) => return (Phase::Answered, bad_request(*reply)),
            Ok(Message::Other) => return pass(cx, &head, None, Value::Null, None),
            Ok(Message::KeyedOther(id)) => return pass(cx, &head, Some(body), id, None),
            Ok(Message::ToolsList { id, keyed }) => {
                let (passed, step) = pass(cx, &head, keyed.then_some(body), id.clone(), None);
                // A refused pass (`request_hold: body`) answered it: nothing to watch.
                if !cx.config.tools_list_limits || matches!(passed, Phase::Answered) {
                    return (passed, step);
                }
                // Without a readable permit there is nothing to ask: it passes unchanged.
                return match permit::token(&head.permit, &cx.config.permit_header) {
                    Ok(permit_token) => (Listing::of(id, permit_token), step),
                    Err(_) => (passed, step),
                };
            }
            Ok(Message::ToolCall(call)) => call,
        };
        if !cx.config.governed_tools.contains(&call.name) {
            if let Some(s) = &mut cx.session {
                s.forget_permit();
            }
            let keyed = call.keys.any_field();
            return pass(cx, &head, keyed.then_some(body), call.id, Some(call.name));
        }
        Authorizing::ask(cx, &head, call, body)
    }
}

#[cfg(test)]
mod tests;
