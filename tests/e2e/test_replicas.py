"""Ledger replicas on one PostgreSQL database, behind one Envoy cluster: the same guarantees.

These tests need DATABASE_URL (`make test` provides it, see scripts/with-postgres). Without it
they fail; they never skip.
"""

import os
import re
import shutil
import subprocess
import time
import uuid

import pytest
import yaml

from tests.e2e.conftest import new_key
from tests.support.mcp_raw import RawMcp, denial, denial_code, race_new_keys, result_text, worker_connections
from tests.support.stack import Envoy, Ledger, http_get, wait_until


@pytest.fixture(scope="module")
def database_url() -> str:
    url = os.environ.get("DATABASE_URL", "").strip()
    if not url:
        pytest.fail("DATABASE_URL is not set: the PostgreSQL replica tests never skip. "
                    "`make test` provides it (scripts/with-postgres); or export DATABASE_URL=postgres://…")
    return url


def drop_schema(url: str, schema: str) -> None:
    if shutil.which("psql"):
        subprocess.run(["psql", url, "-qc", f"DROP SCHEMA IF EXISTS {schema} CASCADE"],
                       capture_output=True, timeout=30)


def start_replicas(log_dir, data_root, url: str, schema: str, tag: str, count: int = 2) -> list[Ledger]:
    replicas = []
    for i in range(1, count + 1):
        name = f"ledger-pg-{tag}-{i}"
        ledger = Ledger(log_dir, data_root / name, name=name,
                        extra_args=["--pg-schema", schema, "--sweep-interval", "200ms", "--pg-pool-size", "8"])
        ledger.env["ATMOST_STORE"] = url  # the URL stays out of argv
        ledger.start()
        replicas.append(ledger)
    return replicas


@pytest.fixture(scope="module")
def replicas(log_dir, data_root, database_url):
    schema = f"atmost_e2e_{uuid.uuid4().hex[:10]}"
    ledgers = start_replicas(log_dir, data_root, database_url, schema, "a")
    yield ledgers
    for ledger in ledgers:
        ledger.stop()
    drop_schema(database_url, schema)


@pytest.fixture(scope="module")
def replicated_gateway(log_dir, replicas, upstream_proxy):
    envoy = Envoy(log_dir, upstream_proxy.port, [r.port for r in replicas], name="envoy-replicas",
                  plugin_overrides={"ledger": {"service_token": replicas[0].service_token}})
    envoy.start()
    yield envoy
    envoy.stop()


def authorize_counts(ledger: Ledger) -> dict[str, int]:
    """`atmost_authorize_total` of one replica, per decision."""
    out: dict[str, int] = {}
    for line in ledger.metrics().splitlines():
        m = re.match(r'atmost_authorize_total\{([^}]*)\}\s+(\S+)', line)
        if m:
            decision = re.search(r'decision="([^"]+)"', m.group(1)).group(1)
            out[decision] = out.get(decision, 0) + int(float(m.group(2)))
    return out


def total(counts: dict[str, int]) -> int:
    return sum(counts.values())


def sweep_count(ledger) -> int:
    return int(float(re.search(r"^atmost_sweeps_total (\S+)$", ledger.metrics(), re.M).group(1)))


def attempts(ledger, permit_id: str, state: str) -> list[dict]:
    return ledger.cli_json("attempts", "list", "--permit", permit_id, "--state", state)["attempts"]


def health_check_failures(envoy) -> int:
    """Health checks of the ledger cluster that failed (a timeout included) so far."""
    return envoy.stat("cluster.atmost_ledger.health_check.failure")


def both_replicas_answer_callouts(gateway, replicas, token: str) -> None:
    """Until each replica has answered a callout from this Envoy: calls under a token whose
    secret is wrong (each denied `permit_invalid` by the replica that gets it, nothing
    reserved). Envoy's admin API shows a replica healthy once its main thread has seen the
    health check pass; its workers learn it later, and on a busy machine a race can start in
    between, every callout going to the other replica."""
    before = [total(authorize_counts(r)) for r in replicas]
    wrong = token[:-1] + ("0" if token[-1] != "0" else "1")

    def answered() -> bool:
        c = RawMcp(gateway.url)
        try:
            assert denial_code(c.call("pay_invoice", {"invoice": "warm", "amount": 1}, wrong, new_key())) \
                == "permit_invalid"
        finally:
            c.close()
        return all(total(authorize_counts(r)) > b for r, b in zip(replicas, before))

    wait_until(answered, 30, "a callout answered by each ledger replica")


def test_cap_of_one_across_two_replicas_and_two_workers_executes_once(replicated_gateway, replicas, server):
    gateway = replicated_gateway
    workers_before = worker_connections(gateway)
    # Envoy sends callouts only to replicas whose health checks pass; on a busy machine a
    # /readyz can time out twice and take a replica out for a few seconds, and then one
    # replica rightly serves the whole race. The cap must hold in every race; both replicas
    # must decide in one of three, each begun once both have just answered a callout.
    for _ in range(3):
        wait_until(gateway.ledgers_healthy, 30, "both ledger replicas healthy in Envoy")
        permit = replicas[0].create_permit("--max-calls", "pay_invoice=1")
        both_replicas_answer_callouts(gateway, replicas, permit["token"])
        executed_before = server.executions("pay_invoice")
        served_before = [total(authorize_counts(r)) for r in replicas]
        answers = race_new_keys(gateway.url, permit["token"], "pay_invoice", 32, "replica-race", new_key)
        codes = [denial_code(a) for a in answers]
        assert codes.count(None) == 1, \
            [a.text for a in answers if denial_code(a) not in (None, "permit_max_calls_exceeded")]
        assert codes.count("permit_max_calls_exceeded") == 31
        assert server.executions("pay_invoice") - executed_before == 1
        # Both replicas see the same single slot.
        for r in replicas:
            assert r.cli_json("permit", "show", permit["id"])["usage"]["pay_invoice"]["calls_made"] == 1
        served = [total(authorize_counts(r)) - b for r, b in zip(replicas, served_before)]
        assert sum(served) == 32, served
        if all(n > 0 for n in served):
            break
    else:
        pytest.fail(f"in three races one replica served every call (health checks failed: "
                    f"{health_check_failures(gateway)}): {served}")
    workers_after = worker_connections(gateway)
    assert all(a > b for a, b in zip(workers_after, workers_before)), \
        f"both Envoy workers must take calls: {workers_before} -> {workers_after}"


def test_completed_on_one_replica_is_replayed_by_the_other(log_dir, data_root, database_url, upstream_proxy, server):
    """Replica A dispatches and records the receipt, then stops; replica B answers the retry."""
    schema = f"atmost_e2e_{uuid.uuid4().hex[:10]}"
    ledgers = start_replicas(log_dir, data_root, database_url, schema, "b")
    envoy = Envoy(log_dir, upstream_proxy.port, [r.port for r in ledgers], name="envoy-replay",
                  plugin_overrides={"ledger": {"service_token": ledgers[0].service_token}})
    # Health-check the replicas on /readyz, as a deployment with several replicas should.
    config = yaml.safe_load(envoy.config_path.read_text())
    cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == "atmost_ledger")
    cluster["health_checks"] = [{"timeout": "1s", "interval": "0.2s", "no_traffic_interval": "0.2s", "unhealthy_threshold": 1,
                                 "healthy_threshold": 1, "http_health_check": {"path": "/readyz"}}]
    # A replica that fails its check takes no callouts, even when it is half of the cluster.
    cluster["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}}
    envoy.config_path.write_text(yaml.safe_dump(config))
    envoy.start()
    client = RawMcp(envoy.url)
    try:
        permit = ledgers[0].create_permit("--max-calls", "pay_invoice=1")
        args = {"invoice": "INV-R", "amount": 7}
        before = [authorize_counts(r).get("dispatch", 0) for r in ledgers]
        def decided():
            # Each Envoy worker learns health flags a moment after the admin API shows them; a
            # callout that finds no healthy replica fails closed (gateway_unavailable, not sent).
            answer = client.call("pay_invoice", args, permit["token"], "replay-across-replicas")
            return None if denial_code(answer) == "gateway_unavailable" else answer

        def both_healthy():
            text = http_get(envoy.admin_url + "/clusters")[1].decode()
            return all(f"127.0.0.1:{r.port}::health_flags::healthy" in text for r in ledgers)

        wait_until(both_healthy, 15, "both replicas healthy in Envoy")
        first = wait_until(decided, 10, "the first call decided", interval=0.2)
        assert "executions=1" in result_text(first)
        wait_until(lambda: attempts(ledgers[1], permit["id"], "completed"), 15, "the receipt recorded")
        [dispatcher] = [r for r, b in zip(ledgers, before) if authorize_counts(r).get("dispatch", 0) > b]
        other = next(r for r in ledgers if r is not dispatcher)
        dispatcher.stop()
        wait_until(lambda: f"127.0.0.1:{dispatcher.port}::health_flags::/failed_active_hc"
                   in http_get(envoy.admin_url + "/clusters")[1].decode(), 15, "Envoy to drop the stopped replica")
        replays_before = authorize_counts(other).get("replay", 0)
        again = wait_until(decided, 10, "a replay answered by the surviving replica", interval=0.2)
        assert again.headers.get("idempotent-replayed") == "true", again.text
        assert "executions=1" in result_text(again)
        assert authorize_counts(other).get("replay", 0) == replays_before + 1
        assert server.executions("pay_invoice") == 1
        # A new key on the surviving replica still meets the cap the stopped one counted.
        assert denial_code(client.call("pay_invoice", {"invoice": "INV-S", "amount": 7}, permit["token"], new_key())) \
            == "permit_max_calls_exceeded"
    finally:
        client.close()
        envoy.stop()
        for r in ledgers:
            r.stop()
        drop_schema(database_url, schema)


def test_retention_on_postgres_prunes_receipts_keeps_tombstones_and_uncertain(replicated_gateway, replicas, server,
                                                                                upstream_proxy):
    gateway = replicated_gateway
    ledger = replicas[1]
    permit = ledger.create_permit("--retention", "1s", "--max-calls", "pay_invoice=5")
    client = RawMcp(gateway.url)
    try:
        done = {"invoice": "RET-1", "amount": 3}
        assert "executions=1" in result_text(client.call("pay_invoice", done, permit["token"], "kept-briefly"))
        upstream_proxy.mode = "cut_response"
        client.call("pay_invoice", {"invoice": "RET-2", "amount": 3}, permit["token"], "lost-answer")
        upstream_proxy.mode = "pass"
        [unknown] = wait_until(lambda: attempts(ledger, permit["id"], "uncertain"), 15, "the uncertain attempt")
        # The sweepers (every 200 ms, on both replicas) prune the receipt once 1 s has passed.
        wait_until(lambda: any(a.get("pruned_at") for a in attempts(ledger, permit["id"], "completed")), 15,
                   "the receipt to be pruned")
        expired = client.call("pay_invoice", done, permit["token"], "kept-briefly")
        assert denial_code(expired) == "idempotency_key_expired", expired.text
        # Uncertain attempts are never pruned: once the uncertain attempt's retention (1 s from
        # when it became uncertain, at the latest now) is over, both replicas sweep again.
        retention_over = time.time() + 1.0
        wait_until(lambda: time.time() > retention_over, 5, "the uncertain attempt's retention to pass")
        sweeps = [sweep_count(r) for r in replicas]
        wait_until(lambda: all(sweep_count(r) >= n + 2 for r, n in zip(replicas, sweeps)), 15,
                   "both replicas to sweep after the retention")
        still = denial(client.call("pay_invoice", {"invoice": "RET-2", "amount": 3}, permit["token"], "lost-answer"))
        assert (still["code"], still["attempt_id"]) == ("delivery_uncertain", unknown["id"])
        assert attempts(ledger, permit["id"], "uncertain")[0]["id"] == unknown["id"]
        assert server.executions("pay_invoice") == 2
    finally:
        upstream_proxy.mode = "pass"
        client.close()
