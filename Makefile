# atmost: `make run` starts the demo gateway, `make test` runs every suite.
# Both install what they need: the wasm32-wasip1 target and a project-local virtualenv.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
WASM := target/wasm32-wasip1/release/atmost_filter.wasm
CARGO ?= cargo

.PHONY: all run test test-unit test-e2e lint fmt wasm ledger ledger-release setup rust-setup venv clean oci

all: wasm ledger-release

setup: rust-setup venv

rust-setup:
	@rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip1 || rustup target add wasm32-wasip1

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

wasm: rust-setup
	$(CARGO) build --release --target wasm32-wasip1 -p atmost-filter

## The filter as an OCI image for Istio (compat variant: one layer with plugin.wasm), reproducible:
## target/oci/atmost-filter/ (OCI layout), target/oci/atmost-filter.tar, target/oci/atmost-filter.digest.
oci: wasm
	$(PYTHON) scripts/oci_image.py --wasm $(WASM) --out target/oci

ledger:
	$(CARGO) build -p atmost-ledger

ledger-release:
	$(CARGO) build --release -p atmost-ledger

## The main job: ledger + example MCP server (or UPSTREAM=host:port) + Envoy on 127.0.0.1:10000/mcp.
run: setup wasm ledger-release
	ATMOST_BIN=target/release/atmost $(VPY) scripts/run.py

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy -p atmost-filter --target wasm32-wasip1 -- -D warnings

fmt:
	$(CARGO) fmt --all

test-unit:
	$(CARGO) test --workspace

test-e2e: setup wasm ledger
	ATMOST_BIN=target/debug/atmost $(VPY) -m pytest tests/e2e -q -p no:cacheprovider --timeout 300

test: setup lint test-unit test-e2e

clean:
	$(CARGO) clean
	rm -rf $(VENV) .run
