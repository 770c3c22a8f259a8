# atmost: `make run` starts the demo gateway, `make test` runs every suite.
# Both install what they need: the wasm32-wasip1 target and a project-local virtualenv.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
WASM := target/wasm32-wasip1/release/atmost_filter.wasm
CARGO ?= cargo

.PHONY: all run test test-unit test-e2e test-faults lint fmt ts-deps wasm ledger ledger-release setup rust-setup venv clean oci

all: wasm ledger-release

setup: rust-setup venv

rust-setup:
	@rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip1 || rustup target add wasm32-wasip1

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

## The TypeScript MCP SDK (exact versions in tests/ts/package-lock.json) for the interoperability tests.
ts-deps: tests/ts/node_modules/.installed

tests/ts/node_modules/.installed: tests/ts/package.json tests/ts/package-lock.json
	cd tests/ts && npm ci --no-audit --no-fund --loglevel=error
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

## The PostgreSQL store's tests need DATABASE_URL: scripts/with-postgres uses it when set, else a
## server at 127.0.0.1:5432 (database test), else a throwaway cluster; it fails if none works.
WITH_PG := scripts/with-postgres

test-unit:
	$(WITH_PG) $(CARGO) test --workspace

test-e2e: setup ts-deps wasm ledger
	ATMOST_BIN=target/debug/atmost $(WITH_PG) $(VPY) -m pytest tests/e2e -q -p no:cacheprovider --timeout 300

# One PostgreSQL for both suites (a throwaway one is started once and stopped at the end).
test: setup lint
	$(WITH_PG) $(MAKE) --no-print-directory test-unit test-e2e

## The fault suite: real processes under kill -9, a slow or silent ledger, upstream resets and timeouts,
## client hang-ups, Envoy killed, reloaded or drained mid-call, a failed VM, a full or read-only store,
## PostgreSQL restarts; the hostile-input catalogue; security checks (ends with a scan of every log).
test-faults: setup wasm ledger
	ATMOST_BIN=target/debug/atmost $(WITH_PG) $(VPY) -m pytest tests/faults -q -p no:cacheprovider --timeout 180 -rxs

clean:
	$(CARGO) clean
	rm -rf $(VENV) .run
