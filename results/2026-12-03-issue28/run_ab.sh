#!/usr/bin/env bash
# Before/after benchmarks for issue 28, alternating baseline (d6101a2) and main.
set -u
OUT=/work/bench/results
PY=/work/main/.venv/bin/python
OE=/work/main/.venv/bin/offload-engine
run() {  # label tree cmd...
  local label=$1 tree=$2; shift 2
  sync; echo 3 > /proc/sys/vm/drop_caches
  echo "=== $label $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
  (cd $tree && PYTHONPATH=$tree "$@" > $OUT/$label.json 2> $OUT/$label.err)
  echo "    rc=$? end $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
}
B=/work/baseline; A=/work/main
$OE bench disk --path /work/bench/io --json > $OUT/profile.json 2>&1
for i in 1 2; do
  run io-before-$i $B $OE bench io --path /work/bench/io --size 1GiB --runs 3 --json
  run io-after-$i  $A $OE bench io --path /work/bench/io --size 1GiB --runs 3 --json
done
for i in 1 2; do
  run store-before-$i $B $PY tools/bench_store.py --path /work/bench/io --state 4GiB --cpu-budget 1GiB --bucket 64MiB --steps 3 --fio-runs 3
  run store-after-$i  $A $PY tools/bench_store.py --path /work/bench/io --state 4GiB --cpu-budget 1GiB --bucket 64MiB --steps 3 --fio-runs 3
done
for i in 1 2; do
  run cons-before-$i $B $PY tools/bench_consolidate.py --path /work/bench/cons --checkpoint /work/bench/ds270m --deepspeed-python /work/dsvenv/bin/python --runs 3 --fio-runs 3
  run cons-after-$i  $A $PY tools/bench_consolidate.py --path /work/bench/cons --checkpoint /work/bench/ds270m --deepspeed-python /work/dsvenv/bin/python --runs 3 --fio-runs 3
done
echo "=== done $(date -u +%H:%M:%S)" >&2
# third round: for i in 3; do
# third round:   run io-before-$i $B $OE bench io --path /work/bench/io --size 1GiB --runs 3 --json
# third round:   run io-after-$i  $A $OE bench io --path /work/bench/io --size 1GiB --runs 3 --json
# third round: done
# third round: for i in 3; do
# third round:   run store-before-$i $B $PY tools/bench_store.py --path /work/bench/io --state 4GiB --cpu-budget 1GiB --bucket 64MiB --steps 3 --fio-runs 3
# third round:   run store-after-$i  $A $PY tools/bench_store.py --path /work/bench/io --state 4GiB --cpu-budget 1GiB --bucket 64MiB --steps 3 --fio-runs 3
# third round: done
# third round: echo "=== done $(date -u +%H:%M:%S)" >&2
