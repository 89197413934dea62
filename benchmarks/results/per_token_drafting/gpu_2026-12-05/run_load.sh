#!/bin/bash
# Call 4 of a lease (the wheel installed by call 3): the standard GPU load sweep, off and the
# default taking turns, two rounds, one process per workload.
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
T0=$(date +%s)
for w in chat code-edit; do
  PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/root/ext timeout 280 python -m specserve.cli bench offline --device cuda --workload $w --num-prompts 192 --num-warmups 64 \
      --output-len 128 --num-kv-blocks 4096 --speculation none,draft_model:4:adaptive --request-rate-sweep 64,256,inf \
      --rounds 2 --quiet --result-json $OUT/sweep_${w/-/_}.json > $OUT/sweep_${w/-/_}.log 2>&1
  echo "== $w at $(( $(date +%s) - T0 )) s"; grep -v "^\s*$" $OUT/sweep_${w/-/_}.log | grep "|" | tail -16
done
tail -3 $OUT/sweep_*.log | grep -i "error\|Trace"
