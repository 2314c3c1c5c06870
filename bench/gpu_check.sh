#!/usr/bin/env bash
# `make bench-gpu`: the expert-offload benchmark on a GPU machine, in one prepared run.
#
# From a fresh clone: the Python packages the benchmark needs, the CUDA llama-server for this GPU's
# architecture (nvidia-smi's compute_cap), the full ds-v2-lite shape, the ESFT route trace when the
# trace patch exists, then bench/expert_offload.py and its table. Made for a machine lent once for
# a few minutes (one H200, 16 cores, maybe no network): every step is timed and has a hard timeout,
# and whatever was done comes back under $OUT (else bench/results/gpu_check/): the log, the steps'
# times (steps.tsv), the benchmark's JSON, the server logs of a failed start.
#
#   bench/gpu_check.sh                      the GPU check (needs nvidia-smi)
#   bench/gpu_check.sh --llvmpipe           the same steps on Mesa's software Vulkan device, with a
#                                           reduced model: the rehearsal on a machine without a GPU
#   bench/gpu_check.sh --prepare            here, with network: fill .bench-gpu/ with what an
#                                           offline GPU machine lacks (wheels, the ESFT routing npz,
#                                           the trimmed llama.cpp source); carry .bench-gpu there
# Options: --binary PATH (skip the build), --layers N (reduce the model), --budget SECONDS (whole
# check, default 570), --cache-bytes SIZE (default 50%), --runs N, --tokens N.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1
MODE=gpu BINARY="" LAYERS="" BUDGET=570 CACHE_BYTES="50%" RUNS="" TOKENS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --llvmpipe) MODE=llvmpipe ;;
    --prepare) MODE=prepare ;;
    --binary) BINARY=$2; shift ;;
    --layers) LAYERS=$2; shift ;;
    --budget) BUDGET=$2; shift ;;
    --cache-bytes) CACHE_BYTES=$2; shift ;;
    --runs) RUNS=$2; shift ;;
    --tokens) TOKENS=$2; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "error: unknown option $1 (see $0 --help)" >&2; exit 2 ;;
  esac
  shift
done

PREP="$REPO/.bench-gpu"  # what --prepare collects for an offline machine (git-ignored via .git/info/exclude)
SOURCE_NAME=llama-cpp-source.tar.xz

if [ "$MODE" = prepare ]; then
  # Runs here, where the registries answer. The GPU machine's Python is 3.12 with numpy, httpx,
  # tqdm and pyyaml; the rest of what the benchmark imports comes as wheels.
  set -e
  mkdir -p "$PREP/whl"
  grep -qx '/.bench-gpu/' .git/info/exclude 2>/dev/null || echo '/.bench-gpu/' >>.git/info/exclude
  PY=${PYTHON:-.venv/bin/python}
  for pkg in pydantic pydantic-core pydantic-settings python-dotenv annotated-types typing-inspection \
             typing-extensions gguf; do
    version=$("$PY" -c "import importlib.metadata as m; print(m.version('$pkg'))")
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$PREP/whl" "$pkg==$version"
  done
  esft="${MOE_L2_ROUTING_DATA:-$REPO/../shared/data/routing}/deepseek-ai__ESFT/esft_routing_ids_DERIVED.npz"
  [ -f "$esft" ] && cp "$esft" "$PREP/"
  # The sdist (73 MiB) is over the 64 MiB a device call carries: the trimmed source (8 MiB), which
  # build.py verifies file by file against its pinned manifest (see docs/test-bed.md)
  "$PY" -m moe_l2_llama.build --export-source "$PREP/$SOURCE_NAME"
  du -sh "$PREP"/* ; du -sh "$PREP"; exit 0
fi

OUT_DIR=${OUT:-$REPO/bench/results/gpu_check}
WORK=${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/moe-l2-gpu-check}
mkdir -p "$OUT_DIR" "$WORK"
LOG="$OUT_DIR/gpu_check.log"
STEPS="$OUT_DIR/steps.tsv"
: >"$LOG"
printf 'step\tseconds\texit\n' >"$STEPS"
START=$(date +%s)
export PYTHONUNBUFFERED=1

say() { echo "[gpu_check $(($(date +%s) - START))s] $*" | tee -a "$LOG"; }
left() { echo $((BUDGET - ($(date +%s) - START))); }

# run_step NAME CAP CMD...: CMD under a hard timeout of CAP seconds (less if the budget is shorter),
# its output in the log and on the terminal, its time and exit status in steps.tsv.
run_step() {
  local name=$1 cap=$2; shift 2
  local limit; limit=$(left)
  [ "$cap" -lt "$limit" ] && limit=$cap
  if [ "$limit" -lt 5 ]; then
    say "$name: skipped, the budget of ${BUDGET}s is spent"
    printf '%s\t0\tskipped\n' "$name" >>"$STEPS"
    return 124
  fi
  say "$name (timeout ${limit}s): $*"
  local t0=$SECONDS rc
  timeout -k 15 "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\n' "$name" $((SECONDS - t0)) "$rc" >>"$STEPS"
  say "$name: exit $rc after $((SECONDS - t0))s"
  return "$rc"
}

finish() {
  say "done in $(($(date +%s) - START))s; results in $OUT_DIR"
  column -t -s $'\t' "$STEPS" | tee -a "$LOG"
  exit "${1:-0}"
}

# -- 1. Python: the project's venv if there is one, else the machine's python3 + what it lacks ----
setup_python() {
  if [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"; return 0; fi
  PY=$(command -v python3)
  export PYTHONPATH="$REPO/shared:$REPO/services/llama${PYTHONPATH:+:$PYTHONPATH}"
  if "$PY" -c 'import pydantic_settings, gguf, httpx, numpy, yaml, tqdm' 2>/dev/null; then return 0; fi
  local site="$WORK/site"
  if [ -d "$PREP/whl" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$PREP"/whl/*.whl || return 1
  else
    "$PY" -m pip install -q --target "$site" pydantic pydantic-settings gguf || return 1
  fi
  export PYTHONPATH="$PYTHONPATH:$site"
  "$PY" -c 'import pydantic_settings, gguf, httpx, numpy, yaml, tqdm'
}
say "mode $MODE, budget ${BUDGET}s, out $OUT_DIR, work $WORK"
setup_python >>"$LOG" 2>&1
rc=$?
printf 'python\t%s\t%s\n' $(($(date +%s) - START)) "$rc" >>"$STEPS"
if ! "$PY" -c 'import moe_l2_llama.build, moe_l2_gguf.index' 2>>"$LOG"; then
  say "error: the Python packages are missing and could not be installed (see $LOG)"; finish 1
fi
say "python: $PY"

# -- 2. the model, written in the background while the server compiles (one core against many) ----
if [ "$MODE" = llvmpipe ] && [ -z "$LAYERS" ]; then LAYERS=4; fi
MODEL="$WORK/ds-v2-lite${LAYERS:+-$LAYERS}.gguf"
SHAPE_ARGS=(--shape ds-v2-lite)
[ -n "$LAYERS" ] && SHAPE_ARGS+=(--layers "$LAYERS" --vocab 8192)
MODEL_PID=""
if [ -f "$MODEL" ]; then
  say "model: $MODEL (already there)"
else
  run_step model 300 "$PY" -m moe_l2_ops.cli make-demo-model "${SHAPE_ARGS[@]}" "$MODEL" &
  MODEL_PID=$!
fi

# -- 3. the llama-server for this device ----------------------------------------------------------
if [ -n "$BINARY" ]; then
  [ -x "$BINARY" ] || { say "error: --binary $BINARY is not an executable file"; finish 2; }
else
  if [ -z "${MOE_L2_LLAMA_SDIST:-}${MOE_L2_LLAMA_SOURCE:-}" ] && [ -f "$PREP/$SOURCE_NAME" ]; then
    export MOE_L2_LLAMA_SOURCE="$PREP/$SOURCE_NAME"
  fi
  if [ "$MODE" = gpu ]; then
    command -v nvidia-smi >/dev/null || { say "error: no nvidia-smi: not a GPU machine (use --llvmpipe)"; finish 2; }
    ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
    say "GPU: $(nvidia-smi --query-gpu=name,memory.total,memory.free --format=csv,noheader | head -1), arch $ARCH"
    BUILD_ARGS=(--cuda --arch "$ARCH")
    "$PY" -m moe_l2_llama.build --help 2>/dev/null | grep -q -- '--arch' || BUILD_ARGS=(--cuda --cuda-architectures "$ARCH")
  else
    BUILD_ARGS=(--vulkan)
  fi
  run_step build 450 nice -n 10 "$PY" -m moe_l2_llama.build "${BUILD_ARGS[@]}" -j "$(nproc)" || finish 1
  BINARY=$(grep -E '^/.*llama-server$' "$LOG" | tail -1)
  [ -x "$BINARY" ] || { say "error: the build printed no binary path"; finish 1; }
fi
say "llama-server: $BINARY"
if [ -n "$MODEL_PID" ]; then
  wait "$MODEL_PID" || { say "error: the model was not written (see $LOG)"; finish 1; }
fi

# -- 4. the benchmark (it makes the ESFT trace itself when the trace patch exists) -----------------
if [ -z "${MOE_L2_ROUTING_DATA:-}" ] && [ -f "$PREP/esft_routing_ids_DERIVED.npz" ]; then
  mkdir -p "$WORK/routing/deepseek-ai__ESFT"
  ln -sf "$PREP/esft_routing_ids_DERIVED.npz" "$WORK/routing/deepseek-ai__ESFT/"
  export MOE_L2_ROUTING_DATA="$WORK/routing"
fi
BENCH_ARGS=(--binary "$BINARY" --model "$MODEL" --cache-bytes "$CACHE_BYTES" --out "$OUT_DIR/expert_offload.json")
if [ "$MODE" = gpu ]; then
  BENCH_ARGS+=(--backend cuda --runs "${RUNS:-5}" --tokens "${TOKENS:-64}" --start-timeout 240)
else
  # llvmpipe's device kernels run ~0.5 s a token and the trace splits every MoE layer: one short
  # run of each config keeps the rehearsal inside its budget (2 runs x 8 tokens did not, 2026-12-02)
  BENCH_ARGS+=(--backend vulkan --runs "${RUNS:-1}" --tokens "${TOKENS:-4}" --prompt-words 2)
fi
# GPU_CHECK_BENCH_ARGS: more arguments for the benchmark (e.g. "--prompt-words 10 --configs b,c,d,e")
read -r -a EXTRA <<<"${GPU_CHECK_BENCH_ARGS:-}"
BENCH_ARGS+=("${EXTRA[@]}")
# whatever is left, less a few seconds to write the results; SIGTERM makes it report the runs done
run_step bench $(($(left) - 10)) "$PY" bench/expert_offload.py "${BENCH_ARGS[@]}"
rc=$?
finish "$rc"
