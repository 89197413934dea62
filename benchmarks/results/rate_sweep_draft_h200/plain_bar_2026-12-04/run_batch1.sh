#!/bin/bash
# call 4 of the lease (the machine still warm from call 3): the same A/B one request at a time.
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
AB=benchmarks/results/rate_sweep_draft_cpu/plain_bar_2026-12-04/ab_plain_bar.py
T0=$(date +%s)
PYTHONPATH=$PWD timeout 420 python $AB --device cuda --rates batch1 --batch1-prompts 6 --num-warmups 2 \
    --rounds 2 --settings "${SETTINGS:-measured bar;measured level;fit bar}" --json $OUT/ab_gpu_batch1.json > $OUT/ab_gpu_batch1.log 2>&1
echo "batch1 done at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/ab_gpu_batch1.log; tail -3 $OUT/ab_gpu_batch1.log | grep -i error
