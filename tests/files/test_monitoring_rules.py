"""The shipped monitoring (monitoring/, docs/monitoring.md), checked offline: the rules file passes
`promtool check rules` and its unit tests (tests/prometheus/, `promtool test rules`: every alert
firing and kept quiet); the PrometheusRule holds exactly its groups; each alert has a severity, a
summary and a runbook section in docs/monitoring.md, whose alert table names exactly the file's
alerts; the Grafana dashboard reads its datasource from a variable.

Reads files only: no build, no process but promtool and scripts/gen_prometheusrule.py. The same
rules and dashboard in a real Prometheus scraping a real ledger and Envoy:
tests/e2e/test_monitoring.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import yaml

from tests.support.monitoring import (
    DASHBOARD,
    DOC,
    GEN_PROMETHEUS_RULE,
    NO_DATA_EXPECTED,
    PROMETHEUS_RULE,
    RULE_TESTS,
    RULES,
    alerts_of,
    promtool,
    rule_groups,
)
from tests.support.stack import ROOT

SEVERITIES = {"critical", "warning", "info"}


# ---------------------------------------------------------------- the rules, checked offline


def test_the_rules_file_passes_promtool_check():
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in rule_groups())} rules found" in result.stdout


def test_the_rules_pass_their_unit_tests():
    result = promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text(encoding="utf-8")))
    assert tested == {a["alert"] for a in alerts_of(rule_groups())}


def test_the_unit_tests_catch_a_changed_rule(tmp_path):
    """The same unit tests against a copy whose uncertain alert waits ten minutes: they fail."""
    (tmp_path / "monitoring").mkdir()
    (tmp_path / "tests" / "prometheus").mkdir(parents=True)
    text = RULES.read_text(encoding="utf-8")
    slow = re.sub(r"(alert: AtmostCallUncertain\n(?:.*\n)*?\s+for: )30s", r"\g<1>10m", text, count=1)
    assert slow != text
    (tmp_path / "monitoring" / RULES.name).write_text(slow, encoding="utf-8")
    shutil.copy(RULE_TESTS, tmp_path / "tests" / "prometheus" / RULE_TESTS.name)
    result = promtool("test", "rules", str(tmp_path / "tests" / "prometheus" / RULE_TESTS.name))
    assert result.returncode != 0
    assert "alertname: AtmostCallUncertain" in result.stdout + result.stderr


def test_the_prometheusrule_holds_the_rules_files_groups_exactly():
    written = subprocess.run([sys.executable, str(GEN_PROMETHEUS_RULE)], capture_output=True,
                             text=True, timeout=60, cwd=ROOT)
    assert written.returncode == 0, written.stderr
    assert PROMETHEUS_RULE.read_text(encoding="utf-8") == written.stdout, \
        "monitoring/prometheusrule.yaml is not what scripts/gen_prometheusrule.py writes: run it again"
    rule = yaml.safe_load(PROMETHEUS_RULE.read_text(encoding="utf-8"))
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["spec"]["groups"] == rule_groups()


def test_every_alert_says_how_bad_what_to_do_and_where_to_read_more():
    doc = DOC.read_text(encoding="utf-8")
    headings = {h.strip().lower() for h in re.findall(r"^#+ (.+)$", doc, re.M)}
    for alert in alerts_of(rule_groups()):
        name = alert["alert"]
        assert alert["labels"]["severity"] in SEVERITIES, name
        assert alert["annotations"]["summary"], name
        assert alert["annotations"]["runbook"] == f"docs/monitoring.md#{name.lower()}", name
        assert name.lower() in headings, f"docs/monitoring.md has no section {name}"


def test_the_docs_alert_table_names_exactly_the_shipped_alerts():
    doc = DOC.read_text(encoding="utf-8")
    table = re.search(r"\| alert \| severity \|.*?\n((?:\|.*\n)+)", doc)
    assert table, "docs/monitoring.md: no alert table"
    rows = [line for line in table.group(1).splitlines() if not line.startswith("|---")]
    listed = [(re.search(r"\[`?(\w+)`?\]", r).group(1), r.split("|")[2].strip().strip("`")) for r in rows]
    assert listed == [(a["alert"], a["labels"]["severity"]) for a in alerts_of(rule_groups())]


def test_the_dashboard_reads_its_datasource_from_a_variable():
    dash = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"], p["title"]
    assert NO_DATA_EXPECTED <= {p["title"] for p in panels}
