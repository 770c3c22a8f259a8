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

from tests.faults.fault_stack import FaultStack  # noqa: E402
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


@pytest.fixture
def fault_stack(request, log_dir, data_root):
    """A factory: `fault_stack(name, **options)` builds and starts a stack, stopped at the end."""
    stacks: list[FaultStack] = []

    def make(name: str | None = None, start_ledger: bool = True, **options) -> FaultStack:
        default = re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name.replace("test_", ""))[:32].strip("-")
        default = f"{default}-{uuid.uuid4().hex[:4]}"
        stack = FaultStack(name or default, log_dir, data_root, **options)
        stacks.append(stack)
        return stack.start(ledger=start_ledger)

    yield make
    for s in stacks:
        s.stop()
