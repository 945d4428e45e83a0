#!/usr/bin/env bash
# tools/gpu_check.sh: the accelerator check, for a machine with one NVIDIA GPU (< 5 minutes).
#
#   tools/gpu_check.sh               run every part; exit status 0 only if all passed
#   tools/gpu_check.sh --dry-run     print the plan and check what can be checked without a GPU
#   tools/gpu_check.sh --skip-bench  parts 1-2 only
#   PYTHON=/opt/conda/bin/python tools/gpu_check.sh
#
# What the machine must have: a Python (${PYTHON:-python3}) with a CUDA build of torch,
# pluggy and pytest installed. Nothing is downloaded (such machines have no network):
# zero3 comes from this checkout (with tools/, whose _train package holds the benchmark's
# model), installed with
#     pip install --no-deps --no-build-isolation --no-index -e packages/zero3-{comm,core,hooks,optim} -e tools
# into a venv made with --system-site-packages (so it uses the machine's CUDA torch), when
# hatchling (the packages' build backend) is installed; otherwise the same sources are put
# on PYTHONPATH. cupy (for cupy-nccl) is used if installed, and skipped, saying so, if not.
#
# Parts (each timed, each PASS / FAIL / SKIP in the summary):
#   1. comm tests on nccl, then on cupy-nccl, at world 1
#      (packages/zero3-comm/tests/test_accelerator_backends.py)
#   2. engine parity at world 1 on CUDA against plain PyTorch: fp32, then bf16 parameters
#      with fp32 masters, then bf16 with offload_optimizer cpu (masters stepped on the
#      host; tools/gpu_check.py parity)
#   3. step time of plain PyTorch, FSDP2 and zero3 on the GPU, fresh processes, rounds
#      interleaved (tools/gpu_check.py bench)
# Without a CUDA device it stops at once, saying why (exit status 2).
set -uo pipefail
cd "$(dirname "$0")/.."

dry_run=0
skip_bench=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) dry_run=1 ;;
        --skip-bench) skip_bench=1 ;;
        -h | --help) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $arg (see --help)" >&2; exit 2 ;;
    esac
done

PY="${PYTHON:-python3}"
start=$SECONDS
failures=0
summary=()
# World-of-one runs: no launcher variables may leak in from the calling shell.
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT GROUP_RANK

say() { printf '\n== %s\n' "$*"; }

# run_part NAME TIMEOUT_S COMMAND...: run (or, dry, print) one part and record its outcome.
run_part() {
    local name=$1 limit=$2
    shift 2
    if [ "$dry_run" = 1 ]; then
        printf '[dry-run] %-16s (limit %ss):' "$name" "$limit"
        printf ' %q' "$@"
        printf '\n'
        return 0
    fi
    say "$name"
    local t0=$SECONDS status
    timeout "$limit" "$@"
    status=$?
    local took=$((SECONDS - t0))
    if [ "$status" = 0 ]; then
        summary+=("PASS  $name (${took} s)")
    else
        [ "$status" = 124 ] && echo "gpu_check.sh: $name ran past its ${limit} s limit" >&2
        summary+=("FAIL  $name (exit $status, ${took} s)")
        failures=$((failures + 1))
    fi
}

skip_part() {
    summary+=("SKIP  $1 ($2)")
    [ "$dry_run" = 1 ] && printf '[dry-run] %-16s skipped: %s\n' "$1" "$2"
    return 0
}

# -- 0. the machine ----------------------------------------------------------------------------
say "machine"
if ! command -v "$PY" >/dev/null 2>&1; then
    echo "gpu_check.sh: no Python at '$PY'; set PYTHON=/path/to/python (with CUDA torch)" >&2
    exit 2
fi
if ! "$PY" - <<'EOF'; then
import sys
try:
    import torch
except ImportError as exc:
    sys.exit(f"gpu_check.sh: torch is not importable ({exc}); it must be preinstalled (CUDA build)")
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA build {torch.version.cuda}")
if not torch.cuda.is_available():
    sys.exit("gpu_check.sh: no CUDA device: torch.cuda.is_available() is False "
             f"(CUDA build: {torch.version.cuda or 'none, a CPU-only torch'})")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}")
EOF
    if [ "$dry_run" = 0 ]; then
        exit 2
    fi
    echo "(dry run: a real run stops here)"
fi
missing=$("$PY" -c 'import importlib.util as u; print(" ".join(m for m in ("pluggy", "pytest") if u.find_spec(m) is None))')
if [ -n "$missing" ]; then
    echo "gpu_check.sh: missing Python packages: $missing (install them from local wheels:" \
        "pip install --no-index --find-links DIR $missing)" >&2
    [ "$dry_run" = 0 ] && exit 2
fi

# -- install zero3 from this checkout, offline ---------------------------------------------
PACKAGES=(packages/zero3-comm packages/zero3-core packages/zero3-hooks packages/zero3-optim tools)
use_sources() {
    local src=""
    for p in "${PACKAGES[@]}"; do src="$src${src:+:}$PWD/$p/src"; done
    export PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}"
    echo "zero3 runs from this checkout's sources ($1): PYTHONPATH=$src"
}
if "$PY" -c 'import hatchling' >/dev/null 2>&1; then
    venv="${TMPDIR:-/tmp}/zero3-gpu-check-venv"
    editable=()
    for p in "${PACKAGES[@]}"; do editable+=(-e "$p"); done
    if [ "$dry_run" = 1 ]; then
        echo "[dry-run] install: $PY -m venv --clear --system-site-packages $venv &&" \
            "$venv/bin/python -m pip install --no-deps --no-build-isolation --no-index ${editable[*]}"
        use_sources "dry run"
    elif "$PY" -m venv --clear --system-site-packages "$venv" \
        && "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation --no-index \
            "${editable[@]}"; then
        echo "zero3 installed (editable, no dependencies, no network) into $venv"
        PY="$venv/bin/python"
    else
        use_sources "the editable install failed"
    fi
else
    use_sources "hatchling, the packages' build backend, is not installed"
fi

# -- 1. comm tests at world 1 --------------------------------------------------------------
TESTS=packages/zero3-comm/tests/test_accelerator_backends.py
run_part "comm nccl" 150 "$PY" -m pytest -q -rs -p no:cacheprovider "$TESTS" -k "nccl and not cupy"
if "$PY" -c 'import cupy, sys; sys.exit(0 if cupy.is_available() else 1)' >/dev/null 2>&1; then
    run_part "comm cupy-nccl" 150 "$PY" -m pytest -q -rs -p no:cacheprovider "$TESTS" -k cupy
else
    skip_part "comm cupy-nccl" "cupy is not installed or sees no GPU (pip install cupy-cuda12x needs a wheel)"
fi

# -- 2. engine parity at world 1 ------------------------------------------------------------
run_part "parity fp32" 120 "$PY" tools/gpu_check.py parity --dtype fp32 --layers 4
run_part "parity bf16" 120 "$PY" tools/gpu_check.py parity --dtype bf16 --layers 4
run_part "parity offload" 120 "$PY" tools/gpu_check.py parity --dtype bf16 --layers 4 --offload-optimizer cpu

# -- 3. step timing ---------------------------------------------------------------------------
if [ "$skip_bench" = 1 ]; then
    skip_part "bench" "--skip-bench"
else
    run_part "bench" 240 "$PY" tools/gpu_check.py bench --rounds 2
fi

if [ "$dry_run" = 1 ]; then
    bash -n "$0" && "$PY" -m py_compile tools/gpu_check.py && "$PY" tools/gpu_check.py --help >/dev/null \
        && echo "[dry-run] the script parses and tools/gpu_check.py imports: OK"
    exit $?
fi

say "summary ($((SECONDS - start)) s)"
printf '%s\n' "${summary[@]}"
[ $((SECONDS - start)) -gt 300 ] && echo "note: the check took more than its 5-minute budget"
exit $((failures > 0))
