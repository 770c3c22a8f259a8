"""The soak's own verdicts, beside the per-call history checker (tests/support/history.py):
every `uncertain` attempt explained by a fault, nothing stuck `in_flight` past its lease,
resident memory flat. Each returns its figures and its violations (empty: it held).
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict

from tests.faults.test_upstream_faults import REPORTED
from tests.soak.nemesis import KINDS, FaultWindow

# Resident memory: an incarnation (one process, one pid) is judged when it lived at least
# `min_span` seconds. Its first WARMUP_SHARE of that time is start-up (the VMs, pools and
# caches filling); of the rest, the median of the first fifth is the baseline and the median
# of the last fifth the end. Flat: the end exceeds the baseline by no more than
# RSS_GROWTH_SHARE of it, or RSS_GROWTH_MIB, whichever is larger.
WARMUP_SHARE = 0.25
RSS_GROWTH_SHARE = 0.10
RSS_GROWTH_MIB = 16.0
# The sweeper runs every 200 ms; a lease that ran out this long ago and is still in_flight is stuck.
STUCK_GRACE_MS = 2000


def uncertain_reasons(row: dict) -> set[str]:
    """How an attempt became uncertain: `lease` (the sweeper: its lease ran out), or the Envoy
    response flags of the filter's report of a sent call (DC, UC, UR, UT…); empty if neither."""
    if row.get("reason") == "lease_expired":
        return {"lease"}
    m = REPORTED.match(row.get("reason") or "")
    return set(m.group(1).split(",")) if m else set()


# What explains a `lease_expired` attempt whose key was denied `gateway_unavailable`: the
# filter gave up on that authorize while the ledger committed it (a decision held on its way
# to the ledger, an answer late or lost after its commit), so nothing was sent and the
# reservation was left to its lease (docs/faults-and-hostile-input.md, "slow ledger").
GIVEN_UP = "callout_given_up"


def explain_uncertain(rows: list[dict], windows: list[FaultWindow], call_bound_ms: int,
                      t0_wall_ms: int, given_up: frozenset[str] = frozenset()) -> tuple[dict, list[str]]:
    """Each `uncertain` attempt needs a fault window of a kind that can cause its reason, active
    during the attempt's life: from its dispatch (`created_at`, less `call_bound_ms`: the
    longest a call can run, so a fault that began just before the dispatch counts) to the
    moment its fate was sealed — its lease's end for `lease_expired` (the report had not
    come by then), its last update for a filter's report. An attempt made uncertain by its
    lease before the lease ran out is a violation too. `given_up`: the attempts whose key a call
    was denied `gateway_unavailable`; a `lease_expired` one of them that no fault explains is
    counted as `GIVEN_UP`."""
    by_kind: Counter = Counter()
    several = 0
    violations = []
    for row in rows:
        if row["state"] != "uncertain":
            continue
        reasons = uncertain_reasons(row)
        begin = row["created_at"] - call_bound_ms
        sealed = row["lease_expires_at"] if "lease" in reasons else row["updated_at"]
        causes = [w for w in windows if KINDS[w.kind].causes & reasons
                  and w.start_wall_ms <= sealed and (w.end_wall_ms is None or w.end_wall_ms >= begin)]
        at = (row["created_at"] - t0_wall_ms) / 1000
        if "lease" in reasons and row["updated_at"] < row["lease_expires_at"]:
            violations.append(f"attempt {row['id']} turned uncertain (lease_expired) before its lease ran out: {row}")
        if causes:
            by_kind[causes[0].kind] += 1
            several += len({w.kind for w in causes}) > 1
        elif "lease" in reasons and row["id"] in given_up:
            by_kind[GIVEN_UP] += 1
        else:
            active = [f"{w.kind}@{(w.start_wall_ms - t0_wall_ms) / 1000:.1f}s" for w in windows
                      if w.start_wall_ms <= sealed and (w.end_wall_ms is None or w.end_wall_ms >= begin)]
            violations.append(f"uncertain attempt {row['id']} (tool {row['tool']}, reason {row['reason']!r}, "
                              f"dispatched at +{at:.1f} s) is explained by no fault: active then: {active or 'none'}")
    return {"explained_by_kind": dict(sorted(by_kind.items())), "with_several_candidate_kinds": several}, violations


def stuck_in_flight(rows: list[dict], read_at_ms: int) -> list[str]:
    return [f"attempt {r['id']} (tool {r['tool']}) in_flight {(read_at_ms - r['lease_expires_at']) / 1000:.1f} s "
            f"past its lease" for r in rows
            if r["state"] == "in_flight" and r["lease_expires_at"] + STUCK_GRACE_MS < read_at_ms]


def sweep_lateness(rows: list[dict]) -> dict:
    """How long after its lease ran out each `lease_expired` attempt was swept (a figure: the
    sweeper cannot write while the store is away)."""
    late = sorted(r["updated_at"] - r["lease_expires_at"] for r in rows
                  if r["state"] == "uncertain" and r.get("reason") == "lease_expired")
    if not late:
        return {"swept": 0}
    return {"swept": len(late), "median_ms": late[len(late) // 2], "max_ms": late[-1]}


def incarnations(samples: list[tuple[float, str, int, int]]) -> dict[str, list[list[tuple[float, float]]]]:
    """component → its processes in order, each a list of (t seconds, RSS MiB)."""
    out: dict[str, list[list[tuple[float, float]]]] = defaultdict(list)
    last_pid: dict[str, int] = {}
    for t, component, pid, rss_kib in samples:
        if last_pid.get(component) != pid:
            out[component].append([])
            last_pid[component] = pid
        out[component][-1].append((t, rss_kib / 1024))
    return dict(out)


def rss_flat(samples: list[tuple[float, str, int, int]], components: list[str],
             min_span: float) -> tuple[dict, list[str]]:
    figures: dict[str, list[dict]] = {}
    violations = []
    for component in components:
        judged = []
        for series in incarnations(samples).get(component, []):
            t0, t1 = series[0][0], series[-1][0]
            if t1 - t0 < min_span:
                continue
            steady_from = t0 + WARMUP_SHARE * (t1 - t0)
            fifth = (t1 - steady_from) / 5
            first = [m for t, m in series if steady_from <= t <= steady_from + fifth]
            last = [m for t, m in series if t >= t1 - fifth]
            if not first or not last:
                continue
            base, end = statistics.median(first), statistics.median(last)
            allowed = max(RSS_GROWTH_SHARE * base, RSS_GROWTH_MIB)
            entry = {"from_s": round(t0, 1), "to_s": round(t1, 1), "peak_mib": round(max(m for _, m in series), 1),
                     "baseline_mib": round(base, 1), "end_mib": round(end, 1), "growth_mib": round(end - base, 1),
                     "allowed_mib": round(allowed, 1), "flat": end - base <= allowed}
            judged.append(entry)
            if not entry["flat"]:
                violations.append(f"{component}: resident memory grew {end - base:.1f} MiB ({base:.1f} -> {end:.1f}) "
                                  f"between +{steady_from:.0f} s and +{t1:.0f} s, more than {allowed:.1f} MiB")
        figures[component] = judged
        if not judged:
            violations.append(f"{component}: no process lived {min_span:.0f} s: its memory was not judged")
    return figures, violations
