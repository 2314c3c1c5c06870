#!/usr/bin/env bash
# `make bench-gpu`: the expert-offload benchmark on a GPU machine, in one prepared run.
#
# From a fresh clone, with no venv: the Python packages (bench/gpu_setup.py: the package roots of
# pyproject.toml, the wheels of .bench-gpu/), the CUDA llama-server (carried, --binary FILE[.xz], or
# built for nvidia-smi's compute_cap), the full ds-v2-lite shape, the machine's constants
# (bench/gpu_facts.py), then bench/expert_offload.py at 50%, 25% and 12.5% of the routed experts'
# bytes, with the stock rows b, c, d with and without --load-mode none (pinned), the project's default
# e, e pinned/mmap forced, e with lru, -np 4 concurrent requests (50%), the NVML gauges against
# nvidia-smi (50%), and greedy identity (bench/gpu_identity.py). Made for a machine lent once for a
# few minutes (one H200, 16 cores, no network): every step is timed and has a hard timeout inside
# --budget, and whatever was done comes back under $OUT (else bench/results/gpu_check/): at most 8
# files, the log, steps.tsv, constants.json, offload_50/25/12.json, identity.json.
# The second architecture: the full gpt-oss-20b shape (MXFP4 experts with biases, 32 experts,
# top-4, the model's own router), its greedy identity and the rows a, b, cp, e, ea at 50%
# (offload_gpt-oss.json, identity_gpt-oss.json: with 12.5% in --budgets that is 9 files, one over;
# add --no-gpt-oss). The order puts what no GPU has measured first: 50%, gpt-oss's identity and
# rows, ds-v2-lite's identity, then 25% in what time is left.
#
#   bench/gpu_check.sh                      the GPU check (needs nvidia-smi)
#   bench/gpu_check.sh --llvmpipe           the same steps on Mesa's software Vulkan device, with a
#                                           reduced model: the rehearsal on a machine without a GPU
#   bench/gpu_check.sh --rpc                the rehearsal on ggml's RPC device (the CPU build behind a
#                                           ggml-rpc-server per llama-server), where llvmpipe faults
#   bench/gpu_check.sh --prepare            here, with network: fill .bench-gpu/ with what an
#                                           offline GPU machine lacks (wheels and
#                                           the trimmed llama.cpp source); carry .bench-gpu there
#   bench/gpu_check.sh --setup-only         the Python setup and its import check, then stop
#   bench/gpu_check.sh --binary-only        ... and the binary: unpacked, its libraries found, --version
# Options: --binary PATH (skip the build; PATH may end in .xz: unpacked into the work folder),
# --binary-xz FILE (the same), --layers N (reduce the model), --budget SECONDS (whole check, default
# 540), --budgets "50% 25%" (add 12.5% for 7 slots), --runs N, --tokens N, --no-identity, --no-gpt-oss.
# Environment: GPU_CHECK_PYTHON (the interpreter; default .venv's, else python3), GPU_CHECK_WORK
# (model, unpacked binary, server logs; default $TMPDIR/moe-l2-gpu-check), GPU_CHECK_BENCH_ARGS
# (more arguments for every expert_offload run); for --prepare: PYTHON_VERSIONS ("3.12"), BASE=1
# (also numpy, httpx, pyyaml, tqdm: what the GPU machine has but a bare rehearsal interpreter lacks).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1
MODE=gpu BINARY="" LAYERS="" BUDGET=540 BUDGETS="50% 25%" RUNS="" TOKENS="" IDENTITY=1 SETUP_ONLY=0
BINARY_ONLY=0 GPT_OSS=1
while [ $# -gt 0 ]; do
  case "$1" in
    --llvmpipe) MODE=llvmpipe ;;
    --rpc) MODE=rpc ;;
    --prepare) MODE=prepare ;;
    --setup-only) SETUP_ONLY=1 ;;
    --binary-only) BINARY_ONLY=1 ;;
    --binary|--binary-xz) BINARY=$2; shift ;;
    --layers) LAYERS=$2; shift ;;
    --budget) BUDGET=$2; shift ;;
    --budgets|--cache-bytes) BUDGETS=$2; shift ;;
    --runs) RUNS=$2; shift ;;
    --tokens) TOKENS=$2; shift ;;
    --no-identity) IDENTITY=0 ;;
    --no-gpt-oss) GPT_OSS=0 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "error: unknown option $1 (see $0 --help)" >&2; exit 2 ;;
  esac
  shift
done

# what --prepare collects for an offline machine (git-ignored via .git/info/exclude); GPU_CHECK_PREP: elsewhere
PREP=${GPU_CHECK_PREP:-$REPO/.bench-gpu}
SOURCE_NAME=llama-cpp-source.tar.xz

if [ "$MODE" = prepare ]; then
  # Runs here, where the registries answer. The GPU machine's Python is 3.12 with numpy, httpx, tqdm,
  # pyyaml, torch and nvidia-ml-py; the rest of what the check imports comes as wheels, at the
  # versions this project's venv locks.
  set -e
  mkdir -p "$PREP/whl"
  exclude="$(git rev-parse --git-path info/exclude)"
  mkdir -p "$(dirname "$exclude")"
  grep -qx '/.bench-gpu/' "$exclude" 2>/dev/null || echo '/.bench-gpu/' >>"$exclude"
  PY=${PYTHON:-.venv/bin/python}
  pkgs="pydantic pydantic-core pydantic-settings python-dotenv annotated-types typing-inspection typing-extensions
        gguf prometheus-client nvidia-ml-py"
  if [ "${BASE:-0}" = 1 ]; then
    pkgs="$pkgs numpy pyyaml tqdm httpx httpcore h11 anyio sniffio idna certifi"
  fi
  for pyv in ${PYTHON_VERSIONS:-3.12}; do
    for pkg in $pkgs; do
      version=$("$PY" -c "import importlib.metadata as m; print(m.version('$pkg'))")
      "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyv" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$PREP/whl" "$pkg==$version"
    done
  done
  # The sdist (73 MiB) is over the 64 MiB a device call carries: the trimmed source (8 MiB), which
  # build.py verifies file by file against its pinned manifest (see docs/test-bed.md). Not needed when
  # a binary is carried (NO_SOURCE=1 leaves it out).
  if [ "${NO_SOURCE:-0}" != 1 ] && [ ! -f "$PREP/$SOURCE_NAME" ]; then
    "$PY" -m moe_l2_llama.build --export-source "$PREP/$SOURCE_NAME"
  fi
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
  if [ "$limit" -lt 10 ]; then
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

# A benchmark killed past its timeout's grace leaves its servers (own sessions) behind, holding
# device memory and cores the next step needs: end those, found by this run's model paths.
reap() {
  local pids
  pids=$(pgrep -f -- "--model ($MODEL|$OSS_MODEL)" || true)
  [ -z "$pids" ] && return 0
  say "ending servers left behind: $(echo "$pids" | tr '\n' ' ')"
  for pid in $pids; do kill "$pid" 2>/dev/null; done
  sleep 3
  for pid in $pids; do kill -9 "$pid" 2>/dev/null; done
  return 0
}

finish() {
  say "done in $(($(date +%s) - START))s; results in $OUT_DIR"
  if command -v column >/dev/null; then column -t -s $'\t' "$STEPS"; else cat "$STEPS"; fi | tee -a "$LOG"
  # the server logs stay in $WORK (too many files to come back): their last lines here
  for f in "$WORK"/logs/*/*.log; do
    [ -f "$f" ] || continue
    case "$f" in *-access.log) continue ;; esac
    { echo "== $f (last 12 lines)"; tail -n 12 "$f"; } >>"$LOG"
  done
  exit "${1:-0}"
}

# -- 1. Python: the project's venv if there is one, else the machine's python3 + what it lacks ----
setup_python() {
  if [ -n "${GPU_CHECK_PYTHON:-}" ]; then PY=$GPU_CHECK_PYTHON
  elif [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"
  else PY=$(command -v python3); fi
  # the package roots from the one list there is (pyproject.toml); a hand-written copy here missed two
  local roots root pp=""
  roots=$("$PY" bench/gpu_setup.py roots) || return 1
  for root in $roots; do pp="$pp${pp:+:}$REPO/$root"; done
  export PYTHONPATH="$pp${PYTHONPATH:+:$PYTHONPATH}"
  if "$PY" bench/gpu_setup.py check >"$WORK/check.out" 2>&1; then cat "$WORK/check.out"; return 0; fi
  echo "before the wheels: $(grep -c '^error: ' "$WORK/check.out") of the modules do not import"
  local site="$WORK/site" wheels=("$PREP"/whl/*.whl)
  if [ ! -e "${wheels[0]}" ]; then
    echo "error: no wheels in $PREP/whl (bench/gpu_check.sh --prepare where a registry answers)"; return 1
  fi
  rm -rf "$site"
  "$PY" bench/gpu_setup.py install "$site" "${wheels[@]}" || return 1
  export PYTHONPATH="$PYTHONPATH:$site"
  "$PY" bench/gpu_setup.py check
}
say "mode $MODE, budget ${BUDGET}s, out $OUT_DIR, work $WORK"
T0=$SECONDS
setup_python >"$WORK/setup.out" 2>&1  # not through a pipe: its exports must reach this shell
rc=$?
tee -a "$LOG" <"$WORK/setup.out"
printf 'python\t%s\t%s\n' $((SECONDS - T0)) "$rc" >>"$STEPS"
if [ "$rc" -ne 0 ]; then
  say "error: the Python packages are missing and could not be installed (see $LOG)"; finish 1
fi
say "python: $PY; PYTHONPATH=$PYTHONPATH"
[ "$SETUP_ONLY" = 1 ] && finish 0

case "$MODE" in
  gpu) BACKEND=cuda ;;
  rpc) BACKEND=rpc ;;
  *) BACKEND=vulkan ;;
esac

# -- 2. the model, written in the background while the binary is unpacked or built ----------------
if [ "$MODE" != gpu ] && [ -z "$LAYERS" ]; then LAYERS=4; fi
MODEL="$WORK/ds-v2-lite${LAYERS:+-$LAYERS}.gguf"
SHAPE_ARGS=(--shape ds-v2-lite)
[ -n "$LAYERS" ] && SHAPE_ARGS+=(--layers "$LAYERS" --vocab 8192)
# the second architecture: gpt-oss-20b (12.1 GB, as released), 2 layers in a rehearsal
OSS_MODEL="$WORK/gpt-oss-20b${LAYERS:+-2}.gguf"
OSS_ARGS=(--shape gpt-oss-20b)
[ -n "$LAYERS" ] && OSS_ARGS+=(--layers 2 --vocab 8192)
MODEL_PID="" OSS_PID=""
if [ "$GPT_OSS" = 1 ] && [ ! -f "$OSS_MODEL" ] && [ "$BINARY_ONLY" = 0 ]; then
  run_step model-gpt-oss 200 "$PY" -m moe_l2_ops.cli make-demo-model "${OSS_ARGS[@]}" "$OSS_MODEL" &
  OSS_PID=$!
fi
if [ -f "$MODEL" ]; then
  say "model: $MODEL (already there)"
elif [ "$BINARY_ONLY" = 0 ]; then
  # 9.5 GB: 36 s on the 2-core development machine (page-cache writes, one core)
  run_step model 150 "$PY" -m moe_l2_ops.cli make-demo-model "${SHAPE_ARGS[@]}" "$MODEL" &
  MODEL_PID=$!
fi

# -- 3. the llama-server for this device ----------------------------------------------------------
if [ -n "$BINARY" ]; then
  if [[ "$BINARY" == *.xz ]]; then
    # a binary carried compressed (a device call carries 64 MiB): unpacked with Python's lzma, which
    # every interpreter has, unlike the xz tool
    mkdir -p "$WORK/bin"
    run_step unpack 90 "$PY" -c 'import lzma, shutil, sys, os
with lzma.open(sys.argv[1]) as src, open(sys.argv[2] + ".tmp", "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 22)
os.chmod(sys.argv[2] + ".tmp", 0o755)
os.replace(sys.argv[2] + ".tmp", sys.argv[2])' "$BINARY" "$WORK/bin/llama-server" || finish 1
    if [ "$MODE" = rpc ]; then  # the RPC build's device server, carried beside it
      run_step unpack-rpc 90 "$PY" -c 'import lzma, shutil, sys, os
with lzma.open(sys.argv[1]) as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 22)
os.chmod(sys.argv[2], 0o755)' "$(dirname "$BINARY")/ggml-rpc-server.xz" "$WORK/bin/ggml-rpc-server" || finish 1
    fi
    BINARY="$WORK/bin/llama-server"
  fi
  [ -x "$BINARY" ] || { say "error: --binary $BINARY is not an executable file"; finish 2; }
else
  if [ -z "${MOE_L2_LLAMA_SDIST:-}${MOE_L2_LLAMA_SOURCE:-}" ] && [ -f "$PREP/$SOURCE_NAME" ]; then
    export MOE_L2_LLAMA_SOURCE="$PREP/$SOURCE_NAME"
  fi
  if [ "$MODE" = gpu ]; then
    command -v nvidia-smi >/dev/null || { say "error: no nvidia-smi: not a GPU machine (use --llvmpipe)"; finish 2; }
    ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
    BUILD_ARGS=(--cuda --arch "$ARCH")
  elif [ "$MODE" = rpc ]; then
    BUILD_ARGS=(--rpc)
  else
    BUILD_ARGS=(--vulkan)
  fi
  # --test-hooks: the benchmark replays the ESFT routing through the route-trace hook
  run_step build 450 nice -n 10 "$PY" -m moe_l2_llama.build "${BUILD_ARGS[@]}" --test-hooks -j "$(nproc)" || finish 1
  BINARY=$(grep -E '^/.*llama-server$' "$LOG" | tail -1)
  [ -x "$BINARY" ] || { say "error: the build printed no binary path"; finish 1; }
fi
say "llama-server: $BINARY"

# The CUDA binary needs libcublas.so.13 and libcublasLt.so.13 (built against the PyPI wheel, whose
# folder on the build machine is its RUNPATH) and libcudart.so.13 (the toolkit's). Where the loader
# cannot find one, the folders of the nvidia-* wheels on Python's path and of the CUDA toolkit go
# into LD_LIBRARY_PATH, each only if it holds a missing library.
fix_libraries() {
  command -v ldd >/dev/null || return 0
  local missing lib dir found
  missing=$(ldd "$BINARY" 2>/dev/null | awk '/not found/ {print $1}' | sort -u)
  [ -z "$missing" ] && { say "libraries: ldd finds every one"; return 0; }
  say "libraries not found: $(echo "$missing" | tr '\n' ' ')"
  local dirs
  dirs=$({
    for py in "$PY" python3; do
      "$py" -c 'import os, sys
for p in sys.path:
    for sub in ("nvidia/cublas/lib", "nvidia/cu13/lib", "nvidia/cuda_runtime/lib"):
        if os.path.isdir(os.path.join(p, sub)): print(os.path.join(p, sub))' 2>/dev/null
    done
    ls -d /usr/local/cuda/lib64 /usr/local/cuda/targets/*/lib /usr/local/cuda-*/lib64 \
      /usr/local/cuda-*/targets/*/lib 2>/dev/null
    # last: libraries carried from the build machine (e.g. libgomp.so.1, which ggml-cpu links)
    ls -d "$PREP/lib" 2>/dev/null
  } | awk '!seen[$0]++')
  for lib in $missing; do
    found=""
    for dir in $dirs; do
      if [ -e "$dir/$lib" ]; then found=$dir; break; fi
    done
    if [ -n "$found" ]; then
      case ":${LD_LIBRARY_PATH:-}:" in *":$found:"*) ;; *) export LD_LIBRARY_PATH="$found${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;; esac
    fi
  done
  missing=$(ldd "$BINARY" 2>/dev/null | awk '/not found/ {print $1}' | tr '\n' ' ')
  say "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}; still not found: ${missing:-none}"
}
fix_libraries
run_step version 60 "$BINARY" --version || { say "error: $BINARY does not run (see $LOG)"; wait; finish 1; }
[ "$BINARY_ONLY" = 1 ] && finish 0

if [ -n "$MODEL_PID" ]; then
  wait "$MODEL_PID" || { say "error: the model was not written (see $LOG)"; finish 1; }
fi
if [ -n "$OSS_PID" ] && ! wait "$OSS_PID"; then
  say "the gpt-oss model was not written (see $LOG): its steps are left out"; GPT_OSS=0
fi

# -- 4. the machine's constants, before any server holds the device ---------------------------------
run_step constants 60 "$PY" bench/gpu_facts.py constants --out "$OUT_DIR/constants.json"

# -- 5. the benchmark at each budget, then greedy identity ------------------------------------------
# the ESFT routing ids travel with the repo (bench/data/routing, bench/data_paths.py)
COMMON=(--binary "$BINARY" --model "$MODEL" --backend "$BACKEND" --constants "$OUT_DIR/constants.json")
if [ "$MODE" = gpu ]; then
  # 3 runs x 64 tokens, as p50/p25/p12 of 2026-12-04 (44-90 s a run there); all servers load at once
  # Three servers load at a time: on the H200 of 2026-12-04 sixteen loading at once (ten of them pinning
  # 4-8 GiB of host memory each) had none ready after 150 s, while two or three at a time were each ready
  # in 6-40 s (bench/data/gpu-2026-12-04-dev/README.md)
  COMMON+=(--runs "${RUNS:-3}" --tokens "${TOKENS:-64}" --start-timeout 150 --request-timeout 120 --start-jobs 3)
  CONCURRENT=4
  ID_ARGS=(--prompts 6 --tokens 48 --slots "7,32")
  # caps per step (s): 50% has 11 rows and 2 -np 4 servers, 25% (and 12.5% if asked) 9 rows; identity 7
  CAPS=(230 130 90) ID_CAP=110
  OSS_CONFIGS=a,b,cp,e,ea
  # gpt-oss: identity on 2 prompts x 32 tokens at 8 and 16 of 32 slots; 5 rows of 1 run x 32 tokens
  OSS_ID_ARGS=(--prompts 2 --tokens 32 --slots "8,16") OSS_RUN=(--runs 1 --tokens 32) OSS_ID_CAP=70 OSS_CAP=100
else
  # The rehearsals (llvmpipe, RPC): one short run of each config, on 2 cores. llvmpipe's MUL_MAT_ID
  # faults on batches of 3-8 rows (docs/test-bed.md): 10-word prompts there (11 tokens and more; 2 words
  # made 3 tokens of some prompts, and two stock servers died on them, 2026-12-06), no -np 2, no a.
  # Their "device" memory is host memory: a 256 MiB margin a server, not a GPU's 1 GiB, lets the 13
  # servers of the 50% run pass the fit check on a 23 GiB machine.
  WORDS=2
  [ "$MODE" = llvmpipe ] && WORDS=10
  COMMON+=(--runs "${RUNS:-1}" --tokens "${TOKENS:-4}" --prompt-words "$WORDS" --start-jobs 2 --device-margin-mib 256)
  CONCURRENT=2
  [ "$MODE" = rpc ] && CONCURRENT=4  # no fault on the RPC device: the GPU's -np 4
  ID_ARGS=(--prompts 2 --tokens 4 --prompt-words "$WORDS" --slots "7,32")
  [ "$MODE" = llvmpipe ] && ID_ARGS=(--prompts 2 --tokens 4 --prompt-words "$WORDS" --slots "32")
  CAPS=(600 600 600) ID_CAP=600
  OSS_ID_ARGS=(--prompts 2 --tokens 4 --prompt-words "$WORDS" --slots "8,16") OSS_RUN=() OSS_ID_CAP=600 OSS_CAP=600
  OSS_CONFIGS=a,b,cp,e,ea
  # llvmpipe: a server's warm-up takes ~2 min on one thread there: identity at 16 slots, and b against ea
  if [ "$MODE" = llvmpipe ]; then
    OSS_ID_ARGS=(--prompts 2 --tokens 4 --prompt-words "$WORDS" --slots "16") OSS_CONFIGS=b,ea OSS_ID_CAP=900 OSS_CAP=900
  fi
  # llvmpipe on one thread (docs/test-bed.md) warms 11 servers up in ~7 min on 2 cores: a rehearsal's steps
  # get the time they need (with --budget to match); the GPU's caps above are what the lent machine runs
  [ "$MODE" = llvmpipe ] && CAPS=(1500 1000 1000) ID_CAP=900
fi
read -r -a EXTRA <<<"${GPU_CHECK_BENCH_ARGS:-}"
STOCK="b,bp,c,cp,dp"  # d (mmap'd copies, 10.7 tok/s on the H200) only at the first budget: never the best
i=0
run_budget() {  # run_budget SHARE CAP: one expert_offload run; the first budget has the most rows
  local share=$1 cap=$2 name configs more=()
  name=$(echo "$share" | tr -d '%' | cut -d. -f1)
  if [ "$i" -eq 0 ]; then
    # e is the cache with --moe-cache-cpu-misses auto; ea the project's default, --moe-cache-bytes auto at the
    # same bytes (whole layers and the cache, patch 0020); eo: e's misses all copied, ec: all on the CPU.
    # Not by default (time): ecm (the mapping's misses on the CPU), el (lru) after the first budget,
    # d (mmap'd copies, never the best), ep (e pins by itself now),
    # ed (the mapping without the ring) and en (one queue), both measured on 2026-12-04, er (pinned refused: its
    # log line); GPU_CHECK_BENCH_ARGS="--configs ..." replaces the list
    configs="a,b,bp,c,cp,dp,e,ea,eh,eo,ec,em,el"
    # llvmpipe: a server's warm-up on a 9-token prompt takes ~2 min on one thread, so the rehearsal runs
    # the rows that exercise every path (stock, pinned stock, the cache, the default) and --rpc the full
    # list; a: a 33-token prompt took 15 min there
    [ "$MODE" = llvmpipe ] && configs="b,cp,e,ea"
    more=(--concurrent "$CONCURRENT" --concurrent-configs "cp,e" --gauges)
    # llvmpipe: no -np 2 (2026-12-06: the stock cp -np 2 server died there of lavapipe's heap corruption,
    # "malloc(): unsorted double linked list corrupted", on two 3-token prompts); --rpc rehearses -np 4
    [ "$MODE" = llvmpipe ] && more=(--gauges)
  else
    configs="$STOCK,e,ea,eh,eo,ec,em"
    [ "$MODE" = llvmpipe ] && configs="b,cp,e,ea"
  fi
  run_step "bench-$name" "$cap" "$PY" bench/expert_offload.py "${COMMON[@]}" --cache-bytes "$share" \
    --configs "$configs" "${more[@]}" --log-dir "$WORK/logs/offload_$name" \
    --out "$OUT_DIR/offload_$name.json" "${EXTRA[@]}"
  reap
}
# gpt-oss: the model's own router (the ESFT trace is DeepSeek-V2-Lite's 64 experts and top-6), so the
# rows measure the mechanisms on near-uniform routing, the cache's worst case. --no-repack: the CPU backend
# repacks MXFP4 host experts into its own layout, which no device reads (the llvmpipe rehearsal's ea said
# "expert cache off: ... repacked for the CPU's own kernels" and ran without its cache)
run_gpt_oss() {
  [ "$GPT_OSS" = 1 ] || return 0
  if [ "$IDENTITY" = 1 ]; then
    run_step identity-gpt-oss "$OSS_ID_CAP" "$PY" bench/gpu_identity.py --binary "$BINARY" --model "$OSS_MODEL" \
      --backend "$BACKEND" "${OSS_ID_ARGS[@]}" --no-repack --log-dir "$WORK/logs/identity_gpt-oss" \
      --out "$OUT_DIR/identity_gpt-oss.json"
    reap
  fi
  run_step bench-gpt-oss "$OSS_CAP" "$PY" bench/expert_offload.py "${COMMON[@]}" --model "$OSS_MODEL" \
    "${OSS_RUN[@]}" --cache-bytes 50% --configs "$OSS_CONFIGS" --trace none --no-repack \
    --log-dir "$WORK/logs/offload_gpt-oss" \
    --out "$OUT_DIR/offload_gpt-oss.json" "${EXTRA[@]}"
  reap
}
read -r -a SHARES <<<"$BUDGETS"
for share in "${SHARES[@]}"; do
  run_budget "$share" "${CAPS[$i]:-100}"
  i=$((i + 1))
  if [ "$i" -eq 1 ]; then  # what no GPU has measured before the second budget: gpt-oss, then identity
    run_gpt_oss
    if [ "$IDENTITY" = 1 ]; then
      run_step identity "$ID_CAP" "$PY" bench/gpu_identity.py --binary "$BINARY" --model "$MODEL" \
        --backend "$BACKEND" "${ID_ARGS[@]}" --log-dir "$WORK/logs/identity" --out "$OUT_DIR/identity.json"
      reap
    fi
  fi
done
FAILED=$(awk -F'\t' 'NR > 1 && $3 != 0 {n++} END {print n + 0}' "$STEPS")
finish $((FAILED > 0))
