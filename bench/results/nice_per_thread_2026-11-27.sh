# The per-thread CPU-priority experiment behind docs/serving-profile.md (2026-11-27 13:40 UTC, Intel Xeon 2 cores):
# bash THIS '--mode colocated' 'ray::EngineService' colo   (stops its own server group at the end)
#!/bin/bash
# usage: nice3.sh MODEFLAGS ENGINEPATTERN TAG. Per-thread niceness (Linux nice is per thread).
# A: as started; B: every engine thread at 0; C: B + every thread of the serve actors/haproxy at 19
M=/root/.cache/pdserve/models/gguf-SmolLM2-135M-Instruct.Q4_1-a81b0b986a7f
PY=/work/main/.venv/bin/python
cd /work/main
FLAGS=$1; PAT=$2; TAG=$3
setsid $PY -m pdserve serve --model $M $FLAGS --port 8000 > /tmp/exp/n3_$TAG.log 2>&1 &
SPID=$!
for i in $(seq 1 150); do curl -sf localhost:8000/health >/dev/null && break; sleep 2; done
B="$PY -m pdserve bench --base-url http://127.0.0.1:8000/v1 --input-len 256 --output-len 64 --range-ratio 0 --max-concurrency 8 --ignore-eos"
$B --num-requests 16 --seed 100 >/dev/null 2>&1
ENG=$(pgrep -f "$PAT" | tr '\n' ' ')
SERVE=$(pgrep -f "ray::ServeReplica|ray::ProxyActor|ray::HAProxy|ray::ServeController|haproxy" | tr '\n' ' ')
declare -A ORIG
for p in $ENG $SERVE; do for t in $(ls /proc/$p/task); do ORIG[$t]=$(ps -o ni= -q $t 2>/dev/null | tr -d ' '); [ -z "${ORIG[$t]}" ] && ORIG[$t]=$(awk '{print $19}' /proc/$p/task/$t/stat); done; done
echo "$TAG engines: $ENG serve: $SERVE"
for p in $ENG $SERVE; do echo "$p: $(for t in $(ls /proc/$p/task); do awk '{printf "%s ", $19}' /proc/$p/task/$t/stat; done)"; done
setn() { for t in $(ls /proc/$1/task 2>/dev/null); do renice -n $2 -p $t >/dev/null 2>&1; done; }
for round in 1 2; do
  for v in A B C; do
    for p in $ENG $SERVE; do for t in $(ls /proc/$p/task); do renice -n ${ORIG[$t]:-15} -p $t >/dev/null 2>&1; done; done
    if [ $v != A ]; then for p in $ENG; do setn $p 0; done; fi
    if [ $v = C ]; then for p in $SERVE; do setn $p 19; done; fi
    $B --num-requests 48 --seed $round > /tmp/exp/n3_$TAG$v$round.out 2>&1
    echo "$TAG $v r$round $(grep -E 'Output token throughput' /tmp/exp/n3_$TAG$v$round.out | awk '{print $NF}') tok/s; TPOT p50 $(grep -E '^TPOT' /tmp/exp/n3_$TAG$v$round.out | awk '{print $3}'); TTFT p50 $(grep -E '^TTFT' /tmp/exp/n3_$TAG$v$round.out | awk '{print $3}')"
  done
done
kill -INT -- -$SPID; sleep 10; kill -9 -- -$SPID 2>/dev/null; sleep 3
