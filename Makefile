# atmost: `make run` starts the demo gateway, `make test` runs every suite.
# Both install what they need: the wasm32-wasip1 target and a project-local virtualenv
# (`make run` the packages of requirements.txt; the tests those of requirements-test.txt,
# plus Debian's skopeo, umoci, kubernetes-client (kubectl), golang-go, chromium and
# chromium-driver, prometheus, and iproute2, iptables, curl and python3 where missing).

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
WASM := target/wasm32-wasip1/wasm/atmost_filter.wasm
CARGO ?= cargo

.PHONY: oci-tools k8s-tools browser-tools prometheus-tools prometheusrule
# The quick loop: `make check` (docs/development.md#which-target-when).
.PHONY: check
.PHONY: all run test model-check test-unit test-e2e test-e2e-wasmplugin test-e2e-envoygateway test-faults lint fmt ts-deps wasm ledger ledger-next ledger-release setup setup-run rust-setup venv venv-test venv-bench clean oci

all: wasm ledger-release

# What `make run` (and `make bench`) needs; `setup` is what the suites need on top.
setup-run: rust-setup venv

setup: setup-run venv-test oci-tools k8s-tools go-tools browser-tools netns-tools prometheus-tools

# Go (Debian's golang-go) builds tests/support/go_upstream, an encoding/json upstream for the
# parser-differential tests; standard library only, so it builds offline.
.PHONY: go-tools fold-table
go-tools:
	@command -v go >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq golang-go; }

## Regenerates src/parse/fold_table.rs (simple case folding) from Debian's unicode-data CaseFolding.txt.
fold-table:
	@test -f /usr/share/unicode/CaseFolding.txt || { apt-get update -qq && apt-get install -y -qq unicode-data; }
	$(PYTHON) scripts/gen_casefold.py /usr/share/unicode/CaseFolding.txt > src/parse/fold_table.rs

# tests/e2e/test_pod_routes.py builds an agent pod's network as Istio does: network namespaces and
# veth links (iproute2), Istio's capture rules (iptables), processes under other users
# (util-linux's setpriv), requests from inside the namespaces (curl), the agent's own process
# (Debian's /usr/bin/python3: the project's virtualenv is not readable by another user).
# tests/e2e/test_ledger_tls.py captures a pod's loopback as an agent with CAP_NET_RAW would (tcpdump).
.PHONY: netns-tools
netns-tools:
	@command -v ip >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq iproute2; }
	@command -v iptables-restore >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq iptables; }
	@command -v setpriv >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq util-linux; }
	@command -v curl >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq curl; }
	@command -v tcpdump >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq tcpdump; }
	@test -x /usr/bin/python3 || { apt-get update -qq && apt-get install -y -qq python3; }

# Headless Chromium and its WebDriver (Debian's, the same version) drive the reconciliation
# inbox in tests/e2e/test_inbox.py and test_inbox_figures.py, through Selenium (requirements-test.txt); no browser is
# downloaded.
browser-tools:
	@command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 || \
		{ apt-get update -qq && apt-get install -y -qq chromium chromium-driver; }

# Debian's prometheus gives `promtool` (checks and unit-tests monitoring/atmost-rules.yml) and the
# Prometheus that tests/e2e/test_monitoring.py starts on a loopback port of its own. Without
# recommends (no node exporter). The package enables a prometheus service; the tests never use
# it, and where the install starts it (a machine with systemd and no policy-rc.d) it is stopped.
prometheus-tools:
	@command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || { \
		apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus && \
		{ ! command -v systemctl >/dev/null 2>&1 || systemctl stop prometheus.service 2>/dev/null || true; }; }

## monitoring/prometheusrule.yaml (the Prometheus Operator's form) from monitoring/atmost-rules.yml.
prometheusrule: venv
	$(VPY) scripts/gen_prometheusrule.py > monitoring/prometheusrule.yaml

# umoci (Debian) builds the OCI images, skopeo (Debian) reads and copies them: it checks what
# `make oci` builds. The ledger image takes its CA certificates from Debian's ca-certificates.
oci-tools:
	@command -v skopeo >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq skopeo; }
	@command -v umoci >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq umoci; }
	@dpkg-query --show ca-certificates >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq ca-certificates; }

# kubectl renders envoy/istio/ with its built-in kustomize (`kubectl kustomize`). Debian 12
# packages it as kubernetes-client (kubectl 1.20); a kubectl already on PATH is used as it is.
k8s-tools:
	@command -v kubectl >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq kubernetes-client; }

rust-setup:
	@rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip1 || rustup target add wasm32-wasip1

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

venv-test: $(VENV)/.installed-test

# `make bench-steady` draws pictures: requirements-bench.txt (requirements.txt and a plotting library).
venv-bench: $(VENV)/.installed-bench

# requirements-bench.txt starts with requirements.txt; requirements-test.txt with it.
$(VENV)/.installed-%: requirements-%.txt requirements-bench.txt requirements.txt
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --disable-pip-version-check -r $<
	touch $@

## The TypeScript MCP SDK (exact versions in tests/ts/package-lock.json) for the interoperability tests.
ts-deps: tests/ts/node_modules/.installed

tests/ts/node_modules/.installed: tests/ts/package.json tests/ts/package-lock.json
	cd tests/ts && npm ci --no-audit --no-fund --loglevel=error
	touch $@

# The module has its own profile (Cargo.toml: size-optimized); the release profile is the
# ledger server's.
wasm: rust-setup
	$(CARGO) build --profile wasm --target wasm32-wasip1 -p atmost-filter

## The filter and the ledger as OCI images, built with umoci, reproducible (docs/istio.md): for NAME
## atmost-filter (Istio's compat variant: one layer with plugin.wasm) and atmost-ledger (the release
## `atmost` and exactly the libraries it loads, CA certificates, user 65532): target/oci/NAME/
## (OCI layout), NAME.tar, NAME.digest.
oci: wasm ledger-release oci-tools
	$(call oci_images,target/oci,target/release/atmost)

## The same recipe over the debug ledger the suites already run, into target/oci-test/ (never
## target/oci, what a rollout pushes): the images the end-to-end suite reads, unpacks and runs.
## The recipe does not depend on how the binary was built, so the suites test it without the
## fat-LTO release build (docs/development.md#what-each-suite-builds).
.PHONY: oci-test
oci-test: wasm ledger oci-tools
	$(call oci_images,target/oci-test,target/debug/atmost)

# $(1): where the two images go; $(2): the ledger binary. A standard OCI tool must read each
# image and see the manifest digest the packager printed.
define oci_images
	$(PYTHON) scripts/oci_image.py --out $(1) filter --wasm $(WASM)
	$(PYTHON) scripts/oci_image.py --out $(1) ledger --binary $(2)
	@for name in atmost-filter atmost-ledger; do \
		test "$$(skopeo inspect --format '{{.Digest}}' oci:$(1)/$$name)" = "$$(cat $(1)/$$name.digest)" || \
			{ echo "oci: skopeo reads another digest for $$name" >&2; exit 1; }; \
	done
endef

# The ledger server (`atmost`) is the crate atmost-ledger-server (ledger/server/), over the
# library atmost-ledger (ledger/: model, decisions, stores).
ledger:
	$(CARGO) build -p atmost-ledger-server

ledger-release:
	$(CARGO) build --release -p atmost-ledger-server

## The ledger with the next schema version's rehearsal (feature schema-rehearsal: one more,
## additive migration), for the rolling-upgrade test: target/debug/atmost-next. The plain
## build follows, so target/debug/atmost keeps the released schema; cargo keeps both compiled
## variants, so a second run only relinks. Never part of a release (ledger-release, oci).
LEDGER_NEXT := target/debug/atmost-next
ledger-next:
	$(CARGO) build -p atmost-ledger-server --features schema-rehearsal
	cp target/debug/atmost $(LEDGER_NEXT)
	$(CARGO) build -p atmost-ledger-server

## The main job: ledger + example MCP server (or UPSTREAM=host:port) + Envoy on 127.0.0.1:10000/mcp.
run: setup-run wasm ledger-release
	ATMOST_BIN=target/release/atmost $(VPY) scripts/run.py

## The quick loop after a change (docs/development.md#which-target-when): `check-rust` (format,
## clippy native and wasm32, every unit and conformance test that needs no network service: the
## SQLite store's; PostgreSQL's need the postgres-tests feature, which `make test-unit` turns on),
## then `check-files` (the checks that read the repository's files: docs, manifests, rules, the
## OCI recipe).
check: check-rust check-files

# Every shipped build has both stores, but each is a cargo feature a team may build alone
# (docs/development.md#one-store-builds): both builds are checked, clippy-clean, on every change.
define ONE_STORE_BUILDS
$(CARGO) clippy -p atmost-ledger-server --no-default-features --features sqlite --all-targets -- -D warnings
$(CARGO) clippy -p atmost-ledger-server --no-default-features --features postgres --all-targets -- -D warnings
endef

check-rust: rust-setup
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy -p atmost-filter --target wasm32-wasip1 -- -D warnings
	$(ONE_STORE_BUILDS)
	$(CARGO) test --workspace

## tests/files: what reads the repository's files and runs local tools on them (kubectl kustomize,
## promtool, umoci and skopeo, schema and CEL validators), with no build output and no process
## to start: doc links and design citations, the manifests rendered and validated, the admission
## policy, the alert rules, the OCI recipe, the table of per-form tests.
.PHONY: check-rust check-files files-tools
files-tools: venv-test oci-tools k8s-tools prometheus-tools

check-files: files-tools
	$(VPY) -m pytest tests/files -q -p no:cacheprovider --timeout 300

## check-rust's plain clippy is not repeated here: the clippy with the PostgreSQL tests compiled
## in checks all of that code and more (nothing is built only without them), and code that only
## those tests use is dead, and refused, in one of the one-store builds.
lint:
	$(CARGO) fmt --all -- --check
	$(ONE_STORE_BUILDS)
	$(CARGO) clippy --workspace --all-targets $(PG_TESTS) -- -D warnings
	$(CARGO) clippy -p atmost-filter --target wasm32-wasip1 -- -D warnings
	@# The fuzz and bench crates are workspaces of their own (cargo-fuzz needs that; the
	@# bench tools stay out of the product's), but fuzz uses the filter's API: it must still
	@# build when that API changes, and both are formatted like the rest.
	$(CARGO) check --manifest-path fuzz/Cargo.toml --lib --tests
	cd fuzz && $(CARGO) fmt --all -- --check
	cd bench && $(CARGO) fmt --all -- --check

fmt:
	$(CARGO) fmt --all
	cd fuzz && $(CARGO) fmt --all
	cd bench && $(CARGO) fmt --all

## The PostgreSQL tests (the store's, and the server's over it) are built with the cargo feature
## postgres-tests of both ledger crates, so `cargo test --workspace` alone needs no database.
## Here they are always on, and need DATABASE_URL: scripts/with-postgres uses it when set, else
## a server at 127.0.0.1:5432 (database test), else a throwaway cluster; it fails if none
## works (the tests never skip).
WITH_PG := scripts/with-postgres
PG_TESTS := --features atmost-ledger/postgres-tests,atmost-ledger-server/postgres-tests

test-unit:
	$(WITH_PG) $(CARGO) test --workspace $(PG_TESTS)

## The end-to-end suite spends most of its time waiting on the processes it starts (a lease to
## run out, an alert's `for`, Envoy's start), so it runs on E2E_WORKERS pytest-xdist workers, a
## test file per worker at a time (`--dist loadfile`: a module's fixtures start once). Every test
## starts its own processes on ports nothing else holds, in temporary directories of its own,
## its PostgreSQL stores in schemas of their own named at random, its pod's network namespaces
## named for it; each worker logs under .run/test-logs/<date>-<run>/<worker>/. E2E_WORKERS=0
## runs it in one process.
E2E_WORKERS ?= 3
E2E_PYTEST := $(VPY) -m pytest -q -p no:cacheprovider --timeout 300 -n $(E2E_WORKERS) --dist loadfile

# The suite asks cargo how it resolves the ledger's features, offline (tests/e2e/test_upgrade.py):
# every package the lock file names is fetched from the registry first, dev-dependencies too.
.PHONY: cargo-fetch
cargo-fetch:
	$(CARGO) fetch --locked --quiet

test-e2e: setup ts-deps wasm ledger-next ledger oci-test cargo-fetch
	ATMOST_BIN=target/debug/atmost ATMOST_NEXT_BIN=$(LEDGER_NEXT) $(WITH_PG) $(E2E_PYTEST) tests/e2e

## The end-to-end suite again, with the filter deployed as istiod renders the shipped WasmPlugin
## (ATMOST_DEPLOYMENT=wasmplugin: request_hold body, no allow_on_headers_stop_iteration) and as
## Envoy Gateway renders the shipped EnvoyExtensionPolicy and BackendTrafficPolicy
## (ATMOST_DEPLOYMENT=envoygateway: request_hold body, the filter enabled per route, zero
## retries). Only the tests whose outcome depends on the form run again: tests/e2e/forms.py names
## them, each with the reason; tests/e2e/test_envoy_gateway.py runs the rest of what Envoy Gateway
## renders (its listener, the ledger cluster, the module served over HTTP).
test-e2e-wasmplugin: setup ts-deps wasm ledger
	ATMOST_DEPLOYMENT=wasmplugin ATMOST_BIN=target/debug/atmost $(WITH_PG) $(E2E_PYTEST) tests/e2e

test-e2e-envoygateway: setup ts-deps wasm ledger
	ATMOST_DEPLOYMENT=envoygateway ATMOST_BIN=target/debug/atmost $(WITH_PG) $(E2E_PYTEST) tests/e2e

## The protocol model (ledger/model/atmost.pml): spin must verify it and refute each mutant.
model-check:
	ledger/model/check.sh

## Every suite, step by step, each step's time printed and the total (scripts/timed-steps); one
## PostgreSQL for all of them (a throwaway one is started once and stopped at the end). Everything
## `make check` runs is in it: `lint` holds check-rust's format and clippy, `test-unit` its tests.
TEST_STEPS := setup lint check-files model-check test-unit test-e2e test-e2e-wasmplugin test-e2e-envoygateway
test:
	@MAKE="$(MAKE)" $(WITH_PG) scripts/timed-steps "make test" $(TEST_STEPS)

## The fault suite: real processes under kill -9, a slow or silent ledger, upstream resets and timeouts,
## client hang-ups, Envoy killed, reloaded or drained mid-call, a failed VM, a full or read-only store,
## PostgreSQL restarts; the hostile-input catalogue; security checks (ends with a scan of every log).
test-faults: setup wasm ledger
	ATMOST_BIN=target/debug/atmost $(WITH_PG) $(VPY) -m pytest tests/faults -q -p no:cacheprovider --timeout 180 -rxs

## The soak (docs/soak.md), not part of `make test`: governed calls at a pod's rate for SOAK_SECONDS
## (default 3600) while a nemesis injects faults at random (kill -9 of a ledger replica, Envoy's hot
## restart, a PostgreSQL failover, a partition between ledger and store, an upstream that cuts its
## answers, clients that hang up, a slow disk); then the history checker over the whole run, the
## counters against a recount, leases, every uncertain attempt against the faults, resident memory.
## Writes target/soak/ (SOAK_OUT): report.md, report.json, rss.png, logs/. SOAK_SEED repeats the draws.
## Needs root for the slow disk (a loop device and a cgroup); elsewhere a stand-in, said in the report.
## `make soak-ci` is the 5-minute form.
.PHONY: soak soak-ci
SOAK_SECONDS ?= 3600
soak: setup-run venv-test wasm ledger
	ATMOST_BIN=target/debug/atmost SOAK_SECONDS=$(SOAK_SECONDS) $(VPY) -m tests.soak.soak

soak-ci:
	$(MAKE) --no-print-directory soak SOAK_SECONDS=300

clean:
	$(CARGO) clean
	rm -rf $(VENV) .run

## Benchmarks, not part of `make test` (method and numbers: docs/performance.md):
## the latency and CPU atmost adds per call at 1 % and 5 % of plain Envoy's ceiling, setups
## B/N/S/S2/C/D0/D/Da/D1k/Dr/Df/E/Ea/E2/E1k/Vp/V, the ledger alone, criterion micro-benchmarks, PASS/FAIL per target.
## Writes target/bench/results.md and results.json. PostgreSQL: its own cluster (Debian's
## PostgreSQL 15 binaries); WITH_PG's server only when those are missing.
.PHONY: bench bench-tools
OHA_VERSION := 1.16.0

bench: setup-run wasm ledger-release bench-tools
	$(WITH_PG) $(VPY) bench/run.py

## What a call costs as the store grows (bench/scale.py, docs/performance.md#as-the-store-grows): each
## store filled to 10^4, 10^6 and 10^7 attempts over 10^5 permits, at each size the calls at 1 % of
## B's ceiling, the ledger alone, table and index sizes; the statements' plans at the largest size.
## Writes target/bench/scale/results.md and results.json. About half an hour on two cores.
.PHONY: bench-scale
bench-scale: setup-run wasm ledger-release bench-tools
	$(WITH_PG) $(VPY) bench/scale.py

## Steady load for half an hour (bench/steady.py, docs/performance.md#under-steady-load): 200 calls/s
## in 30 s windows over 10 permits at a time, each living 5 minutes and then replaced, with a
## 5-minute retention, their history purged 1 minute after expiry, the ledger on PostgreSQL; per window
## the latency, the store's rows and bytes, dead tuples, the pruner's count, the ledger's and
## Envoy's memory and CPU per call. PASS/FAIL per check; target/bench/steady/results.md,
## results.json, latency.png, store.png, memory.png. Knobs: BENCH_STEADY_* (bench/steady.py).
.PHONY: bench-steady
bench-steady: setup-run venv-bench wasm ledger-release bench-tools
	$(WITH_PG) $(VPY) bench/steady.py

## What a call held open for a person's approval costs the gateway (bench/held_calls.py,
## docs/approvals.md#holding-the-call-open): Envoy's CPU per held call and second, and the
## ledger's re-asks, next to Envoy's CPU per governed call in the same run. About a minute.
## Writes target/bench/held/results.md and results.json.
.PHONY: bench-held
bench-held: setup-run venv-test wasm ledger
	$(VPY) bench/held_calls.py

# wrk (Debian) for the ceilings; oha (crates.io, pinned) to cross-check the fixed-rate
# latencies; valgrind (Debian) to count the filter's instructions per call; the stubs, the
# load generator, the call-cost driver and the two reference wasm filters (bench/).
bench-tools: rust-setup
	@command -v wrk >/dev/null 2>&1 || apt-get install -y wrk
	@command -v valgrind >/dev/null 2>&1 || apt-get install -y valgrind
	@test -x target/bench-tools/bin/oha || $(CARGO) install --locked --root target/bench-tools oha@$(OHA_VERSION)
	cd bench && CARGO_TARGET_DIR=../target/bench $(CARGO) build --release -p atmost-bench-stub -p atmost-bench-load
	cd bench && CARGO_TARGET_DIR=../target/bench $(CARGO) build --profile callcost -p atmost-bench-callcost
	cd bench && CARGO_TARGET_DIR=../target/bench $(CARGO) build --profile wasm --target wasm32-wasip1 -p bench-filter-noop -p bench-filter-callout

## Fuzzing (fuzz/, cargo-fuzz + libFuzzer, AddressSanitizer). cargo-fuzz needs nightly
## flags; stable rustc accepts them with RUSTC_BOOTSTRAP=1. FUZZ_SANITIZER=none if the
## ASan runtime is missing. New inputs grow in fuzz/work/ (ignored); fuzz/corpus/ holds
## the committed seeds, fuzz/regressions/ every input that ever crashed.
.PHONY: fuzz fuzz-ci fuzz-setup fuzz-build fuzz-regressions
CARGO_FUZZ_VERSION := 0.13.1
FUZZ_TARGETS := mcp_body fingerprint sse plugin_config plugin_config_structured call_state_machine replay
FUZZ_SECONDS ?= 300
FUZZ_CI_SECONDS ?= 15
FUZZ_SANITIZER ?= address
# Debug assertions and overflow checks on: an overflow that wraps silently in the release
# Wasm build is a crash here.
FUZZ_FLAGS := --sanitizer $(FUZZ_SANITIZER) --debug-assertions
CARGO_FUZZ := RUSTC_BOOTSTRAP=1 $(CARGO) fuzz

fuzz-setup:
	@$(CARGO) fuzz --version 2>/dev/null | grep -q ' $(CARGO_FUZZ_VERSION)$$' || \
		$(CARGO) install cargo-fuzz --locked --version $(CARGO_FUZZ_VERSION)

fuzz-build: fuzz-setup
	cd fuzz && $(CARGO_FUZZ) build $(FUZZ_FLAGS)

## The committed seeds and regression inputs, as plain tests and through the instrumented targets.
## The fingerprint corpus is also compared with the Python rfc8785 package (venv-test has it).
fuzz-regressions: fuzz-build venv-test
	cd fuzz && ATMOST_PYTHON=$(abspath $(VPY)) $(CARGO) test
	@set -e; for t in $(FUZZ_TARGETS); do \
		mkdir -p fuzz/regressions/$$t; \
		(cd fuzz && $(CARGO_FUZZ) run $(FUZZ_FLAGS) $$t corpus/$$t regressions/$$t -- -runs=0); \
	done

# One target for SECONDS_EACH seconds; crashes land in fuzz/artifacts/<target>/. A target with
# a libFuzzer dictionary (fuzz/dict/<target>.dict) runs with it.
fuzz-run-%:
	@mkdir -p fuzz/work/$*
	cd fuzz && $(CARGO_FUZZ) run $(FUZZ_FLAGS) $* work/$* corpus/$* -- \
		-max_total_time=$(SECONDS_EACH) -print_final_stats=1 \
		$(if $(wildcard fuzz/dict/$*.dict),-dict=dict/$*.dict)

## Every target for FUZZ_SECONDS each (default 300), one after another.
fuzz: fuzz-regressions
	@set -e; for t in $(FUZZ_TARGETS); do $(MAKE) --no-print-directory fuzz-run-$$t SECONDS_EACH=$(FUZZ_SECONDS); done
	cd fuzz && ATMOST_PYTHON=$(abspath $(VPY)) $(CARGO) test --test rfc8785_reference

## CI: the regressions, then every target briefly (FUZZ_CI_SECONDS each, FUZZ_CI_JOBS at a time,
## each one's output kept together), then the grown fingerprint corpus against the Python rfc8785
## package. A fuzzer is one process on one core: two at a time on CI's two cores fuzz each target
## as long as one at a time would, in half the wall time.
FUZZ_CI_JOBS ?= 2
fuzz-ci: fuzz-regressions
	@$(MAKE) --no-print-directory -j$(FUZZ_CI_JOBS) --output-sync=target \
		$(addprefix fuzz-run-,$(FUZZ_TARGETS)) SECONDS_EACH=$(FUZZ_CI_SECONDS)
	cd fuzz && ATMOST_PYTHON=$(abspath $(VPY)) $(CARGO) test --test rfc8785_reference
