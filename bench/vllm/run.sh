#!/usr/bin/env bash
# kvfleet against vLLM's CPU build on the `small` model (float32), one engine at a time (`make bench-vs-vllm`):
#   1. serving: each server in turn under `kvfleet bench serve` at each rate (Poisson arrivals, streamed
#      completions, prompts 16-256 tokens, outputs 16-128, ignore_eos), about a minute per run;
#   2. offline throughput and decode step time at batch 1 and 8: the same plan through kvfleet's `LLM`
#      and `vllm.LLM` (runtime/bench/engine_measure.py measures both);
#   3. with NEIGHBOUR=busy, step 2 again beside a busy loop pinned to one core (NEIGHBOUR_CPU), as when
#      another process shares the machine;
#   4. the table in docs/benchmarks.md, between its markers.
# Every process started here is stopped by its PID (its whole process group: vLLM's engine processes too),
# also when a step fails or the run is interrupted.
#
# Environment: VLLM_PYTHON (required) the vLLM environment's python; KVFLEET the kvfleet command;
# BENCH_DIR where the model and the result files go; PORT; RATES; SECONDS_PER_RUN; STEPS the parts to run
# ("serve offline", or one of them); NEIGHBOUR ("busy" adds step 3); NEIGHBOUR_CPU (0: the core vLLM's CPU
# build binds its model's thread to on 2 CPUs).
set -euo pipefail
# Python puts the working directory first on sys.path, and from the checkout its operator/ folder would shadow
# the standard library's `operator` in every Python process vLLM starts (its model inspection runs
# `python -m ...`).
export PYTHONSAFEPATH=1

: "${VLLM_PYTHON:?set VLLM_PYTHON to the python of the vLLM environment}"
KVFLEET=${KVFLEET:-kvfleet}
BENCH_DIR=${BENCH_DIR:-${KVFLEET_CACHE:-$HOME/.cache/kvfleet}/bench-vs-vllm}
PORT=${PORT:-8017}
RATES=${RATES:-4 8}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-60}
STEPS=${STEPS:-serve offline}
NEIGHBOUR=${NEIGHBOUR:-}
NEIGHBOUR_CPU=${NEIGHBOUR_CPU:-0}
case $NEIGHBOUR in
    "" | busy) ;;
    *) echo "NEIGHBOUR is busy or empty, not $NEIGHBOUR" >&2 && exit 2 ;;
esac
for step in $STEPS; do
    [[ $step == serve || $step == offline ]] || { echo "STEPS names serve and offline, not $step" >&2 && exit 2; }
done
# The same for both engines: sequences per step, and GiB of KV cache (131,072 tokens of the small model).
MAX_NUM_SEQS=64
KV_CACHE_GIB=1
REPO=$(cd "$(dirname "$0")/../.." && pwd)
MODEL=$BENCH_DIR/small
RESULTS=$BENCH_DIR/results

# Stops the process group a PID leads (started with setsid): TERM, then KILL after 30 s.
stop_group() {
    local pid=$1
    kill -TERM -- "-$pid" 2>/dev/null || true
    for _ in $(seq 30); do
        kill -0 -- "-$pid" 2>/dev/null || break
        sleep 1
    done
    kill -KILL -- "-$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

server_pid=""
stop_server() {
    [[ -n $server_pid ]] || return 0
    stop_group "$server_pid"
    server_pid=""
}
neighbour_pid=""
stop_neighbour() {
    [[ -n $neighbour_pid ]] || return 0
    stop_group "$neighbour_pid"
    neighbour_pid=""
}
trap 'stop_server; stop_neighbour' EXIT
trap 'exit 130' INT TERM

note_load() { echo "$1 $(cut -d' ' -f1-3 /proc/loadavg)" >>"$RESULTS/load.txt"; }

# Starts a server in its own process group (setsid), so that stopping the group stops its children too.
start_server() {
    local log=$1
    shift
    setsid "$@" >"$log" 2>&1 &
    server_pid=$!
    for _ in $(seq 900); do
        if ! kill -0 "$server_pid" 2>/dev/null; then
            echo "the server exited while starting; its log, $log, ends with:" >&2
            tail -n 20 "$log" >&2
            exit 1
        fi
        # Ready once it completes a request: a server may answer other routes while its engine loads.
        curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
            -d '{"model": "small", "prompt": [16, 17, 18], "max_tokens": 1}' >/dev/null && return 0
        sleep 1
    done
    echo "the server did not answer within 900 s; see $log" >&2
    exit 1
}

serve_runs() {
    local engine=$1 rate
    for rate in $RATES; do
        note_load "$engine-serve-$rate"
        # Prompts 16-256 tokens, outputs 16-128: means 136 and 72 with these spreads.
        "$KVFLEET" bench serve --base-url "http://127.0.0.1:$PORT" --num-prompts $((rate * SECONDS_PER_RUN)) \
            --request-rate "$rate" --random-input-len 136 --random-output-len 72 \
            --random-range-ratio '{"input": 0.88, "output": 0.77}' --vocab-size "$VOCAB_SIZE" --seed 0 \
            --temperature 0 --num-warmups 2 --disable-tqdm --label "$engine $rate req/s" \
            --save-result --result-dir "$RESULTS" --result-filename "serve-$engine-$rate.json"
    done
}

# Both engines on the same plan, one after the other; SUFFIX names the result files of this round.
offline_runs() {
    local suffix=$1
    note_load "kvfleet-offline$suffix"
    "$KVFLEET" bench engine-timing --model "$MODEL" --plan "$RESULTS/plan.json" \
        --result-json "$RESULTS/engine-kvfleet$suffix.json" --max-num-seqs $MAX_NUM_SEQS \
        --cpu-kv-cache-space $KV_CACHE_GIB
    note_load "vllm-offline$suffix"
    "$VLLM_PYTHON" -P "$REPO/bench/vllm/engine_timing.py" --plan "$RESULTS/plan.json" \
        --result-json "$RESULTS/engine-vllm$suffix.json" >"$RESULTS/vllm-offline$suffix.log" 2>&1 \
        || { tail -n 20 "$RESULTS/vllm-offline$suffix.log" >&2; exit 1; }
}

mkdir -p "$BENCH_DIR"
rm -rf "$RESULTS" && mkdir -p "$RESULTS"
[[ -f $MODEL/config.json ]] || "$KVFLEET" make-model --arch llama --preset small --seed 0 "$MODEL"
VOCAB_SIZE=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["vocab_size"])' "$MODEL/config.json")

if [[ " $STEPS " == *" serve "* ]]; then
    echo "== vLLM server"
    start_server "$RESULTS/vllm-server.log" env VLLM_CPU_KVCACHE_SPACE=$KV_CACHE_GIB "$VLLM_PYTHON" -P \
        -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name small --dtype float32 \
        --max-num-seqs $MAX_NUM_SEQS --host 127.0.0.1 --port "$PORT"
    serve_runs vllm
    stop_server

    echo "== kvfleet server"
    start_server "$RESULTS/kvfleet-server.log" "$KVFLEET" serve --model "$MODEL" --served-model-name small \
        --dtype float32 --max-num-seqs $MAX_NUM_SEQS --cpu-kv-cache-space $KV_CACHE_GIB --host 127.0.0.1 \
        --port "$PORT"
    serve_runs kvfleet
    stop_server
fi

if [[ " $STEPS " == *" offline "* ]]; then
    echo "== offline throughput and decode step time"
    offline_runs ""
    if [[ $NEIGHBOUR == busy ]]; then
        echo "== the same beside a busy loop on CPU $NEIGHBOUR_CPU"
        echo "$NEIGHBOUR_CPU" >"$RESULTS/neighbour-cpu.txt"
        setsid taskset -c "$NEIGHBOUR_CPU" python3 -c 'while True: pass' &
        neighbour_pid=$!
        offline_runs -neighbour
        stop_neighbour
    fi
fi
note_load end

"$KVFLEET" bench vs-vllm-report --results "$RESULTS" --doc "$REPO/docs/benchmarks.md" \
    --commit "$(git -C "$REPO" rev-parse --short HEAD)"
