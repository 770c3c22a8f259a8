#!/usr/bin/env bash
# Model-checks ledger/model/atmost.pml with spin: the model, and its variant with the
# versioned write (VERSIONED_WRITE), must each verify with no error and no unreached code (a
# property that holds because nothing happens proves nothing), and each mutant (a ledger
# check switched off; `+` joins the switches of one mutant) must yield a counterexample,
# whose trail is replayed, trimmed, into target/model/<mutant>.trail.txt. Exits non-zero
# otherwise.
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
model="$root/ledger/model/atmost.pml"
out="$root/target/model"
variants=(real VERSIONED_WRITE)
mutants=(NO_ROUND_CHECK NO_CAPABILITY_CHECK NO_ATOMIC_RESERVE VERSIONED_WRITE+NO_VERSION_CHECK APPROVAL_REUSABLE)

# The spin flags of a variant or mutant: "real" none, else -D for each `+`-joined switch.
flags() {
    [ "$1" = real ] && return 0
    local IFS=+ f out=""
    for f in $1; do out="$out -D$f"; done
    echo "$out"
}

command -v spin >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq spin; }
command -v gcc >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq gcc; }

mkdir -p "$out"

# Builds the verifier for one variant in its own directory: $1 name, $2 extra spin flags.
build() {
    local dir="$out/$1"
    rm -rf "$dir" && mkdir -p "$dir"
    cp "$model" "$dir/atmost.pml"
    (cd "$dir" && spin $2 -a atmost.pml >/dev/null && gcc -O2 -DSAFETY -DCOLLAPSE -w -o pan pan.c)
}

# The real model (or a variant): exhaustive, so no depth cut-off, no memory exhaustion,
# nothing unreached but the ends of the processes' endless loops.
real() {
    local v="$1"
    build "$v" "$(flags "$v")"
    cd "$out/$v"
    local t0=$SECONDS
    ./pan -m10000 >pan.out 2>&1 || true
    echo "model-check: $([ "$v" = real ] && echo "real model" || echo "variant $v") ($((SECONDS - t0)) s):"
    grep -E "errors:|states, stored|total actual memory" pan.out | sed 's/^/  /'
    grep -q "errors: 0$" pan.out || { cat pan.out; echo "model-check: FAIL: the real model has an error"; return 1; }
    if grep -qE "max search depth too small|out of memory|Search not completed" pan.out; then
        cat pan.out; echo "model-check: FAIL: the search was not exhaustive"; return 1
    fi
    local unreached
    unreached="$(sed -n '/^unreached in/,/^pan: elapsed/p' pan.out | grep -E '^\s+atmost.pml:' | grep -v '"-end-"' || true)"
    if [ -n "$unreached" ]; then
        echo "$unreached"; echo "model-check: FAIL: model code never reached"; return 1
    fi
}

# One mutant: the shortest counterexample (iterative deepening), an assertion of the model.
mutant() {
    local m="$1"
    build "$m" "$(flags "$m")"
    cd "$out/$m"
    local t0=$SECONDS
    ./pan -i -m200 >pan.out 2>&1 || true
    if ! grep -q "assertion violated" pan.out || [ ! -f atmost.pml.trail ]; then
        cat pan.out; echo "model-check: FAIL: mutant $m found no counterexample"; return 1
    fi
    # The replay, kept to the steps that change the store, the upstream or the reports.
    spin $(flags "$m") -t -p atmost.pml 2>&1 \
        | grep -E '(aState|aRound|reached|execA|known|pend|slots|upAtt|upAns)\[?[^]=]*\]? = |assertion violated|failed assertion' \
        | grep -vE 'upAtt\[id\] = 0|upAns\[id\] = 0' \
        | sed -E 's/^ *([0-9]+):\s+proc +[0-9]+ \(([A-Za-z]+):1\) atmost.pml:([0-9]+) \(state [0-9]+\)\s+/\1 \2 l.\3 /' \
        | grep -E '^[0-9]+ |^spin:' >trail.txt || true
    cp trail.txt "$out/$m.trail.txt"
    echo "model-check: mutant $m: counterexample ($((SECONDS - t0)) s): $(grep -m1 -o 'assertion violated.*' pan.out | cut -c1-100)"
}

status=0
# Each exhaustive search in the background on a core of its own (they are the long part), the
# mutants' short searches beside them.
real_pids=()
for v in "${variants[@]}"; do
    (real "$v") >"$out/$v.log" 2>&1 &
    real_pids+=($!)
done
for m in "${mutants[@]}"; do
    (mutant "$m") || status=1
done
for pid in "${real_pids[@]}"; do
    wait "$pid" || status=1
done
for v in "${variants[@]}"; do cat "$out/$v.log"; done
[ "$status" -eq 0 ] && echo "model-check: OK" || echo "model-check: FAILED"
exit "$status"
