#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU (made for the H200 device machine: no internet, its own
# python3 with JAX + CUDA): the Pallas kernel tests on the GPU and a GPU bench of a made MoE model.
#
#   bash scripts/device_check.sh             # from the repository root (or anywhere: it cds there)
#   bash scripts/device_check.sh --dry-run   # or DEVICE_CHECK_DRY=1: print the steps, check every flag
#                                            # given to strata-jax and pytest exists; runs nothing heavy
#
# Steps, each under its own `timeout`, all inside a budget of DC_BUDGET_S seconds (default 570: under 10
# minutes in all):
#   1. the GPU and the versions (nvidia-smi, python, jax and its CUDA plugin, numpy, triton);
#   2. what the machine lacks, from wheels carried in .whl/ (if that folder exists) into /tmp/site; the
#      repository itself is imported from here (PYTHONPATH=$PWD: nothing to build, the C++ CPU kernels are
#      not needed on a GPU); then every module the run needs must import and JAX must see the GPU;
#   3. tests/test_kernels.py with STRATA_TEST_BACKEND=pallas: every kernel on the GPU's Pallas (Triton)
#      backend and on xla, against gguf's reference;
#   3b. the hybrid family's logits (qwen3next, qwen35moe) through the Pallas kernels on the GPU against
#      transformers (tests/test_hybrid_model.py; needs transformers and torch on the device);
#   4. `strata-jax make-model`: a qwen3moe model with Q4_K experts, 8 layers x 64 experts of 2048 x 768
#      (1.36 GB of experts), into /tmp;
#   5. `strata-jax bench` on it with every expert on the device (--expert-cache auto), then with a device
#      expert cache of a quarter of them (--expert-cache 16 of 64 a layer);
#   5b. the C++ CPU kernels built in place, and the same cache with each miss computed on the host CPU
#      (--host-experts on: experts computed where they live);
#   6. a table of the three.
# The log and the results go to $OUT if set, else ./device-check-out/: device_check.log, kernel_tests.xml,
# hybrid_tests.xml, bench_all.json, bench_cache.json, bench_hybrid.json, results.md. A failed step says so at once (!!! lines); the run goes on
# where a later step can still tell something, and ends with a summary and exit 1 if anything failed.
#
# The wheels: on a machine with pip and the internet, in the repository root (.whl/ is git-ignored):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl gguf==0.19.0
# (gguf is the one package the device image lacked when this was written; step 2 names any other.)
set -uo pipefail

SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
cd "$(dirname "$SELF")/.." || exit 1
DRY=${DEVICE_CHECK_DRY:-0}
for a in "$@"; do
    case $a in
        --dry-run) DRY=1 ;;
        -h|--help) sed -n '2,/^set -uo/p' "$SELF" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "device_check.sh: unknown argument $a (use --dry-run or --help)" >&2; exit 2 ;;
    esac
done
[[ $DRY == 0 ]] || DRY=1
OUTDIR=${OUT:-$PWD/device-check-out}
mkdir -p "$OUTDIR" || exit 1
LOG=$OUTDIR/device_check.log

# Everything this script prints also goes to the log: run the script again under tee (once).
if [[ -z ${_DEVICE_CHECK_LOGGING:-} ]]; then
    export _DEVICE_CHECK_LOGGING=1
    bash "$SELF" "$@" 2>&1 | tee "$LOG"
    exit "${PIPESTATUS[0]}"
fi

PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
BUDGET=${DC_BUDGET_S:-570}
DEADLINE=$((SECONDS + BUDGET))
MODEL=${DC_MODEL:-/tmp/device-check-moe.gguf}
EXPERTS=64
CACHE=$((EXPERTS / 4))
MAKE_ARGS=(--arch qwen3moe --layers 8 --hidden 2048 --heads 16 --kv-heads 4 --head-dim 128
           --experts "$EXPERTS" --experts-used 8 --expert-ffn 768 --vocab 32768 --quant Q4_K --seed 0)
BENCH_ARGS=(--prompt-tokens 512 --decode-tokens 64 --decode-prompt-tokens 32 --parallel-list 1,8
            --bandwidth-gib 1)
PYTEST_ARGS=(-q -p no:cacheprovider -ra --maxfail 30 --junit-xml "$OUTDIR/kernel_tests.xml" tests/test_kernels.py)
FAILED=()

say() { printf '%s\n' "$*"; }
loud() { printf '!!! %s\n' "$*"; }

summary() {
    say ""
    say "=== device check: $(date -Is), $((SECONDS)) s; log and results in $OUTDIR"
    if ((${#FAILED[@]})); then
        loud "FAILED: ${#FAILED[@]} step(s):"
        for f in "${FAILED[@]}"; do loud "  $f"; done
    elif ((DRY)); then
        say "dry run: every step printed, every flag checked: OK"
    else
        say "every step passed"
    fi
}

# step NAME SECONDS critical|go-on COMMAND...: run COMMAND under `timeout`, capped by what is left of the
# budget; a failure is recorded (and, when critical, ends the run).
step() {
    local name=$1 want=$2 kind=$3
    shift 3
    local left=$((DEADLINE - SECONDS))
    local t=$((want < left ? want : left))
    say ""
    say "=== [$(date +%T)] $name (timeout ${t}s, ${left}s of the budget left)"
    printf '+'; printf ' %q' "$@"; printf '\n'
    if ((DRY)); then return 0; fi
    if ((t < 15)); then
        loud "$name: not run, the ${BUDGET}s budget is spent"
        FAILED+=("$name: not run (no time left)")
        [[ $kind == critical ]] && { summary; exit 1; }
        return 1
    fi
    local t0=$SECONDS rc=0
    timeout --kill-after=10 "$t" "$@" || rc=$?
    if ((rc == 0)); then
        say "=== $name: ok in $((SECONDS - t0)) s"
        return 0
    fi
    local why="exit status $rc"
    ((rc == 124 || rc == 137)) && why="timed out after ${t}s"
    loud "$name FAILED ($why)"
    FAILED+=("$name: $why")
    if [[ $kind == critical ]]; then
        summary
        exit 1
    fi
    return 1
}

# check_flags WHAT HELP_TEXT ARGS...: every --flag in ARGS is in HELP_TEXT (argparse's --help)
check_flags() {
    local what=$1 help=$2 a flag bad=0
    shift 2
    for a in "$@"; do
        [[ $a == --* ]] || continue
        flag=${a%%=*}
        if ! grep -qE -- "(^|[ ,\[])${flag}([] ,=]|$)" <<<"$help"; then
            loud "$what has no flag $flag (from $a)"
            bad=1
        fi
    done
    ((bad == 0)) && say "$what: every flag exists: $(printf '%s ' "$@" | grep -oE -- '--[a-z0-9-]+' | sort -u | tr '\n' ' ')"
    return $bad
}

say "=== device check $( ((DRY)) && echo '(dry run) ')in $PWD, $(date -Is), budget ${BUDGET}s, output $OUTDIR"

# ---- 1. the machine ------------------------------------------------------------------------------------
if ((DRY)); then
    say ""
    say "=== 1. the GPU and the versions"
    say "+ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv"
else
    say ""
    say "=== 1. the GPU and the versions"
    timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv \
        || loud "nvidia-smi failed: is there an NVIDIA GPU?"
    timeout 10 nvcc --version 2>/dev/null | tail -n 1 || true
fi
say "+ $PY --version; uname -m; nproc"
$PY --version; uname -m; nproc

# ---- 2. packages and imports ---------------------------------------------------------------------------
export PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" >/dev/null; then
    say "wheels carried in .whl/: $(cd .whl && ls *.whl | tr '\n' ' ')"
    step "install the carried wheels into /tmp/site" 90 critical \
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PWD:/tmp/site
else
    say "no .whl/ folder: nothing to install; every package must already be there"
fi
say "PYTHONPATH=$PYTHONPATH"

HELPER=scripts/device_check.py
if ((DRY)); then
    step "imports and the GPU" 60 critical "$PY" "$HELPER" imports --need-gpu
    say "(here, without the GPU check:)"
    timeout 120 "$PY" "$HELPER" imports || { loud "imports failed here too"; FAILED+=("imports (here)"); }
else
    step "imports and the GPU" 120 critical "$PY" "$HELPER" imports --need-gpu
fi

# Every flag this script gives strata-jax and pytest must exist (checked in both modes, before any work).
say ""
say "=== flags: strata-jax make-model, strata-jax bench, pytest"
preflight_ok=1
MAKE_HELP=$(timeout 120 "$PY" -m strata_jax make-model --help 2>&1) || { loud "make-model --help failed:"; say "$MAKE_HELP"; preflight_ok=0; }
BENCH_HELP=$(timeout 120 "$PY" -m strata_jax bench --help 2>&1) || { loud "bench --help failed:"; say "$BENCH_HELP"; preflight_ok=0; }
PYTEST_HELP=$(timeout 60 "$PY" -m pytest --help 2>&1) || { loud "pytest --help failed"; preflight_ok=0; }
check_flags "strata-jax make-model" "$MAKE_HELP" "${MAKE_ARGS[@]}" || preflight_ok=0
check_flags "strata-jax bench" "$BENCH_HELP" "${BENCH_ARGS[@]}" --expert-cache --host-experts --json || preflight_ok=0
check_flags "pytest" "$PYTEST_HELP" "${PYTEST_ARGS[@]}" || preflight_ok=0
grep -q STRATA_TEST_BACKEND tests/test_kernels.py || { loud "tests/test_kernels.py knows no STRATA_TEST_BACKEND"; preflight_ok=0; }
# The experts must come to at least 1 GB: layers x experts x 3 matrices x hidden x expert_ffn, in Q4_K blocks.
EXPERT_BYTES=$("$PY" "$HELPER" expert-bytes "${MAKE_ARGS[@]}") || { loud "cannot size the experts"; preflight_ok=0; EXPERT_BYTES=0; }
say "the model's experts: $EXPERT_BYTES bytes ($((EXPERT_BYTES / 1000000)) MB); the expert cache: $CACHE of $EXPERTS a layer"
((EXPERT_BYTES >= 1000000000)) || { loud "the experts are under 1 GB"; preflight_ok=0; }
if ((preflight_ok == 0)); then
    FAILED+=("flags / sizes (see the !!! lines above)")
    summary
    exit 1
fi

# ---- 3. kernel tests on the GPU's Pallas backend -------------------------------------------------------
XDIST=()
if "$PY" -c "import xdist" 2>/dev/null; then XDIST=(-n 4); fi   # pytest-xdist: 4 processes share the GPU
if ((DRY)); then
    say ""
    say "=== the kernel tests with STRATA_TEST_BACKEND=pallas collect pallas cases (here, without a GPU they skip):"
    n=$(STRATA_TEST_BACKEND=pallas timeout 120 "$PY" -m pytest --collect-only -q -p no:cacheprovider tests/test_kernels.py 2>&1 | grep -c -- '-pallas\]')
    say "$n pallas cases"
    ((n > 0)) || { loud "no pallas cases collected"; FAILED+=("kernel tests collect no pallas case"); }
fi
step "kernel tests, Pallas backend on the GPU" 180 go-on \
    env STRATA_TEST_BACKEND=pallas XLA_PYTHON_CLIENT_PREALLOCATE=false "$PY" -m pytest "${XDIST[@]}" "${PYTEST_ARGS[@]}"

# ---- 3b. the hybrid family (issue 34): its logits through the GPU's Pallas kernels against transformers ---
# (the oracle needs transformers and torch: carried in .whl/ where the image lacks them, else said and skipped)
if "$PY" -c "import transformers, torch" 2>/dev/null || ((DRY)); then
    step "hybrid (Gated DeltaNet + MoE) logits, Pallas on the GPU, against transformers" 120 go-on \
        env STRATA_TEST_BACKEND=pallas XLA_PYTHON_CLIENT_PREALLOCATE=false "$PY" -m pytest -q -p no:cacheprovider \
        -ra --junit-xml "$OUTDIR/hybrid_tests.xml" tests/test_hybrid_model.py -k pallas_kernels_match_transformers
else
    loud "the hybrid step is not run: transformers and torch do not import here (carry their wheels in .whl/)"
    FAILED+=("hybrid step: transformers/torch missing")
fi

# ---- 4. the MoE model ----------------------------------------------------------------------------------
step "make the MoE model" 120 critical "$PY" -m strata_jax make-model "$MODEL" "${MAKE_ARGS[@]}"
if ((!DRY)); then
    timeout 60 "$PY" -m strata_jax inspect "$MODEL" | head -n 40
fi

# ---- 5. bench: every expert on the device, then a quarter of them in the device cache --------------------
step "bench, every expert on the device" 170 go-on \
    "$PY" -m strata_jax bench "$MODEL" "${BENCH_ARGS[@]}" --expert-cache auto --json "$OUTDIR/bench_all.json"
step "bench, expert cache $CACHE of $EXPERTS" 170 go-on \
    "$PY" -m strata_jax bench "$MODEL" "${BENCH_ARGS[@]}" --expert-cache "$CACHE" --json "$OUTDIR/bench_cache.json"

# ---- 5b. the same cache with its misses computed on the host CPU (--host-experts on, issue 15) -------------
# It needs the C++ CPU kernels, built here in place (g++ and jaxlib's FFI headers); without them, skipped.
if step "build the C++ CPU kernels" 90 go-on "$PY" setup.py -q build_ext --inplace; then
    step "bench, expert cache $CACHE of $EXPERTS, misses on the host" 150 go-on \
        "$PY" -m strata_jax bench "$MODEL" "${BENCH_ARGS[@]}" --expert-cache "$CACHE" --host-experts on \
        --json "$OUTDIR/bench_hybrid.json"
fi

# ---- 6. the table --------------------------------------------------------------------------------------
step "the table" 60 go-on "$PY" "$HELPER" table "$OUTDIR" "$CACHE" "$EXPERTS" "$MODEL"

summary
((${#FAILED[@]} == 0))
