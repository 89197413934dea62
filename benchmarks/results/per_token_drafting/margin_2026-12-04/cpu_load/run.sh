#!/bin/bash
# CPU load sweep: the default (adaptive, confidence stopping) against off, the plan's margin 0.10 and none taking turns
source /tmp/civenv/bin/activate
export TORCH_EXTENSIONS_DIR=/tmp/ext_main
cd /work/main
for w in code-edit chat; do
  for g in 0.10 0.0; do
    sed -i "s/^MIN_GAIN = [0-9.]*/MIN_GAIN = $g/" specserve/spec/controller.py
    python -m specserve.cli bench offline --workload $w --num-prompts 24 --num-warmups 4 --output-len 128 \
        --speculation none,draft_model:4:adaptive --request-rate-sweep 1,2,inf --rounds 2 --quiet \
        --result-json /tmp/cpusweep/sweep_${g}_${w/-/_}.json > /tmp/cpusweep/sweep_${g}_${w/-/_}.log 2>&1
    echo "$w $g $(date)" >> /tmp/cpusweep/progress.txt
  done
done
sed -i "s/^MIN_GAIN = [0-9.]*/MIN_GAIN = 0.0/" specserve/spec/controller.py
echo done >> /tmp/cpusweep/progress.txt
