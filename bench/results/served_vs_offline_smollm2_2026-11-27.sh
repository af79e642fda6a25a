#!/bin/bash
# The served side of docs/serving-profile.md "Corrected": usage: served_vs_offline_smollm2_2026-11-27.sh CHECKOUT LABEL
# (CHECKOUT: a git worktree of the side to measure; /tmp/ab/hook/sitecustomize.py drops the venv's editable finder).
# usage: ab_omp.sh DIR LABEL  -- served SmolLM2, one colocated worker, c8, 48 x 256/64, from checkout DIR
DIR=$1; LABEL=$2
M=/root/.cache/pdserve/models/gguf-SmolLM2-135M-Instruct.Q4_1-a81b0b986a7f
PY=/work/main/.venv/bin/python
export PYTHONPATH=$DIR:/tmp/ab/hook
cd $DIR
setsid $PY -m pdserve serve --model $M --mode colocated --port 8000 > /tmp/exp/ab_serve_$LABEL.log 2>&1 &
SPID=$!
for i in $(seq 1 150); do curl -sf localhost:8000/health >/dev/null && break; sleep 2; done
B="$PY -m pdserve bench --base-url http://127.0.0.1:8000/v1 --input-len 256 --output-len 64 --range-ratio 0 --max-concurrency 8 --ignore-eos"
$B --num-requests 16 --seed 100 >/dev/null 2>&1
$B --num-requests 48 --seed 1 > /tmp/exp/ab_bench_$LABEL.out 2>&1
echo "$LABEL $(grep -E 'Output token throughput' /tmp/exp/ab_bench_$LABEL.out | awk '{print $NF}') tok/s; TPOT p50 $(grep -E '^TPOT' /tmp/exp/ab_bench_$LABEL.out | awk '{print $3}') ms"
kill -INT -- -$SPID; sleep 10; kill -9 -- -$SPID 2>/dev/null; sleep 2
