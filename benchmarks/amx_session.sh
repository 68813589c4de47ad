#!/usr/bin/env bash
# Everything the project still needs from an Intel CPU with AMX (issues 11 item 5, 15, 16), in one
# run, for the session that first gets such a machine. Run from the repository root with nothing
# else running (timings are real):
#
#     bash benchmarks/amx_session.sh            # ~45-60 min on 2 cores
#
# Steps (each writes under bench-results/amx/ and prints its figures; see docs/benchmarks.md for
# what each one answers):
#   1. the AMX-bf16 latency profile the project ships, evaluated (issue 16 item 3, issue 11 item 5),
#      with 1 thread, then an evaluation with the default threads;
#   2. the simulated robustness grid on it (issue 16 item 3);
#   3. the real-engine spot checks at its worst, median and best points (issue 16 item 3);
#   4. engine speed vs HF transformers in bf16 (issue 15 targets: decode >= 1.5x at batch 1 and 32,
#      prefill >= 1.3x at 512 tokens);
#   5. the peer comparison with llama.cpp's llama-server built on this machine (issue 15 item 4).
# Commit benchmarks/profiles/amx-bf16-smollm2-135m.json and record the figures in docs/benchmarks.md.
set -euo pipefail

PY=${PY:-.venv/bin/python}
LASER=${LASER:-.venv/bin/laser}
OUT=bench-results/amx
PROFILE=benchmarks/profiles/amx-bf16-smollm2-135m.json
mkdir -p "$OUT"

if ! grep -q -w amx_bf16 /proc/cpuinfo; then
    echo "amx_session.sh: this CPU has no amx_bf16 flag (lscpu); it measures an AMX machine only" >&2
    exit 2
fi
[ -x "$PY" ] || make setup

echo "== 1. AMX-bf16 profile (1 thread), evaluated"
"$LASER" profile --dtype bfloat16 --threads 1 --kv-cache-gib 1 --output "$PROFILE" --evaluate \
    --json "$OUT/profile-eval-t1.json"
echo "== 1b. evaluation with the default threads (a profile of its own, not shipped)"
"$LASER" profile --dtype bfloat16 --kv-cache-gib 1 --output "$OUT/profile-default-threads.json" --evaluate \
    --json "$OUT/profile-eval-default.json"

echo "== 2. robustness grid on the AMX profile [SIMULATED]"
"$PY" benchmarks/robustness.py --quick --kinds amx-bf16 --budgets 32,64,128,256 --json "$OUT/robustness-amx.json"

echo "== 3. real-engine spot checks at the grid's worst, median and best points"
"$PY" benchmarks/robustness_engine.py "$OUT/robustness-amx.json" --kind amx-bf16 --seconds 240 --calibrate \
    --json "$OUT/robustness-engine-amx.json"

echo "== 4. engine speed vs HF transformers, bf16, 1 thread"
"$PY" benchmarks/engine_speed.py --dtype bfloat16 --threads 1 --repeats 3 --json "$OUT/engine-speed-bf16.json"

echo "== 5. llama.cpp's llama-server vs laser serve on the same workload"
"$PY" benchmarks/build_llama_server.py
"$PY" benchmarks/llamacpp_compare.py --json "$OUT/llamacpp-compare.json"

echo "done: commit $PROFILE; record $OUT/*.json in docs/benchmarks.md (say: Intel AMX, bf16, quiet machine)"
