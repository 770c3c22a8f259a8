use super::*;
use crate::ledger_client::Endpoint;
use atmost_protocol::{Outcome, OutcomesRequest};

fn report(i: u32) -> OutcomeReport {
    OutcomeReport {
        attempt_id: format!("a{i}"),
        round: 1,
        capability: format!("cap-{i}"),
        outcome: Outcome::Uncertain { reason: "x".into() },
    }
}

/// Ledger timeout 1000 ms, tick 200 ms: a callout is lost after 31 ticks.
fn configured() -> Reporter {
    let mut r = Reporter::new();
    r.configure(1000, 200, 0);
    r
}

const LIMIT: u64 = (1000 + 5000) / 200 + 1;

fn attempts(callout: &Callout) -> Vec<String> {
    assert_eq!(callout.endpoint, Endpoint::Outcomes);
    let req: OutcomesRequest = serde_json::from_slice(&callout.body).unwrap();
    req.reports.into_iter().map(|r| r.attempt_id).collect()
}

fn acks(n: usize) -> LedgerReply {
    LedgerReply {
        status: Some(200),
        body: format!(r#"{{"acks":[{}]}}"#, vec![r#""applied""#; n].join(",")).into_bytes(),
    }
}

fn counts(tasks: &Tasks) -> Vec<Stat> {
    tasks
        .effects
        .iter()
        .filter_map(|e| match e {
            RootEffect::Count(s) => Some(*s),
            _ => None,
        })
        .collect()
}

fn resumed(tasks: &Tasks) -> Vec<u32> {
    tasks
        .effects
        .iter()
        .filter_map(|e| match e {
            RootEffect::Resume(c) => Some(*c),
            _ => None,
        })
        .collect()
}

fn logs(tasks: &Tasks) -> Vec<String> {
    tasks
        .effects
        .iter()
        .filter_map(|e| match e {
            RootEffect::Log(_, m) => Some(m.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn nothing_is_sent_before_configuration() {
    let mut r = Reporter::new();
    assert!(r.enqueue(report(1)).is_empty());
    assert!(r.complete(Some(7), report(2)));
    assert_eq!(r.on_tick(0), Tasks::default());
    assert_eq!(r.on_doorbell(), Tasks::default());
    r.configure(1000, 200, 0);
    let t = r.on_tick(0);
    let sent: Vec<Batch> = t.sends.iter().map(|(b, _)| *b).collect();
    assert_eq!(sent, vec![Batch::Completions, Batch::Reports]);
}

#[test]
fn tick_sends_the_queue_one_batch_at_a_time() {
    let mut r = configured();
    assert_eq!(r.on_tick(0), Tasks::default(), "nothing queued");
    r.enqueue(report(1));
    r.enqueue(report(2));
    let t = r.on_tick(0);
    assert_eq!(t.sends.len(), 1);
    assert_eq!(t.sends[0].0, Batch::Reports);
    assert_eq!(attempts(&t.sends[0].1), vec!["a1", "a2"]);
    r.on_dispatched(Batch::Reports, 11);
    r.enqueue(report(3));
    assert!(r.on_tick(0).sends.is_empty(), "one batch out at a time");
    assert_eq!(
        r.on_callout_reply(99, &acks(2)),
        Tasks::default(),
        "not ours"
    );
    let t = r.on_callout_reply(11, &acks(2));
    assert_eq!(counts(&t), vec![Stat::ReportBatchSent]);
    assert!(t.sends.is_empty(), "the next batch waits for the tick");
    assert_eq!(r.queued(), 1);
    let t = r.on_tick(0);
    assert_eq!(attempts(&t.sends[0].1), vec!["a3"]);
}

#[test]
fn failed_report_batch_stays_queued() {
    let mut r = configured();
    r.enqueue(report(1));
    r.on_tick(0);
    r.on_dispatched(Batch::Reports, 5);
    let t = r.on_callout_reply(5, &LedgerReply::failed());
    assert_eq!(counts(&t), vec![Stat::ReportBatchFailed]);
    assert_eq!(
        logs(&t),
        vec!["atmost: sending 1 outcome reports failed; they stay queued"]
    );
    assert_eq!(r.queued(), 1);
    let t = r.on_tick(0);
    assert_eq!(attempts(&t.sends[0].1), vec!["a1"]);
}

#[test]
fn not_applied_reports_are_logged() {
    let mut r = configured();
    r.enqueue(report(1));
    r.on_tick(0);
    r.on_dispatched(Batch::Reports, 5);
    let reply = LedgerReply {
        status: Some(200),
        body: br#"{"acks":["conflict"]}"#.to_vec(),
    };
    let t = r.on_callout_reply(5, &reply);
    assert_eq!(counts(&t), vec![Stat::ReportBatchSent]);
    assert_eq!(
        logs(&t),
        vec!["atmost: ledger did not apply the report for attempt a1: Conflict"]
    );
    assert_eq!(r.queued(), 0);
}

#[test]
fn a_lost_report_batch_is_requeued_after_the_limit() {
    let mut r = configured();
    r.enqueue(report(1));
    r.on_tick(0);
    r.on_dispatched(Batch::Reports, 5);
    for _ in 0..LIMIT {
        assert_eq!(r.on_tick(0), Tasks::default());
    }
    let t = r.on_tick(0);
    assert_eq!(
        logs(&t),
        vec!["atmost: a batch of outcome reports got no answer; requeued"]
    );
    assert_eq!(t.sends.len(), 1, "sent again on the same tick");
    assert_eq!(attempts(&t.sends[0].1), vec!["a1"]);
    // The late answer to the lost callout is not taken for the new one.
    r.on_dispatched(Batch::Reports, 6);
    assert_eq!(r.on_callout_reply(5, &acks(1)), Tasks::default());
    assert_eq!(
        counts(&r.on_callout_reply(6, &acks(1))),
        vec![Stat::ReportBatchSent]
    );
}

#[test]
fn report_batch_not_dispatched_waits_for_the_next_tick() {
    let mut r = configured();
    r.enqueue(report(1));
    r.on_tick(0);
    let t = r.on_dispatch_failed(Batch::Reports);
    assert_eq!(counts(&t), vec![Stat::ReportBatchFailed]);
    assert!(t.sends.is_empty());
    assert_eq!(r.queued(), 1);
    assert_eq!(r.on_tick(0).sends.len(), 1);
}

#[test]
fn full_queue_drops_the_oldest_and_says_so() {
    let mut r = Reporter::with_queue(ReportQueue::with_limit(1));
    assert!(r.enqueue(report(1)).is_empty());
    let e = r.enqueue(report(2));
    assert_eq!(e[0], RootEffect::Count(Stat::ReportDropped));
    assert!(matches!(&e[1], RootEffect::Log(Level::Error, m) if m.contains("attempt a1")));
}

#[test]
fn doorbell_sends_completions_and_the_answer_resumes_and_sends_the_next() {
    let mut r = configured();
    assert!(r.complete(Some(1), report(1)), "the first report rings");
    assert!(!r.complete(Some(2), report(2)), "a doorbell is on its way");
    let t = r.on_doorbell();
    assert_eq!(t.sends.len(), 1);
    assert_eq!(t.sends[0].0, Batch::Completions);
    assert_eq!(attempts(&t.sends[0].1), vec!["a1", "a2"]);
    r.on_dispatched(Batch::Completions, 3);
    assert!(
        !r.complete(Some(3), report(3)),
        "no ring while a batch is out"
    );
    assert!(r.is_waiting(1) && r.is_waiting(3));
    let t = r.on_callout_reply(3, &acks(2));
    assert_eq!(counts(&t), vec![Stat::ReportBatchSent]);
    assert_eq!(resumed(&t), vec![1, 2]);
    assert!(!r.is_waiting(1) && !r.is_waiting(2));
    assert_eq!(t.sends.len(), 1, "what waited goes out at once");
    assert_eq!(attempts(&t.sends[0].1), vec!["a3"]);
}

#[test]
fn failed_completion_batch_requeues_its_reports_then_resumes() {
    let mut r = configured();
    r.complete(Some(1), report(1));
    r.complete(Some(2), report(2));
    r.on_doorbell();
    r.on_dispatched(Batch::Completions, 3);
    let t = r.on_callout_reply(
        3,
        &LedgerReply {
            status: Some(503),
            body: Vec::new(),
        },
    );
    assert_eq!(
        counts(&t),
        vec![
            Stat::ReportBatchFailed,
            Stat::ReportDeferred,
            Stat::ReportDeferred
        ]
    );
    assert_eq!(
        logs(&t),
        vec!["atmost: batch of 2 completed reports failed (ledger answered HTTP 503); queued for retry"]
    );
    assert_eq!(resumed(&t), vec![1, 2]);
    assert!(
        matches!(t.effects.last(), Some(RootEffect::Resume(2))),
        "resumed last"
    );
    assert_eq!(r.queued(), 2, "in the after-the-fact queue");
    let t = r.on_tick(0);
    assert_eq!(t.sends[0].0, Batch::Reports);
    assert_eq!(attempts(&t.sends[0].1), vec!["a1", "a2"]);
}

/// `answer_release: at_once`: a report whose answer already went on travels the same
/// batch; it resumes nothing, and a failed batch hands it to the queue, which sends it again
/// until the ledger answers.
#[test]
fn an_unheld_completion_report_is_sent_retried_and_resumes_nothing() {
    let mut r = configured();
    assert!(r.complete(None, report(1)), "it rings like a held one");
    let t = r.on_doorbell();
    assert_eq!(attempts(&t.sends[0].1), vec!["a1"]);
    r.on_dispatched(Batch::Completions, 3);
    let failed = LedgerReply {
        status: None,
        body: Vec::new(),
    };
    let t = r.on_callout_reply(3, &failed);
    assert!(resumed(&t).is_empty(), "no response was held: {t:?}");
    assert_eq!(r.queued(), 1);
    let t = r.on_tick(0);
    assert_eq!(t.sends[0].0, Batch::Reports);
    assert_eq!(attempts(&t.sends[0].1), vec!["a1"], "sent again");
    r.on_dispatched(Batch::Reports, 4);
    assert_eq!(
        counts(&r.on_callout_reply(4, &acks(1))),
        vec![Stat::ReportBatchSent]
    );
    assert_eq!(r.queued(), 0, "delivered once, then gone");
    assert!(r.on_tick(0).sends.is_empty());
}

/// `report_ride_ms` 500: a released call's report waits for the next authorize, rides on it,
/// and is delivered by its acks; without them it goes in a batch of its own.
#[test]
fn a_released_report_rides_on_the_next_authorize_and_is_delivered_by_its_acks() {
    let mut r = Reporter::new();
    r.configure(1000, 200, 500);
    assert!(!r.release(1_000, report(1)), "nothing to ring: it waits");
    assert!(r.on_doorbell().sends.is_empty() && r.on_tick(1_100).sends.is_empty());
    assert_eq!(r.board(7).len(), 1);
    assert!(r.is_aboard(7) && r.board(8).is_empty());
    let answer = LedgerReply {
        status: Some(200),
        body: br#"{"decision":"deny","code":"permit_invalid","message":"m","report_acks":["applied"]}"#
            .to_vec(),
    };
    let (effects, ring) = r.landed(7, answer.report_acks());
    assert_eq!(effects, vec![RootEffect::Count(Stat::ReportRode)]);
    assert!(!ring && !r.is_aboard(7));
    assert!(
        r.on_tick(5_000).sends.is_empty(),
        "delivered once, then gone"
    );

    // An answer without acks (a ledger that did not take them) sends them in a batch.
    r.release(6_000, report(2));
    r.release(6_001, report(3));
    r.board(9);
    let bare = LedgerReply {
        status: Some(200),
        body: br#"{"decision":"deny","code":"permit_invalid","message":"m"}"#.to_vec(),
    };
    let (effects, ring) = r.landed(9, bare.report_acks());
    assert!(ring, "the batch's doorbell rings");
    assert!(effects.contains(&RootEffect::Count(Stat::ReportRideMissed)));
    assert!(effects.contains(&RootEffect::Log(
        Level::Warn,
        "atmost: 2 reports riding on an authorize were not taken (ledger acknowledged 0 of 2 reports); sent in a batch".into()
    )));
    let t = r.on_doorbell();
    assert_eq!(attempts(&t.sends[0].1), vec!["a2", "a3"]);
}

#[test]
fn a_report_no_call_takes_leaves_on_the_first_tick_after_report_ride_ms() {
    let mut r = Reporter::new();
    r.configure(1000, 200, 500);
    r.release(1_000, report(1));
    assert!(r.on_tick(1_400).sends.is_empty());
    let t = r.on_tick(1_600);
    assert_eq!(t.sends.len(), 1);
    assert_eq!(attempts(&t.sends[0].1), vec!["a1"]);
    // While that batch is out a new one waits; one leaving anyway takes it along.
    r.on_dispatched(Batch::Completions, 3);
    r.release(1_700, report(2));
    r.complete(Some(5), report(3));
    let t = r.on_callout_reply(3, &acks(1));
    assert_eq!(attempts(&t.sends[0].1), vec!["a3", "a2"]);
    // An authorize that will not be answered leaves its riders to a batch.
    r.on_dispatched(Batch::Completions, 4);
    r.on_callout_reply(4, &acks(2));
    r.release(2_000, report(4));
    r.board(11);
    let (effects, ring) = r.stranded(11);
    assert!(ring && effects.contains(&RootEffect::Count(Stat::ReportRideMissed)));
    assert_eq!(attempts(&r.on_doorbell().sends[0].1), vec!["a4"]);
}

/// A receipt larger than one authorize's riders may carry together goes in a batch at once.
#[test]
fn a_report_too_large_to_ride_joins_the_batch_at_once() {
    let mut r = Reporter::new();
    r.configure(1000, 200, 500);
    let large = OutcomeReport {
        outcome: Outcome::Completed {
            receipt: "x".repeat(atmost_protocol::MAX_RIDING_RECEIPT_BYTES + 1),
        },
        ..report(1)
    };
    assert!(r.release(0, large), "it rings for the batch");
    assert!(r.board(7).is_empty());
    assert_eq!(attempts(&r.on_doorbell().sends[0].1), vec!["a1"]);
}

/// Without `report_ride_ms` a released report joins the batch at once, as before.
#[test]
fn without_riding_a_released_report_rings_for_the_batch() {
    let mut r = configured();
    assert!(r.release(0, report(1)));
    assert!(r.board(1).is_empty());
    assert_eq!(attempts(&r.on_doorbell().sends[0].1), vec!["a1"]);
}

#[test]
fn a_lost_completion_batch_is_given_up_and_its_responses_resumed() {
    let mut r = configured();
    r.complete(Some(1), report(1));
    r.on_doorbell();
    r.on_dispatched(Batch::Completions, 3);
    for _ in 0..LIMIT {
        assert!(resumed(&r.on_tick(0)).is_empty());
    }
    let t = r.on_tick(0);
    assert_eq!(resumed(&t), vec![1]);
    assert!(logs(&t)[0].contains("(no answer)"), "{:?}", logs(&t));
    assert_eq!(
        t.sends[0].0,
        Batch::Reports,
        "the report goes the after-the-fact way"
    );
    assert_eq!(
        r.on_callout_reply(3, &acks(1)),
        Tasks::default(),
        "late answer"
    );
}

#[test]
fn the_tick_sends_completions_a_doorbell_could_not_announce() {
    let mut r = configured();
    assert!(r.complete(Some(1), report(1)));
    r.doorbell_failed();
    let t = r.on_tick(0);
    assert_eq!(t.sends.len(), 1);
    assert_eq!(t.sends[0].0, Batch::Completions);
    // Answered: the next report rings again.
    r.on_dispatched(Batch::Completions, 4);
    r.on_callout_reply(4, &acks(1));
    assert!(r.complete(Some(2), report(2)));
}

#[test]
fn a_completion_report_rings_the_doorbell_only_when_the_root_must_wake() {
    let r = RefCell::new(configured());
    let rings = std::cell::Cell::new(0);
    let ring = |rang: bool| {
        rings.set(rings.get() + 1);
        rang
    };
    complete(&r, Some(1), report(1), || ring(true));
    assert_eq!(rings.get(), 1);
    // A doorbell is on its way: the next report does not ring.
    complete(&r, Some(2), report(2), || ring(true));
    assert_eq!(rings.get(), 1);
    assert!(r.borrow().is_waiting(1) && r.borrow().is_waiting(2));
    let t = r.borrow_mut().on_doorbell();
    assert_eq!(t.sends.len(), 1);
    r.borrow_mut().on_dispatched(Batch::Completions, 4);
    r.borrow_mut().on_callout_reply(4, &acks(2));
    // A doorbell that did not ring: the tick sends the report instead.
    complete(&r, Some(3), report(3), || ring(false));
    assert_eq!(rings.get(), 2);
    let t = r.borrow_mut().on_tick(0);
    assert_eq!(t.sends.len(), 1);
    assert_eq!(t.sends[0].0, Batch::Completions);
}

#[test]
fn each_doorbell_queue_name_carries_its_random_bits() {
    let name = doorbell_queue_name([0xab; 16]);
    assert_eq!(name, format!("atmost.completions.{}", "ab".repeat(16)));
    assert_eq!(
        doorbell_queue_name(*b"\x00\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c\x0d\x0e\xff"),
        "atmost.completions.000102030405060708090a0b0c0d0eff"
    );
}

/// Records effects; refuses the first `refuse` dispatches.
struct Recorder {
    effects: Vec<RootEffect>,
    dispatched: Vec<Vec<String>>,
    refuse: usize,
    next_token: u32,
}

impl Recorder {
    fn refusing(refuse: usize) -> Recorder {
        Recorder {
            effects: Vec::new(),
            dispatched: Vec::new(),
            refuse,
            next_token: 100,
        }
    }
}

impl RootHost for Recorder {
    fn effect(&mut self, effect: RootEffect) {
        self.effects.push(effect);
    }

    fn dispatch(&mut self, callout: &Callout) -> Option<u32> {
        if self.refuse > 0 {
            self.refuse -= 1;
            return None;
        }
        self.dispatched.push(attempts(callout));
        self.next_token += 1;
        Some(self.next_token)
    }
}

#[test]
fn apply_hands_tokens_back_so_answers_are_recognised() {
    let r = RefCell::new(configured());
    r.borrow_mut().enqueue(report(1));
    let mut host = Recorder::refusing(0);
    let t = r.borrow_mut().on_tick(0);
    apply(&r, t, &mut host);
    assert_eq!(host.dispatched, vec![vec!["a1".to_string()]]);
    let t = r.borrow_mut().on_callout_reply(101, &acks(1));
    assert_eq!(counts(&t), vec![Stat::ReportBatchSent]);
}

#[test]
fn apply_finishes_undispatchable_completion_batches_until_none_wait() {
    let r = RefCell::new(configured());
    for i in 0..250 {
        r.borrow_mut().complete(Some(i), report(i));
    }
    let mut host = Recorder::refusing(usize::MAX);
    let t = r.borrow_mut().on_doorbell();
    apply(&r, t, &mut host);
    let resumed: Vec<u32> = host
        .effects
        .iter()
        .filter_map(|e| match e {
            RootEffect::Resume(c) => Some(*c),
            _ => None,
        })
        .collect();
    assert_eq!(
        resumed,
        (0..250).collect::<Vec<u32>>(),
        "every held response goes on"
    );
    let failed = host
        .effects
        .iter()
        .filter(|e| **e == RootEffect::Count(Stat::ReportBatchFailed))
        .count();
    assert_eq!(failed, 3, "three batches of at most 100");
    assert_eq!(r.borrow().queued(), 250);
    assert!(!r.borrow().is_waiting(0));
    // Dispatch works again: the tick sends the queue.
    let mut host = Recorder::refusing(0);
    let t = r.borrow_mut().on_tick(0);
    apply(&r, t, &mut host);
    assert_eq!(host.dispatched.len(), 1);
    assert_eq!(host.dispatched[0].len(), 100);
}

#[test]
fn apply_after_one_refused_completion_dispatch_sends_the_rest() {
    let r = RefCell::new(configured());
    for i in 0..150 {
        r.borrow_mut().complete(Some(i), report(i));
    }
    let mut host = Recorder::refusing(1);
    let t = r.borrow_mut().on_doorbell();
    apply(&r, t, &mut host);
    assert_eq!(host.dispatched.len(), 1);
    assert_eq!(host.dispatched[0].len(), 50);
    assert!(r.borrow().is_waiting(120) && !r.borrow().is_waiting(10));
    let t = r.borrow_mut().on_callout_reply(101, &acks(50));
    assert_eq!(resumed(&t), (100..150).collect::<Vec<u32>>());
}

/// A batch keeps to its count and to its bytes of receipts, and always takes its first
/// report: a batch past the ledger's body limit would be refused every time it went, and
/// the reports behind it with it.
#[test]
fn a_batch_keeps_to_its_receipts_bytes_and_always_takes_its_first() {
    let sized = |i: u32, bytes: usize| OutcomeReport {
        outcome: Outcome::Completed {
            receipt: "x".repeat(bytes),
        },
        ..report(i)
    };
    const MIB: usize = 1 << 20;
    let reports: Vec<OutcomeReport> = [3 * MIB, MIB, 10 * MIB, 1]
        .iter()
        .zip(1..)
        .map(|(b, i)| sized(i, *b))
        .collect();
    let max = atmost_protocol::MAX_BATCH_RECEIPT_BYTES;
    assert_eq!(batch_len(reports.iter(), 100, max), 2, "3 + 1 MiB fit in 4");
    assert_eq!(
        batch_len(reports[2..].iter(), 100, max),
        1,
        "10 MiB goes alone"
    );
    assert_eq!(batch_len(reports[3..].iter(), 100, max), 1);
    assert_eq!(batch_len(std::iter::empty(), 100, max), 0);
    let small: Vec<OutcomeReport> = (0..150).map(report).collect();
    assert_eq!(batch_len(small.iter(), 100, max), 100);
    // The queue sends them so: the 10 MiB report in a batch of its own.
    let mut r = configured();
    for report in reports {
        r.enqueue(report);
    }
    let sent: Vec<Vec<String>> = (0..3)
        .map(|token| {
            let t = r.on_tick(0);
            r.on_dispatched(Batch::Reports, token);
            r.on_callout_reply(token, &acks(attempts(&t.sends[0].1).len()));
            attempts(&t.sends[0].1)
        })
        .collect();
    assert_eq!(sent, [vec!["a1", "a2"], vec!["a3"], vec!["a4"]]);
}
