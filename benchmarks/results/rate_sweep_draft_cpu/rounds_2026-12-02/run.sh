#!/bin/bash
# CPU load sweep of the default (adaptive, draft stopping by confidence) against speculation off, three rounds
source /tmp/devvenv/bin/activate
cd /work/main
for w in code-edit chat; do
  specserve bench offline --workload $w --num-prompts 24 --num-warmups 4 --output-len 128 \
      --speculation none,draft_model:4:adaptive --request-rate-sweep 0.5,1,2,inf --rounds 3 --quiet \
      --result-json /tmp/cpusweep/sweep_cpu_${w/-/_}.json > /tmp/cpusweep/sweep_cpu_${w/-/_}.log 2>&1
  date
done
