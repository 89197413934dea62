#!/bin/bash
# call 4 (the machine still warm from run_final.sh): the same A/B with the engines made in another
# order (is a setting's figure its engine's place in the process?), chat only.
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
AB=benchmarks/results/rate_sweep_draft_cpu/plain_bar_2026-12-04/ab_plain_bar.py
T0=$(date +%s)
PYTHONPATH=$PWD timeout 300 python $AB --device cuda --workloads chat --rates inf,256 --num-prompts 192 --num-warmups 64 \
    --num-kv-blocks 4096 --rounds 3 --settings "main;fit bar;measured bar" --json $OUT/ab_gpu_order.json > $OUT/ab_gpu_order.log 2>&1
echo "done at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/ab_gpu_order.log; tail -3 $OUT/ab_gpu_order.log | grep -i error
