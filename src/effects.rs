//! Carrying out a [`Step`] in order, the part of the adapter's work that decides anything:
//! a request edit the host refuses stops the step there. Nothing after it runs (above all
//! no `ResumeRequest`, nor the step's `Continue`, nor its callout); the machine answers
//! [`Call::on_rewrite_failed`] and that step is carried out instead. The adapter
//! implements [`Host`] with proxy-wasm hostcalls; tests implement it with a recorder.

use crate::call::{Call, Effect, Flow, Step};
use crate::ledger::Callout;

/// The host refused a request edit (header or body write).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused;

pub trait Host {
    /// Carries out one effect. Only the request edits (`RemoveRequestHeader`,
    /// `SetRequestHeader`, `ReplaceRequestBody`) may answer [`Refused`]; any other failure
    /// is the host's to log.
    fn effect(&mut self, effect: Effect) -> Result<(), Refused>;
    /// Dispatches a ledger callout; `false` when the host would not.
    fn dispatch(&mut self, callout: &Callout) -> bool;
}

/// Carries out `step` and whatever the machine answers to a refused edit or a callout
/// that could not be dispatched; returns what to give back to Envoy.
pub fn apply(call: &mut Call, step: Step, host: &mut impl Host) -> Flow {
    for effect in step.effects {
        if host.effect(effect).is_err() {
            // The machine is `Answered` after this: its step holds no edit, so this ends.
            let next = call.on_rewrite_failed();
            return apply(call, next, host);
        }
    }
    if let Some(callout) = step.callout {
        if !host.dispatch(&callout) {
            let next = call.on_callout_failed();
            return apply(call, next, host);
        }
    }
    step.flow
}
