"""What a soak run writes: report.json (everything), report.md (the figures), rss.png
(resident memory of Envoy and both ledgers over the run, the fault windows shaded, and the
calls' outcomes over time), rss.csv (the memory samples)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from tests.soak.nemesis import KINDS
from tests.soak.verdicts import incarnations

COMPONENT_COLOURS = {"envoy": "tab:blue", "ledger-1": "tab:green", "ledger-2": "tab:olive"}
KIND_COLOURS = dict(zip(KINDS, ("tab:red", "tab:purple", "tab:brown", "tab:orange", "tab:pink", "tab:cyan",
                                "tab:gray")))
OUTCOME_CLASSES = (("ok", "tab:green"), ("replay", "tab:blue"), ("denied: cap", "gold"),
                   ("denied: other", "tab:orange"), ("unknown", "tab:red"))


def outcome_class(r) -> str:
    if r.outcome == "ok":
        return "replay" if r.replayed else "ok"
    if r.outcome == "denied":
        return "denied: cap" if r.code == "permit_max_calls_exceeded" else "denied: other"
    return r.outcome


def write(out: Path, report: dict, samples: list, calls: list, windows: list, t0: float) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "report.md").write_text(markdown(report))
    with open(out / "rss.csv", "w") as f:
        f.write("seconds,process,pid,rss_kib\n")
        f.writelines(f"{t:.1f},{name},{pid},{kib}\n" for t, name, pid, kib in samples)
    plot(out / "rss.png", samples, calls, windows, t0, report["load_from_s"], report["seconds"])


def markdown(report: dict) -> str:
    lines = [f"# Soak run: {'PASS' if not report['violations'] and not report['harness_errors'] else 'FAIL'}", "",
             f"- seed {report['seed']}, {report['seconds']:.0f} s of faults and load ({report['wall_seconds']:.0f} s "
             f"in all), target rate {report['rate']:g} calls/s",
             f"- slow disk: {report['slow_disk']}",
             f"- calls: {report['calls']} ({report['calls_per_second']:.1f}/s), probes after recovery: "
             f"{report['probes']}",
             f"- violations: {len(report['violations'])}; harness errors: {len(report['harness_errors'])}", "",
             "## Faults injected", "", "| kind | count | total s |", "|---|---|---|"]
    for kind, f in report["faults_by_kind"].items():
        lines.append(f"| {kind} | {f['count']} | {f['seconds']:.1f} |")
    lines += ["", "## Outcomes", "", "| outcome | calls |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in report["outcomes"].items()]
    lines += ["", "## Attempts (final states)", "", "| state | attempts |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in report["attempt_states"].items()]
    u = report["uncertain"]
    lines += ["", f"Uncertain attempts by the fault that explains them: {u['explained_by_kind'] or 'none'} "
                  f"({u['with_several_candidate_kinds']} with candidates of several kinds); sweeper lateness "
                  f"{report['sweep_lateness']}.", "", "## Resident memory", "",
              "| process | from s | to s | baseline MiB | end MiB | growth MiB | allowed MiB | flat |",
              "|---|---|---|---|---|---|---|---|"]
    for component, judged in report["rss"].items():
        for e in judged:
            lines.append(f"| {component} | {e['from_s']} | {e['to_s']} | {e['baseline_mib']} | {e['end_mib']} | "
                         f"{e['growth_mib']} | {e['allowed_mib']} | {'yes' if e['flat'] else 'NO'} |")
    if report["violations"]:
        lines += ["", "## Violations", ""] + [f"- {v}" for v in report["violations"][:200]]
    if report["harness_errors"]:
        lines += ["", "## Harness errors", ""] + [f"- {e}" for e in report["harness_errors"][:50]]
    return "\n".join(lines) + "\n"


def plot(path: Path, samples: list, calls: list, windows: list, t0: float, load_from: float, seconds: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    minutes = seconds > 900
    scale, unit = (60.0, "min") if minutes else (1.0, "s")
    fig, (ax_rss, ax_calls) = plt.subplots(2, 1, figsize=(14, 8), sharex=True,
                                           gridspec_kw={"height_ratios": [3, 2]})
    for ax in (ax_rss, ax_calls):
        ax.axvline((load_from + seconds) / scale, color="black", lw=0.8, ls="--")
        for w in windows:
            end = (w.end if w.end is not None else w.start) - t0
            ax.axvspan((w.start - t0) / scale, end / scale, color=KIND_COLOURS[w.kind], alpha=0.18, lw=0)
    for component, series_list in incarnations(samples).items():
        for n, series in enumerate(series_list):
            ax_rss.plot([t / scale for t, _ in series], [m for _, m in series], color=COMPONENT_COLOURS[component],
                        lw=1.2, label=component if n == 0 else None)
            ax_rss.plot([series[0][0] / scale], [series[0][1]], marker="o", ms=3, color=COMPONENT_COLOURS[component])
    ax_rss.set_ylabel("resident memory (MiB)")
    ax_rss.set_ylim(bottom=0)
    ax_rss.set_title("Resident memory of Envoy and the ledger replicas (a dot: a process started); "
                     "fault windows shaded; dashed: the load stops, recovery and probes follow")
    lines = ax_rss.legend(loc="upper left").legend_handles
    kinds = sorted({w.kind for w in windows})
    ax_rss.legend(handles=[*lines, *(Patch(color=KIND_COLOURS[k], alpha=0.35, label=k) for k in kinds)],
                  loc="upper left", ncol=2, fontsize=8)
    bin_s = max(5.0, seconds / 120)
    bins: dict[str, Counter] = {c: Counter() for c, _ in OUTCOME_CLASSES}
    for r in calls:
        bins[outcome_class(r)][int((r.started - t0) // bin_s)] += 1
    n_bins = int((load_from + seconds) // bin_s) + 2
    xs = [(i * bin_s) / scale for i in range(n_bins)]
    bottom = [0.0] * n_bins
    for c, colour in OUTCOME_CLASSES:
        ys = [bins[c][i] / bin_s for i in range(n_bins)]
        ax_calls.bar(xs, ys, width=bin_s / scale, bottom=bottom, align="edge", color=colour, label=c, lw=0)
        bottom = [b + y for b, y in zip(bottom, ys)]
    ax_calls.set_ylabel(f"calls/s (per {bin_s:.0f} s)")
    ax_calls.set_xlabel(f"time since start ({unit})")
    ax_calls.legend(loc="upper left", ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
