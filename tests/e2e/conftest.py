import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.e2e.forms import PER_FORM  # noqa: E402
from tests.support.mcp_raw import RawMcp  # noqa: E402
from tests.support.stack import ROOT, Envoy, ExampleServer, Ledger, deployment  # noqa: E402
from tests.support.tcp_proxy import TcpProxy  # noqa: E402

UPSTREAM_SECRET = "demo-upstream-key-secret"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """In a body-holding deployment form (ATMOST_DEPLOYMENT), keeps only the tests tests/e2e/forms.py
    names: the rest does not depend on the form and ran in `make test-e2e`. A name there that
    matches no collected test of its file stops the run, so a renamed test cannot drop out of
    the forms unseen."""
    if deployment() == "envoyfilter":
        return
    kept, dropped, found = [], [], set()
    for item in items:
        name = (item.path.name, getattr(item, "originalname", item.name))
        if name[1] in PER_FORM.get(name[0], {}):
            kept.append(item)
            found.add(name)
        else:
            dropped.append(item)
    collected = {item.path.name for item in items}
    missing = [f"{file}::{test}" for file, tests in PER_FORM.items() if file in collected
               for test in tests if (file, test) not in found]
    if missing:
        raise pytest.UsageError("tests/e2e/forms.py names tests that were not collected: " + ", ".join(missing))
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept


@pytest.fixture(scope="session")
def log_dir() -> Path:
    # Under pytest-xdist each worker is a session of its own: one directory for the run (named by
    # xdist's id of it, which every worker has) holds one per worker, so two workers' processes of
    # the same name never write one file, and the fault suite's log scan finds the whole run.
    run, worker = os.environ.get("PYTEST_XDIST_TESTRUNUID"), os.environ.get("PYTEST_XDIST_WORKER")
    name = f"{time.strftime('%Y%m%d')}-{run[:12]}/{worker}" if run and worker else time.strftime("%Y%m%d-%H%M%S")
    path = ROOT / ".run" / "test-logs" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def data_root():
    path = Path(tempfile.mkdtemp(prefix="atmost-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def ledger(log_dir, data_root):
    ledger = Ledger(log_dir, data_root / "ledger")
    ledger.start()
    yield ledger
    ledger.stop()


@pytest.fixture(scope="session")
def mcp_server(log_dir):
    server = ExampleServer(log_dir)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def upstream_proxy(mcp_server):
    proxy = TcpProxy(mcp_server.port).start()
    yield proxy
    proxy.stop()


@pytest.fixture(scope="session")
def gateway(log_dir, ledger, upstream_proxy):
    envoy = Envoy(log_dir, upstream_proxy.port, [ledger.port],
                  plugin_overrides={"ledger": {"service_token": ledger.service_token}})
    envoy.start()
    yield envoy
    envoy.stop()


@pytest.fixture
def server(mcp_server, upstream_proxy):
    """The example server, with counters zeroed and the proxy passing traffic."""
    mcp_server.reset()
    upstream_proxy.mode = "pass"
    return mcp_server


@pytest.fixture
def permit(ledger):
    return ledger.create_permit(label=f"test-{uuid.uuid4().hex[:8]}")


@pytest.fixture
def client(gateway):
    c = RawMcp(gateway.url)
    yield c
    c.close()


def new_key() -> str:
    return f"key-{uuid.uuid4()}"
