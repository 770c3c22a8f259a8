"""Fixtures of the fault suite; the stack itself is in fault_stack.py."""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.faults.fault_stack import SCENARIOS, FaultStack  # noqa: E402
from tests.support.stack import ROOT  # noqa: E402


@pytest.fixture(scope="session")
def log_dir() -> Path:
    path = ROOT / ".run" / "test-logs" / ("faults-" + time.strftime("%Y%m%d-%H%M%S"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def data_root():
    path = Path(tempfile.mkdtemp(prefix="atmost-faults-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Keeps each phase's report on the test item (`item.rep_call`), for fixtures' teardown."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture
def fault_stack(request, log_dir, data_root):
    """A factory: `fault_stack(name, **options)` builds and starts a stack, stopped at the end.

    Each test using it is a fault scenario: its histories are registered under the test's
    node id. A scenario that passed without running the checker (`FaultStack.verify`) gets
    the per-call invariants checked here, at teardown, so no history goes unchecked."""
    stacks: list[FaultStack] = []
    histories = SCENARIOS.setdefault(request.node.nodeid, [])

    def make(name: str | None = None, start_ledger: bool = True, **options) -> FaultStack:
        default = re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name.replace("test_", ""))[:32].strip("-")
        default = f"{default}-{uuid.uuid4().hex[:4]}"
        stack = FaultStack(name or default, log_dir, data_root, **options)
        stacks.append(stack)
        histories.append(stack.history)
        return stack.start(ledger=start_ledger)

    yield make
    for s in stacks:
        s.stop()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.passed:
        violations = [f"{s.name}: {v}" for s in stacks if not s.history.checks for v in s.check_calls()]
        assert not violations, "per-call invariants at teardown:\n" + "\n".join(violations[:40])
