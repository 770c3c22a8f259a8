/*
 * atmost: the filter <-> ledger protocol (rounds and capabilities), as a Promela model.
 * Checked by spin under every interleaving: `make model-check` (ledger/model/check.sh).
 *
 * What runs here, and the code each part stands for:
 *   Filter (x FILTERS)  src/call.rs, the per-request state machine: one authorize callout,
 *                       then the call is resumed upstream or not; src/outcome.rs `classify`
 *                       picks released (never reached the upstream) or uncertain (sent,
 *                       outcome unknown); completed / input_required when the response was
 *                       captured.
 *   pend (reports)      src/reports.rs `ReportQueue`, src/completions.rs and the root
 *                       context's tick (src/adapter/root.rs): reports wait, are retried
 *                       (so a batch whose answer was lost arrives twice), are dropped past
 *                       the queue's limit or with the VM; the ledger takes them in any order.
 *   Replica (x 2)       two ledger processes over ONE store (ledger/src/store/): every
 *                       decision is one transaction (SQLite BEGIN IMMEDIATE, PostgreSQL
 *                       SELECT ... FOR UPDATE of the permit row), here one d_step.
 *     decide            ledger/src/decide.rs `decide` (authorize) plus the reservation;
 *                       ledger/src/decide/approval.rs `approval_needed` (rule 4.8: a new
 *                       call that needs a person is reserved as awaiting_approval, nothing
 *                       sent) and `by_approval` (rule 3's rows for the approval states: an
 *                       approved attempt is dispatched once, in the same transaction).
 *     apply_report      ledger/src/decide/reports.rs `apply_outcome` with the round and
 *                       capability rules.
 *     EXPIRE            ledger/src/decide/settle.rs `expire_lease`, the sweeper (any lease
 *                       may run out at any moment: time is abstracted away).
 *     RESOLVE           ledger/src/decide/settle.rs `resolve` (admin API / reconciler).
 *     DECIDE_APPROVAL   ledger/src/decide/approval.rs `decide_approval`: a person approves
 *                       or rejects a request waiting for approval, at any moment.
 *     EXPIRE_APPROVAL   `expire_lease` again: a request nobody decided, or an approval
 *                       nobody used, lapses at any moment.
 *   Upstream            the MCP server. It records executions: this is what "executed" means.
 *   Attacker            the agent turned against its owner: it holds the permit token and
 *                       the filter's service token, so it calls authorize directly and posts
 *                       reports with any round and any capability it was given.
 *
 * Properties (assertions, checked in every reachable state where they can change):
 *   (P1) per permit and tool: attempts that reached the upstream, minus those proven never
 *        executed (resolved_not_executed), never exceed N; so executions never exceed N.
 *   (P2) per idempotency key: at most one execution at the upstream, across every round of
 *        an attempt and every attempt under the key.
 *   (P3) no attempt is released (slot given back automatically) once any of its rounds
 *        reached the upstream.
 *   (P4) a rejection or an expiry of an approval gives the slot back only while nothing of
 *        the attempt was sent: no round of it reached the upstream or is on its way there.
 *   (S)  the slot counter equals the number of attempts in a slot-holding state, and never
 *        exceeds N (the store's own consistency; a failure here is a model error).
 *
 * Switches that break the ledger on purpose; each must yield a counterexample:
 *   -DNO_ROUND_CHECK        a report is applied whatever round it names (the released rule
 *                           then reads the report's round).
 *   -DNO_CAPABILITY_CHECK   a report is applied whatever capability it shows.
 *   -DNO_ATOMIC_RESERVE     the cap is read in one transaction and the slot reserved in
 *                           another (two replicas can both pass a cap of 1).
 *   -DNO_VERSION_CHECK      (with -DVERSIONED_WRITE) the decision is written whatever the
 *                           permit's version has become since it was read: the same
 *                           counterexample as NO_ATOMIC_RESERVE.
 *   -DAPPROVAL_REUSABLE     the approval is not consumed by its dispatch: a retry of the
 *                           approved key while that dispatch is in flight is dispatched
 *                           again, so the key executes twice (P2).
 *
 * A variant checked as the real model is, against the same properties:
 *   -DVERSIONED_WRITE       PostgreSQL's one-statement decision
 *                           (docs/postgresql.md#one-statement-per-decision): a
 *                           replica reads what a decision needs about the permit (whether the
 *                           cap leaves a slot, and the permit's version) in one step, decides,
 *                           and writes in another step only if the version is still the one
 *                           it read; a reservation (a request for approval included) bumps
 *                           the version, reports, resolutions, rejections and expiries
 *                           (which only give slots back) do not, nor do a person's approval
 *                           and its dispatch (no slot moves); a write whose version moved
 *                           is decided again under the permit's lock. The PostgreSQL store
 *                           takes this path (ledger/src/store/postgres/one_statement.rs),
 *                           with a version per tool's slot counter: with one governed tool,
 *                           the permit's version here.
 *
 * Bounds (exhaustive within them): one permit, one governed tool, cap N = 1, two keys,
 * at most MAXA attempts and MAXR rounds per attempt, CALLS gateway calls made by FILTERS
 * concurrent filters, ATT_STEPS attacker actions that change the store (a request for
 * approval is not counted: it is answered with a denial), DUPS duplicate report
 * deliveries, one approval request per run (the permit's first call, if made with key 0;
 * every other call needs none: see NEEDS_APPROVAL). Fingerprints always match (a mismatch
 * is a plain denial), budget and expiry are left out (they only deny more), completed and
 * accepted are one state.
 */

#define N          1
#define KEYS       2
#ifndef MAXA
#define MAXA       3
#endif
#define ROWS       4          /* array sizes; MAXA <= ROWS bounds how many are used */
#define MAXR       3
#define FILTERS    2
#ifndef CALLS
#define CALLS      3          /* gateway calls in all, shared by the filters */
#endif
#ifndef ATT_STEPS
#define ATT_STEPS  2
#endif
#ifndef DUPS
#define DUPS       1
#endif

#define NONE       255
#define ATTACKER   FILTERS      /* caller id of the attacker's direct authorize calls */

/* Attempt states (protocol AttemptState). Accepted (a task handle) behaves as completed. */
#define S_FREE        0
#define S_INFLIGHT    1
#define S_AWAIT       2
#define S_DONE        3
#define S_UNCERTAIN   4
#define S_RELEASED    5
#define S_RES_EXEC    6
#define S_RES_NOT     7
#define S_APPR_WAIT   8       /* awaiting_approval: reserved, no round yet, nothing sent */
#define S_APPROVED    9
#define S_APPR_REJ    10      /* approval_rejected */
#define S_APPR_EXP    11      /* approval_expired */

#define HOLDS_SLOT(s) ((s) == S_INFLIGHT || (s) == S_AWAIT || (s) == S_DONE || (s) == S_UNCERTAIN || (s) == S_RES_EXEC || \
                       (s) == S_APPR_WAIT || (s) == S_APPROVED)
#define LEASED(s)     ((s) == S_INFLIGHT || (s) == S_AWAIT)

/* Outcomes named by a report; the upstream answers with O_DONE, O_INPUT or NO_ANSWER. */
#define NO_ANSWER     0
#define O_DONE        1
#define O_INPUT       2
#define O_UNCERTAIN   3
#define O_RELEASED    4

/* Authorize answers. */
#define A_DISPATCH    1
#define A_DENY        2
#define A_REPLAY      3

/*
 * A capability is minted fresh for every Dispatch and replaces the previous one, so the
 * capability of attempt a's round r is one unique value, CAP(a, r); 0 is never minted
 * (a guess). The ledger keeps only the current round's, which is CAP(a, aRound[a]).
 */
#define CAP(a, r)     ((a) * MAXR + (r))

/* ---------------- the store (one, shared by both replicas) ---------------- */
byte aKey[ROWS];
byte aState[ROWS];
byte aRound[ROWS];
byte nA = 0;                 /* attempt ids handed out */
byte calls = 0;              /* gateway calls made */
byte keyAtt[KEYS];           /* the key's latest attempt, NONE if none */
byte slots = 0;              /* slots held for the tool (the permit's counter row) */

/* ---------------- ghosts: what really happened, for the properties ---------------- */
bool reached[ROWS];          /* some round of the attempt reached the upstream */
bool live[ROWS];             /* a round dispatched to the gateway is not finished yet */
bool execA[ROWS];            /* the upstream executed the attempt */
byte execKey[KEYS];          /* executions under the key, over all its attempts */
byte execTotal = 0;
byte upAttempts = 0;         /* attempts that reached the upstream */
byte notExec = 0;            /* of those, resolved_not_executed */
short known = 0;             /* capabilities the attacker was given, bit CAP(a, r) */

/*
 * The report channel (src/reports.rs, src/completions.rs, src/adapter/root.rs): a report
 * waits in the VM's queue until a tick sends it; a batch whose answer was lost is sent
 * again (a duplicate); the ledger gets them in any order (delay); the queue drops the
 * oldest past its limit and a dying VM drops them all (loss). pend[CAP(a, r) - 1] holds
 * the outcome the filter reported for attempt a's round r (0: none waiting): one filter
 * makes at most one report per round, so a bag of these is all the channel can hold.
 */
#define NPEND (ROWS * MAXR)
byte pend[NPEND];
byte dups = 0;

/*
 * Authorize callouts. A filter's callout waits in req for a ledger replica; either replica
 * answers it (in ansOf/ansAtt/ansRound), in one transaction, and keeps nothing between
 * requests. The key and the continuation flag are the agent's choice; nothing reads them
 * before the ledger does, so the model draws them when the replica reads the request.
 * Caller ids: the filters 0 .. FILTERS-1, and the attacker calling the ledger directly.
 */
bool req[FILTERS + 1];
byte ansOf[FILTERS + 1];
byte ansAtt[FILTERS + 1];
byte ansRound[FILTERS + 1];
#if defined(NO_ATOMIC_RESERVE) || defined(VERSIONED_WRITE)
bool read[FILTERS + 1];       /* the cap was read, in a transaction of its own */
bool room[FILTERS + 1];
#endif
#ifdef VERSIONED_WRITE
byte ver = 0;                 /* the permit's version: every reservation bumps it */
byte readVer[FILTERS + 1];    /* the version a replica read with the cap */
#define BUMP_VERSION ver++
#else
#define BUMP_VERSION skip
#endif

/* A round sent upstream, waiting for the MCP server's answer. */
byte upAtt[FILTERS];          /* attempt + 1; 0: nothing sent */
byte upAns[FILTERS];          /* 0: no answer yet */

/* (S) the counter the stores keep (ledger/src/decide/counters.rs counter_delta) matches the rows. */
#define HOLDS(i)  (i < nA && HOLDS_SLOT(aState[i]))
#define CHECK_SLOTS() assert(HOLDS(0) + HOLDS(1) + HOLDS(2) + HOLDS(3) == slots && slots <= N)

/*
 * approval_needed (ledger/src/decide/approval.rs, rule 4.8): whether a new call must wait for
 * a person. The permit's rule decides it from the tool and the call's cost, which the model
 * does not have; it bounds approvals to one request per run instead: the permit's first
 * call, when it is made with key 0. The keys are interchangeable everywhere else, so every
 * run without an approval is still checked, with the keys swapped.
 */
#define NEEDS_APPROVAL(k) ((k) == 0 && nA == 0)

/*
 * APPROVAL_REUSABLE: the approval is not consumed by its dispatch. The attempt keeps the
 * decision (its `approval` record), and the rule reads that record before the attempt's
 * state, so a retry of the key while its dispatch is in flight is dispatched again, in a
 * new round with its own capability, instead of idempotency_in_progress.
 */
#ifdef APPROVAL_REUSABLE
bool aApproved[ROWS];        /* the attempt's approval record says approved */
#define REUSED(a) (a != NONE && aApproved[a] && aState[a] == S_INFLIGHT && aRound[a] < MAXR)
#define RECORD_APPROVAL(i) aApproved[i] = true
#else
#define REUSED(a) false
#define RECORD_APPROVAL(i) skip
#endif

/*
 * decide (ledger/src/decide.rs `decide`): the authorize decision and the reservation, one
 * transaction. Answers caller c asking for key k (cont: a continuation). `fits` is whether
 * the cap leaves a slot, read in the same transaction (NO_ATOMIC_RESERVE: an earlier one).
 */
inline decide(c, k, cont, fits) {
    a = keyAtt[k];
    if
    :: a != NONE && (aState[a] == S_DONE || aState[a] == S_RES_EXEC) -> ansOf[c] = A_REPLAY
    :: a != NONE && aState[a] == S_INFLIGHT && !REUSED(a) -> ansOf[c] = A_DENY /* idempotency_in_progress */
#ifdef APPROVAL_REUSABLE
    :: REUSED(a) -> aRound[a]++; ansOf[c] = A_DISPATCH   /* the approval dispatches again */
#endif
    :: a != NONE && aState[a] == S_AWAIT && cont && aRound[a] < MAXR ->
        /* the same call continued: same attempt, next round, no new slot */
        aRound[a]++; aState[a] = S_INFLIGHT; ansOf[c] = A_DISPATCH
    :: a != NONE && aState[a] == S_AWAIT && cont && aRound[a] == MAXR -> ansOf[c] = A_DENY /* model bound */
    :: a != NONE && aState[a] == S_AWAIT && !cont -> ansOf[c] = A_DENY  /* awaiting input */
    :: a != NONE && aState[a] == S_UNCERTAIN -> ansOf[c] = A_DENY    /* delivery_uncertain */
    /* by_approval (ledger/src/decide/approval.rs, rule 3's rows for the approval states) */
    :: a != NONE && aState[a] == S_APPROVED ->
        /* the approval's one dispatch: round 1 and its capability, no new slot (it holds
           one), even at the cap; the same transaction consumes the approval */
        aRound[a] = 1; aState[a] = S_INFLIGHT; ansOf[c] = A_DISPATCH
    :: a != NONE && aState[a] == S_APPR_WAIT -> ansOf[c] = A_DENY    /* approval_required */
    :: a != NONE && aState[a] == S_APPR_REJ -> ansOf[c] = A_DENY     /* approval_rejected */
    :: a != NONE && aState[a] == S_APPR_EXP -> ansOf[c] = A_DENY     /* approval_expired */
    :: a == NONE || aState[a] == S_RELEASED || aState[a] == S_RES_NOT ->
        /* a new call (or a key given back): check the cap, reserve, then dispatch round 1
           or, if it needs a person, hold the slot while one decides */
        if
        :: !(fits) -> ansOf[c] = A_DENY                               /* permit_max_calls_exceeded */
        :: (fits) && nA == MAXA -> ansOf[c] = A_DENY                  /* model bound */
        :: (fits) && nA < MAXA && NEEDS_APPROVAL(k) ->
            /* approval_needed: the slot is held while a person decides; nothing is sent */
            a = nA; nA++;
            aKey[a] = k; aState[a] = S_APPR_WAIT; aRound[a] = 0;
            keyAtt[k] = a; slots++; BUMP_VERSION;
            ansOf[c] = A_DENY                                          /* approval_required */
        :: (fits) && nA < MAXA && !NEEDS_APPROVAL(k) ->
            a = nA; nA++;
            aKey[a] = k; aState[a] = S_INFLIGHT; aRound[a] = 1;
            keyAtt[k] = a; slots++; BUMP_VERSION;
            ansOf[c] = A_DISPATCH
        fi
    fi;
    if
    :: ansOf[c] == A_DISPATCH ->
        ansAtt[c] = a; ansRound[c] = aRound[a];
        /* the capability goes to the caller only */
        if
        :: c == ATTACKER -> known = known | (1 << CAP(a, aRound[a]))
        :: else -> live[a] = true
        fi
    :: else
    fi;
    req[c] = false; a = 0;
    CHECK_SLOTS()
}

/*
 * apply_report (ledger/src/decide/reports.rs `apply_outcome` and the report handler): unknown
 * attempt -> ignored; round ahead or wrong capability -> refused (counted); round behind
 * -> stale; current round and in_flight -> applied; current round otherwise -> no change.
 */
#ifdef NO_ROUND_CHECK
#define ROUND_OK(ra, rr)  true
#else
#define ROUND_OK(ra, rr)  (rr == aRound[ra])
#endif
#ifdef NO_CAPABILITY_CHECK
#define CAP_OK(ra, rc)    true
#else
#define CAP_OK(ra, rc)    (rc == CAP(ra, aRound[ra]))
#endif

#define APPLIES(ra, rr, rc) (ra < nA && ROUND_OK(ra, rr) && CAP_OK(ra, rc) && aState[ra] == S_INFLIGHT)

inline apply_report(ra, rr, rc, ro) {
    if
    :: APPLIES(ra, rr, rc) ->
        if
        :: ro == O_DONE -> aState[ra] = S_DONE
        :: ro == O_INPUT -> aState[ra] = S_AWAIT                       /* lease renewed */
        :: ro == O_UNCERTAIN -> aState[ra] = S_UNCERTAIN
        :: ro == O_RELEASED && rr == 1 ->
            /* (P3) the slot goes back only for a first round that never left */
            assert(!reached[ra]);
            aState[ra] = S_RELEASED; slots--
        :: ro == O_RELEASED && rr != 1 ->
            /* a continuation that never left: back to where the round started */
            aState[ra] = S_AWAIT
        fi
    :: else -> skip
    fi;
    CHECK_SLOTS()
}

/* One delivery of the report waiting for round i: taken, or (DUPS times) kept for later. */
#define DELIVER(i) \
    :: d_step { pend[i] != 0 -> apply_report(i / MAXR, i % MAXR + 1, i + 1, pend[i]); pend[i] = 0 } \
    :: d_step { pend[i] != 0 && dups < DUPS -> dups++; apply_report(i / MAXR, i % MAXR + 1, i + 1, pend[i]) }

#if defined(VERSIONED_WRITE)
#ifdef NO_VERSION_CHECK
#define VERSION_HOLDS(c) true
#else
#define VERSION_HOLDS(c) (readVer[c] == ver)
#endif
/* The write applies the decision made on what was read if the version held; else (a miss)
   the replica decides again under the permit's lock, on what the store holds now. */
#define SERVE1(c, k, cont) \
    :: d_step { req[c] && read[c] && VERSION_HOLDS(c) -> decide(c, k, cont, room[c]); \
                read[c] = false; room[c] = false; readVer[c] = 0 } \
    :: d_step { req[c] && read[c] && !VERSION_HOLDS(c) -> decide(c, k, cont, slots < N); \
                read[c] = false; room[c] = false; readVer[c] = 0 }
#define SERVE(c) \
    :: d_step { req[c] && !read[c] -> read[c] = true; room[c] = (slots < N); readVer[c] = ver } \
    SERVE1(c, 0, false) SERVE1(c, 1, false) SERVE1(c, 0, true) SERVE1(c, 1, true)
#elif defined(NO_ATOMIC_RESERVE)
#define SERVE1(c, k, cont) \
    :: d_step { req[c] && read[c] -> decide(c, k, cont, room[c]); read[c] = false; room[c] = false }
#define SERVE(c) \
    :: d_step { req[c] && !read[c] -> read[c] = true; room[c] = (slots < N) } \
    SERVE1(c, 0, false) SERVE1(c, 1, false) SERVE1(c, 0, true) SERVE1(c, 1, true)
#else
#define SERVE1(c, k, cont) :: d_step { req[c] -> decide(c, k, cont, slots < N) }
#define SERVE(c) SERVE1(c, 0, false) SERVE1(c, 1, false) SERVE1(c, 0, true) SERVE1(c, 1, true)
#endif

/* The lease sweeper (ledger/src/decide/settle.rs `expire_lease`): uncertain, never released. */
#define EXPIRE(i) :: d_step { LEASED(aState[i]) -> aState[i] = S_UNCERTAIN; CHECK_SLOTS() }

/*
 * A person deciding a request (ledger/src/decide/approval.rs `decide_approval`, through the
 * admin API), and the sweeper expiring a request nobody decided or an approval nobody used
 * (ledger/src/decide/settle.rs `expire_lease`): each one transaction, at any moment. A
 * rejection or an expiry gives the slot back, which is sound only if nothing of the attempt
 * was sent: (P4). Only attempt 0 can be a request (NEEDS_APPROVAL), so only it is instanced.
 */
#define DECIDE_APPROVAL(i) \
    :: d_step { aState[i] == S_APPR_WAIT -> aState[i] = S_APPROVED; RECORD_APPROVAL(i); CHECK_SLOTS() } \
    :: d_step { aState[i] == S_APPR_WAIT -> \
                assert(!reached[i] && !live[i]);                /* (P4) */ \
                aState[i] = S_APPR_REJ; slots--; CHECK_SLOTS() }
#define EXPIRE_APPROVAL(i) \
    :: d_step { (aState[i] == S_APPR_WAIT || aState[i] == S_APPROVED) -> \
                assert(!reached[i] && !live[i]);                /* (P4) */ \
                aState[i] = S_APPR_EXP; slots--; CHECK_SLOTS() }

/*
 * The admin or reconciler (ledger/src/decide/settle.rs `resolve`), after checking the provider.
 * Truthful: "not executed" only when the upstream did not execute the attempt and no round
 * of it is still on its way (the lease outlasts Envoy's route timeout, and resolution waits
 * for the lease; the model has no clock, so it states this directly).
 */
#define RESOLVE(i) \
    :: d_step { aState[i] == S_UNCERTAIN && execA[i] -> aState[i] = S_RES_EXEC; CHECK_SLOTS() } \
    :: d_step { aState[i] == S_UNCERTAIN && !execA[i] && !live[i] -> \
                aState[i] = S_RES_NOT; slots--; \
                if :: reached[i] -> notExec++ :: else fi; CHECK_SLOTS() }

/*
 * The two ledger replicas: every step is one transaction on the shared store
 * (ledger/src/store/: SQLite BEGIN IMMEDIATE, PostgreSQL SELECT ... FOR UPDATE of the
 * permit row). Filter i's callouts go to replica i (the cluster's load balancer), so two
 * decisions race on the store. Replica 0 also applies the queued reports, replica 1 runs
 * the sweeper, the admin's resolutions and the person's approval decisions: each is one
 * transaction whichever replica runs it, so the split only spares the checker duplicate work.
 */
proctype Replica(byte id) {
    byte a;
end:
    do
    :: id == 0 ->
end_0:  if
        SERVE(0)
        DELIVER(0)
        DELIVER(1)
        DELIVER(2)
        DELIVER(3)
        DELIVER(4)
        DELIVER(5)
        DELIVER(6)
        DELIVER(7)
        DELIVER(8)
        DELIVER(9)
        DELIVER(10)
        DELIVER(11)
        fi
    :: id == 1 ->
end_1:  if
        SERVE(1)
        EXPIRE(0)
        EXPIRE(1)
        EXPIRE(2)
        EXPIRE(3)
        RESOLVE(0)
        RESOLVE(1)
        RESOLVE(2)
        RESOLVE(3)
        DECIDE_APPROVAL(0)
        EXPIRE_APPROVAL(0)
        fi
    od
}

/*
 * The MCP server. A tool's side effect happens when it completes: a round either runs it
 * to completion (executed) or asks for input (not executed), and its answer may be lost
 * on the way back (reset, timeout, client gone).
 */
#define EXECUTE(f) \
    execA[upAtt[f] - 1] = true; execKey[aKey[upAtt[f] - 1]]++; execTotal++; \
    assert(execKey[aKey[upAtt[f] - 1]] <= 1);       /* (P2) */ \
    assert(execTotal <= N)                          /* (P1) */

#define HANDLE(f) \
    :: d_step { upAtt[f] != 0 && upAns[f] == 0 -> EXECUTE(f); live[upAtt[f] - 1] = false; upAns[f] = O_DONE } \
    :: d_step { upAtt[f] != 0 && upAns[f] == 0 -> EXECUTE(f); live[upAtt[f] - 1] = false; upAns[f] = O_UNCERTAIN } \
    :: d_step { upAtt[f] != 0 && upAns[f] == 0 -> live[upAtt[f] - 1] = false; upAns[f] = O_INPUT } \
    :: d_step { upAtt[f] != 0 && upAns[f] == 0 -> live[upAtt[f] - 1] = false; upAns[f] = O_UNCERTAIN }

proctype Upstream() {
end:
    do
    HANDLE(0)
    HANDLE(1)
    od
}

/*
 * A filter's request contexts, one call after another (src/call.rs): one authorize
 * callout; on Dispatch the request goes upstream or Envoy proves it never left
 * (src/outcome.rs `classify`: released); then the report, which may be lost.
 */
proctype Filter(byte id) {
    byte a, r, res;
    do
    /* a tools/call, perhaps a continuation (params.inputResponses / params.requestState) */
    :: d_step { calls < CALLS -> calls++; req[id] = true };
        if
        :: d_step { ansOf[id] == A_DISPATCH -> a = ansAtt[id]; r = ansRound[id];
                    ansOf[id] = 0; ansAtt[id] = 0; ansRound[id] = 0 }
            if
            :: d_step {
                /* never reached the upstream: attempts 0, or exactly one attempt with
                   UF/UH/UO/NR/NC alone (after a retry an earlier attempt may have) */
                live[a] = false; res = O_RELEASED
            }
            :: d_step {
                if
                :: !reached[a] -> reached[a] = true; upAttempts++;
                    assert(upAttempts - notExec <= N)                 /* (P1) */
                :: else
                fi;
                upAtt[id] = a + 1
            }
                d_step { upAns[id] != 0 -> res = upAns[id]; upAtt[id] = 0; upAns[id] = 0 }
            fi;
            if
            :: d_step { pend[CAP(a, r) - 1] = res; a = 0; r = 0; res = 0 }
            :: d_step { a = 0; r = 0; res = 0 }   /* lost: the VM died, or the queue overflowed */
            fi
        :: d_step { ansOf[id] == A_DENY || ansOf[id] == A_REPLAY -> ansOf[id] = 0 }
        fi
    :: break
    od
}

/*
 * The attacker's forged report: about attempt a, naming round r and outcome o, showing
 * capability c: the one for the attempt's current round if it was given that one, else a
 * guess (0; any other capability it holds fails the check exactly as a guess does). It posts to a replica itself, when
 * it likes, so its reports need no queue. A report the ledger would not apply changes
 * nothing (refusals are only counted), so only those it applies are taken as steps.
 */
#define HELD(a) (known & (1 << CAP(a, aRound[a])))
#define FORGE_C(a, r, o) \
    :: d_step { HELD(a) && APPLIES(a, r, CAP(a, aRound[a])) -> apply_report(a, r, CAP(a, aRound[a]), o); steps++ } \
    :: d_step { !HELD(a) && APPLIES(a, r, 0) -> apply_report(a, r, 0, o); steps++ }
#define FORGE_O(a, r) FORGE_C(a, r, O_DONE) FORGE_C(a, r, O_INPUT) FORGE_C(a, r, O_UNCERTAIN) FORGE_C(a, r, O_RELEASED)
#define FORGE_A(a) FORGE_O(a, 1) FORGE_O(a, 2) FORGE_O(a, 3)

/*
 * The agent turned against its owner: ATT_STEPS actions, each a Dispatch it obtained or a
 * report the ledger applied (a denied call changes nothing and is not counted).
 */
#define ASK(k, cont) \
    :: d_step { decide(ATTACKER, k, cont, slots < N); \
                if :: ansOf[ATTACKER] == A_DISPATCH -> steps++ :: else fi; \
                ansOf[ATTACKER] = 0; ansAtt[ATTACKER] = 0; ansRound[ATTACKER] = 0 }

proctype Attacker() {
    byte steps = 0, a;
    do
    :: steps < ATT_STEPS ->
        if
        /* authorize directly with its permit token (one replica transaction; its own wait
           for the answer changes nothing): it learns that round's capability */
        ASK(0, false)
        ASK(1, false)
        ASK(0, true)
        ASK(1, true)
        /* report */
        FORGE_A(0)
        FORGE_A(1)
        FORGE_A(2)
        FORGE_A(3)
        fi
    :: break
    od
}

init {
    atomic {
        keyAtt[0] = NONE;
        keyAtt[1] = NONE;
        run Replica(0);
        run Replica(1);
        run Upstream();
        run Filter(0);
        run Filter(1);
        run Attacker()
    }
}
