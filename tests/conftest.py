"""Shared by every suite: in CI a skipped test fails the run.

A skip is a test that proved nothing; counted as passing it hides a broken environment (a
fault that could not be injected, a tool that is missing). Locally a skip stays a skip, so
running one file of a suite still works; `CI` (set by CI) or `ATMOST_NO_SKIPS=1` turns every
skip into a failed run.
"""

from __future__ import annotations

import os

import pytest

# The suites' helpers in tests/support assert too (the manifests' rendering, the OCI image reader,
# the admission policy's evaluation): rewritten as the tests' own asserts are, a failing one
# shows the values it compared.
pytest.register_assert_rewrite("tests.support")

_skipped: list[str] = []


def _strict() -> bool:
    return os.environ.get("ATMOST_NO_SKIPS") == "1" or os.environ.get("CI", "").lower() in ("1", "true")


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    if _skipped and _strict() and exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    if _skipped and _strict():
        terminalreporter.write_line(f"{len(_skipped)} skipped test(s) fail this run (CI):", red=True)
        for nodeid in _skipped:
            terminalreporter.write_line(f"  {nodeid}", red=True)
