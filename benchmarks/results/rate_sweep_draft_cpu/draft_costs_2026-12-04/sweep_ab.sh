#!/bin/bash
source /tmp/civenv/bin/activate
run() { # tree ext tag
  cd $1 && TORCH_EXTENSIONS_DIR=$2 PYTHONPATH=$1 python -m specserve.cli bench offline --workload chat --num-prompts 24 --num-warmups 4 --output-len 128 --speculation none,draft_model:4:adaptive --request-rate-sweep 2,inf --rounds 2 --result-json /tmp/s43/sw3_$3.json 2>&1 | grep -A4 "by round" > /tmp/s43/sw3_$3.log
}
for r in 1 2 3; do
  run /tmp/old43 /tmp/ext_old old_$r
  run /tmp/g43 /tmp/ext_g g_$r
  run /work/main /tmp/ext_main both_$r
done
echo done
