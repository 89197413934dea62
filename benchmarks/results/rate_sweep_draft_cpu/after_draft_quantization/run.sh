#!/bin/bash
# The sweep of ../README.md at b3ac4fe (the draft's layers in Q4_1, the LM head's sliced GEMM path, the profile change).
cd "$(dirname "$0")"
for w in code-edit chat; do
  specserve bench offline --workload $w --num-prompts 24 --num-warmups 4 --output-len 128 \
      --speculation none,draft_model:4,draft_model:4:adaptive --request-rate-sweep 0.5,1,2,inf \
      --result-json sweep_cpu_${w/-/_}.json > sweep_cpu_${w/-/_}.log 2>&1
done
