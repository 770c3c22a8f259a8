"""A failed Wasm VM fails closed: with the shipped `failure_policy: FAIL_CLOSED` nothing
bypasses the filter.

A Rust panic fails the whole VM. To make a VM fail on demand without planting a panic in
the product, the shipped sidecar configuration is started with a stand-in module: a
minimal proxy-wasm module (assembled below, byte by byte) that loads and configures
fine, then traps (`unreachable`) in `proxy_on_request_headers` — exactly what a panic
in the real filter looks like to Envoy. Every request after that, governed or not, must
be refused, and none may reach the upstream.

A module that does not load at all, and a plugin configuration that `on_configure`
refuses, are covered too: Envoy refuses the configuration, so nothing listens.
"""

from __future__ import annotations

import json
import socket
import subprocess

import pytest
import yaml

from tests.support.history import Permit
from tests.support.mcp_raw import RawMcp
from tests.support.stack import Envoy, Process, sidecar_config, validate_envoy_config, wait_until


def _leb(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _vec(items: list[bytes]) -> bytes:
    return _leb(len(items)) + b"".join(items)


def _section(section_id: int, payload: bytes) -> bytes:
    return bytes([section_id]) + _leb(len(payload)) + payload


def _name(s: str) -> bytes:
    return _leb(len(s)) + s.encode()


def trapping_module() -> bytes:
    """A proxy-wasm ABI 0.2.1 module whose request-headers callback traps."""
    i32 = 0x7F
    types = [
        bytes([0x60, 0, 0]),                          # 0: () -> ()
        bytes([0x60, 2, i32, i32, 1, i32]),           # 1: (i32, i32) -> i32
        bytes([0x60, 2, i32, i32, 0]),                # 2: (i32, i32) -> ()
        bytes([0x60, 3, i32, i32, i32, 1, i32]),      # 3: (i32, i32, i32) -> i32
        bytes([0x60, 1, i32, 1, i32]),                # 4: (i32) -> i32
    ]
    funcs = [
        ("proxy_abi_version_0_2_1", 0, b"\x0b"),
        ("proxy_on_vm_start", 1, b"\x41\x01\x0b"),          # i32.const 1
        ("proxy_on_configure", 1, b"\x41\x01\x0b"),
        ("proxy_on_context_create", 2, b"\x0b"),
        ("proxy_on_request_headers", 3, b"\x00\x0b"),      # unreachable: the VM traps
        ("proxy_on_memory_allocate", 4, b"\x41\x80\x08\x0b"),  # i32.const 1024
        ("proxy_on_done", 4, b"\x41\x01\x0b"),
        ("proxy_on_delete", 4, b"\x41\x00\x0b"),
    ]
    # proxy_on_delete is (i32) -> () in the ABI; give it its own type.
    types.append(bytes([0x60, 1, i32, 0]))  # 5: (i32) -> ()
    funcs[-1] = ("proxy_on_delete", 5, b"\x0b")
    exports = [_name(n) + b"\x00" + _leb(i) for i, (n, _, _) in enumerate(funcs)]
    exports.append(_name("memory") + b"\x02\x00")
    codes = []
    for _, _, body in funcs:
        fn = b"\x00" + body  # no locals
        codes.append(_leb(len(fn)) + fn)
    return (b"\x00asm\x01\x00\x00\x00"
            + _section(1, _vec(types))
            + _section(3, _vec([_leb(t) for _, t, _ in funcs]))
            + _section(5, _vec([b"\x00\x02"]))  # one memory, min 2 pages
            + _section(7, _vec(exports))
            + _section(10, _vec(codes)))


def envoy_with_wasm(s, wasm_path, name: str) -> Envoy:
    envoy = s.new_envoy(name)
    config = yaml.safe_load(envoy.config_path.read_text())
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    wasm = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.wasm")
    plugin = wasm["typed_config"]["config"]
    assert plugin["failure_policy"] == "FAIL_CLOSED"
    plugin["vm_config"]["code"]["local"]["filename"] = str(wasm_path)
    envoy.config_path.write_text(yaml.safe_dump(config))
    return envoy


def test_a_vm_that_fails_at_runtime_lets_nothing_through(fault_stack, tmp_path):
    s = fault_stack("vm-trap")
    p = s.permit()
    executed_before = s.upstream.count()
    requests_before = len(s.upstream.requests)
    connections_before = s.upstream_proxy.connection_count()
    module = tmp_path / "trap.wasm"
    module.write_bytes(trapping_module())
    s.envoy.stop()
    s.envoy = envoy_with_wasm(s, module, "envoy-vm-trap")
    s.envoy.start()
    client = RawMcp(s.url, timeout=5)
    statuses = []
    try:
        for i in range(4):
            statuses.append(client.call("pay", {"i": i}, p.token, f"vm-{i}").status_code)
        listed = client.post({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}})
        statuses.append(listed.status_code)
    finally:
        client.close()
    assert all(code >= 500 for code in statuses), statuses
    assert s.upstream.requests[requests_before:] == [], s.upstream.requests[requests_before:]
    assert s.upstream_proxy.connection_count() == connections_before
    assert "proxy_on_request_headers failed" in s.envoy.log_text()
    # A history entry per refusal keeps the log scan and the summary honest.
    s.history.call(s.url, Permit(p.id, p.token, {}), "pay", {"after": "trap"}, "vm-after")
    assert s.upstream.count() == executed_before


def plugin_of(config: dict) -> dict:
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.wasm")["typed_config"]["config"]


def validate(config: dict, path) -> subprocess.CompletedProcess:
    path.write_text(yaml.safe_dump(config))
    return validate_envoy_config(path)


def test_a_module_that_does_not_load_or_configure_is_refused_by_envoy(tmp_path):
    """`envoy --mode validate` on the shipped sidecar: accepted with the real module and its
    configuration (the positive control), refused with a module that does not load and with a
    configuration `on_configure` refuses, each with Envoy's and the filter's own words."""
    good = validate(sidecar_config(10000, 9901, 8000, [8081]), tmp_path / "good.yaml")
    assert good.returncode == 0 and "OK" in good.stdout, good.stderr[-3000:]

    bad = tmp_path / "garbage.wasm"
    bad.write_bytes(b"\x00asm\x01\x00\x00\x00this is not a module")
    r = validate(sidecar_config(10000, 9901, 8000, [8081], wasm=bad), tmp_path / "bad-wasm.yaml")
    assert r.returncode != 0, "Envoy accepted a module that does not load"
    for line in ("Failed to load Wasm code", "Plugin configured to fail closed failed to load",
                 "Unable to create Wasm plugin atmost"):
        assert line in r.stderr, (line, r.stderr[-3000:])

    config = sidecar_config(10000, 9901, 8000, [8081])
    plugin_of(config)["configuration"]["value"] = json.dumps({"ledger": {"cluster": "atmost_ledger"}})
    r = validate(config, tmp_path / "bad-config.yaml")
    assert r.returncode != 0, "Envoy accepted a configuration on_configure refuses"
    for line in ("atmost: bad plugin configuration: field `ledger.service_token`: is required",
                 "Failed to configure base Wasm plugin", "Unable to create Wasm plugin atmost"):
        assert line in r.stderr, (line, r.stderr[-3000:])


def test_envoy_with_a_module_that_does_not_load_exits_and_listens_nowhere(fault_stack, tmp_path):
    """Not only in validate mode: started for real, Envoy refuses the module and exits, and its
    listener never takes a connection. The same stack with the real module serves (positive
    control, the stack's own start)."""
    s = fault_stack("vm-no-load")
    assert s.call(s.permit(), "echo", {"text": "the real module serves"}).outcome == "ok"
    bad = tmp_path / "garbage.wasm"
    bad.write_bytes(b"\x00asm\x01\x00\x00\x00this is not a module")
    s.envoy.stop()
    s.envoy = envoy_with_wasm(s, bad, "envoy-vm-no-load")
    Process.start(s.envoy)
    wait_until(lambda: not s.envoy.alive(), 30, "Envoy to refuse the module and exit")
    assert s.envoy.proc.returncode != 0
    log = s.envoy.log_text()
    assert "Failed to load Wasm code" in log and "Unable to create Wasm plugin atmost" in log, log[-3000:]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", s.envoy.port), timeout=5).close()
    s.verify()
