#!/bin/bash
# The CPU load sweep on chat, this change ("new") against the committed engine ("old": HEAD's
# specserve/ extracted to ../../../../device_carry_old), one process per engine, taking turns,
# speculation off beside the default in every process. Usage: bash run_ab.sh OUTDIR [N]
set -u
OUT=$1; N=${2:-2}; ROOT=$(cd ../../../.. && pwd); mkdir -p $OUT
for i in $(seq 1 $N); do
  for tree in new old; do
    if [ $tree = old ]; then D=$ROOT/device_carry_old; else D=$ROOT; fi
    (cd $D && PYTHONPATH=$D python -m specserve.cli bench offline --workload chat --num-prompts 24 --num-warmups 4 \
        --output-len 128 --speculation none,draft_model:4:adaptive --request-rate-sweep 0.5,1,2,inf --quiet \
        --result-json $OUT/chat_${tree}$i.json > $OUT/chat_${tree}$i.log 2>&1)
    echo "== $tree $i $(date +%T)"
  done
done
