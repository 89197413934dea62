#!/bin/bash
# The standard CPU load sweep, the tree before AMX tiles (OLD: a checkout of it, its own
# kernel build) and this one taking turns, one process each:
#   bash run_sweep.sh OLD_CHECKOUT OUT_DIR
set -e
OLD=$1; OUT=$2; mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")/../../.." && pwd)
ARGS="--num-prompts 24 --num-warmups 4 --output-len 128 --speculation none,draft_model:4:adaptive --request-rate-sweep 2,inf --rounds 2"
for wl in chat code-edit; do
  for tree in old new; do
    if [ $tree = old ]; then dir=$OLD; ext=/tmp/ext_old; else dir=$HERE; ext=/tmp/ext_main; fi
    (cd "$dir" && TORCH_EXTENSIONS_DIR=$ext PYTHONPATH=$dir python -m specserve.cli bench offline --workload $wl $ARGS \
        --result-json "$OUT/${wl}_${tree}.json") > "$OUT/${wl}_${tree}.log" 2>&1
    echo "$wl $tree done"
  done
done
