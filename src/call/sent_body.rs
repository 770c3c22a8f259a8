//! A request body as it goes upstream, its idempotency key members in their upstream form.

use crate::call::Effect;

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
    /// `body` in place of `original`, as
    /// [`rewritten`](crate::parse::key_rewrite::rewritten) made it.
    pub(super) fn new(original: &[u8], body: Vec<u8>, had_content_length: bool) -> SentBody {
        SentBody {
            original_len: original.len(),
            body,
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
