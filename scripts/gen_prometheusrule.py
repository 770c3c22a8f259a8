#!/usr/bin/env python3
"""Writes monitoring/prometheusrule.yaml from monitoring/atmost-rules.yml: the same groups, as a
PrometheusRule for the Prometheus Operator.

    make prometheusrule    # .venv/bin/python scripts/gen_prometheusrule.py > monitoring/prometheusrule.yaml

The plain rules file is the one source; tests/files/test_monitoring_rules.py fails when the
committed PrometheusRule is not what this writes from it.
"""

import sys
from pathlib import Path

import yaml

RULES = Path(__file__).resolve().parents[1] / "monitoring" / "atmost-rules.yml"

HEADER = """\
# Written by scripts/gen_prometheusrule.py from atmost-rules.yml (the groups, unchanged): edit
# that file and run `make prometheusrule`. What each alert means and what to do: docs/monitoring.md.
# The Operator's Prometheus loads PrometheusRules its ruleSelector matches: add the label it
# selects on (kube-prometheus-stack: `release: <its release name>`) under metadata.labels.
"""


def prometheus_rule(groups: list) -> dict:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "atmost",
            "namespace": "atmost-system",
            "labels": {"app.kubernetes.io/name": "atmost", "app.kubernetes.io/part-of": "atmost"},
        },
        "spec": {"groups": groups},
    }


def render(rules_text: str) -> str:
    groups = yaml.safe_load(rules_text)["groups"]
    return HEADER + yaml.safe_dump(prometheus_rule(groups), sort_keys=False, width=100, allow_unicode=True)


def main() -> None:
    sys.stdout.write(render(RULES.read_text(encoding="utf-8")))


if __name__ == "__main__":
    main()
