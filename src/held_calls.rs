//! The calls one worker holds open for a person's approval (`approval_hold_ms`), and when
//! each is due to ask the ledger again.
//!
//! Why the root context does the waiting: proxy-wasm gives an HTTP context no timer, and a
//! paused request gets no callback of its own until something happens to it; asking again
//! from the call's own callout answer would be a busy loop against the ledger. The root
//! context already ticks (`report_interval_ms`, at most 1 s when holding is on) for its
//! report queue, so on each tick it looks here and sends, for every call whose wait is over,
//! that call's authorize request again ([`crate::call::Call::reask`]). The callout is the
//! root's, as its report batches are: its answer comes back to the root, which hands it to
//! the call's machine in the call's own context; an answer for a request that ended in the
//! meantime finds no entry and is dropped. Between two asks a held call costs its entry and
//! nothing else: no callout, no callback.
//!
//! Plain Rust, like [`crate::report::Reporter`]: the adapter gives the time and carries out
//! the callouts; `T` is what it needs to reach the call again.

/// Where one held call stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Waiting until this time (Unix ms) to ask again.
    Waiting { due_ms: u64 },
    /// Its authorize request is out again; the token once dispatched.
    Asking { token: Option<u32> },
}

#[derive(Debug)]
struct Entry<T> {
    context_id: u32,
    state: State,
    call: T,
}

/// The held calls of one worker, keyed by their HTTP context.
#[derive(Debug)]
pub struct HeldCalls<T> {
    entries: Vec<Entry<T>>,
}

impl<T> Default for HeldCalls<T> {
    fn default() -> Self {
        HeldCalls {
            entries: Vec::new(),
        }
    }
}

impl<T: Clone> HeldCalls<T> {
    /// The call of `context_id` waits until `due_ms` before the ledger is asked again
    /// (whatever it was doing here before).
    pub fn wait(&mut self, context_id: u32, due_ms: u64, call: T) {
        self.forget(context_id);
        self.entries.push(Entry {
            context_id,
            state: State::Waiting { due_ms },
            call,
        });
    }

    /// The calls whose wait is over at `now_ms`, each now asking: dispatch its authorize
    /// request again and tell [`HeldCalls::sent`] the token, or [`HeldCalls::forget`] it
    /// when the host would not.
    pub fn due(&mut self, now_ms: u64) -> Vec<(u32, T)> {
        let mut due = Vec::new();
        for e in &mut self.entries {
            if matches!(e.state, State::Waiting { due_ms } if due_ms <= now_ms) {
                e.state = State::Asking { token: None };
                due.push((e.context_id, e.call.clone()));
            }
        }
        due
    }

    /// The re-ask of `context_id` went out as callout `token`.
    pub fn sent(&mut self, context_id: u32, token: u32) {
        if let Some(e) = self.entries.iter_mut().find(|e| e.context_id == context_id) {
            e.state = State::Asking { token: Some(token) };
        }
    }

    /// The answer to callout `token`, when it is a held call's re-ask: that call, taken out
    /// of the table (its machine's answer puts it back if it waits again). `None` for any
    /// other callout.
    pub fn answered(&mut self, token: u32) -> Option<(u32, T)> {
        let at = self
            .entries
            .iter()
            .position(|e| e.state == State::Asking { token: Some(token) })?;
        let e = self.entries.swap_remove(at);
        Some((e.context_id, e.call))
    }

    /// The call of `context_id` is held no longer (its request ended, or its re-ask could
    /// not be sent): it is not asked again, and an answer still out for it is dropped.
    pub fn forget(&mut self, context_id: u32) {
        self.entries.retain(|e| e.context_id != context_id);
    }

    /// How many calls are held (waiting or asking).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_is_asked_again_once_its_wait_is_over_and_not_before() {
        let mut held = HeldCalls::default();
        held.wait(7, 1_000, "call-7");
        held.wait(8, 3_000, "call-8");
        assert!(held.due(999).is_empty());
        assert_eq!(held.due(1_000), vec![(7, "call-7")]);
        // Asking: not due again on the next tick, however late.
        assert!(held.due(2_000).is_empty());
        held.sent(7, 41);
        assert_eq!(held.due(3_500), vec![(8, "call-8")]);
        held.sent(8, 42);
        assert!(held.due(u64::MAX).is_empty());
        assert_eq!(held.len(), 2);
        assert_eq!(held.answered(42), Some((8, "call-8")));
        assert_eq!(held.answered(42), None, "an answer is taken once");
        assert_eq!(held.len(), 1);
    }

    #[test]
    fn only_a_re_ask_token_is_a_held_call_s_answer() {
        let mut held = HeldCalls::default();
        held.wait(7, 0, ());
        assert_eq!(held.answered(5), None, "another callout (a report batch)");
        assert_eq!(held.due(0).len(), 1);
        assert_eq!(held.answered(5), None, "not sent yet");
        held.sent(7, 5);
        assert_eq!(held.answered(5), Some((7, ())));
        assert!(held.is_empty());
    }

    #[test]
    fn a_call_waits_again_after_its_answer_and_is_forgotten_when_its_request_ends() {
        let mut held = HeldCalls::default();
        held.wait(7, 0, ());
        held.due(0);
        held.sent(7, 1);
        assert!(held.answered(1).is_some());
        // Still approval_required: the machine waits again.
        held.wait(7, 2_000, ());
        assert_eq!(held.len(), 1);
        assert!(held.due(1_999).is_empty());
        assert_eq!(held.due(2_000).len(), 1);
        held.sent(7, 2);
        // The client went away while the re-ask was out: its answer is dropped.
        held.forget(7);
        assert_eq!(held.answered(2), None);
        assert!(held.is_empty());
    }

    #[test]
    fn waiting_again_replaces_what_the_call_had() {
        let mut held = HeldCalls::default();
        held.wait(7, 5_000, ());
        held.wait(7, 1_000, ());
        assert_eq!(held.len(), 1);
        assert_eq!(held.due(1_000).len(), 1);
    }
}
