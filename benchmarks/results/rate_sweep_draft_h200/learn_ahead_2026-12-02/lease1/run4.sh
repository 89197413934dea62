#!/bin/bash
# call 4 (the machine still warm from call 3): load sweeps, off against the default, in rounds, new and base
ln -sfn ../kernels specserve/kernels; ln -sfn ../drafts specserve/drafts
T0=$(date +%s)
sweep() {  # label root workload
  (cd $2 && PYTHONPATH=$2 timeout 140 python -m specserve.cli bench offline \
      --device cuda --workload $3 --num-prompts 576 --num-warmups 64 --output-len 128 --speculation none,draft_model:4:adaptive \
      --request-rate-sweep 256,inf --rounds 2 --quiet --result-json $OUT/sweep_$1_$3.json > $OUT/sweep_$1_$3.log 2>&1)
  grep "by round" -A4 $OUT/sweep_$1_$3.log | grep "^| draft" | sed "s/^/$1 $3 /"
  echo "  at $(( $(date +%s) - T0 )) s"
}
sweep new $PWD chat
sweep base /root/base chat
sweep new $PWD code-edit
sweep base /root/base code-edit
