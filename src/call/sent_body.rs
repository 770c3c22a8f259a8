//! A request body as it goes upstream, its idempotency key members in their upstream form.

use crate::call::Effect;
use crate::parse::key_rewrite;

/// A request body as it goes upstream after the key rewrite.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct SentBody {
    /// Bytes of the body Envoy holds, which `body` replaces.
    original_len: usize,
    pub(super) body: Vec<u8>,
    /// The request announced a `content-length`, which must follow the new size.
    had_content_length: bool,
}

impl SentBody {
    /// `original` with its idempotency key members (`spans`) edited: `value` gets each
    /// member's raw JSON value and returns its upstream form, or `None` to remove it.
    pub(super) fn rewritten(
        original: &[u8],
        spans: &[key_rewrite::MemberSpan],
        had_content_length: bool,
        value: impl FnMut(&[u8]) -> Option<String>,
    ) -> SentBody {
        SentBody {
            original_len: original.len(),
            body: key_rewrite::rewrite_all(original, spans, value),
            had_content_length,
        }
    }

    /// The request edits that put this body in place.
    pub(super) fn effects(self) -> Vec<Effect> {
        let length = self.had_content_length.then(|| {
            Effect::SetRequestHeader("content-length".into(), self.body.len().to_string())
        });
        let mut effects = Vec::with_capacity(2);
        effects.push(Effect::ReplaceRequestBody {
            original_len: self.original_len,
            body: self.body,
        });
        effects.extend(length);
        effects
    }
}
