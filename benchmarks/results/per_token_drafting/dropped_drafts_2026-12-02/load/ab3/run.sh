run() { # label old-parts
  SPECSERVE_OLD=$2 /tmp/devvenv/bin/python /tmp/mb/bench_var.py bench offline --workload code-edit --num-prompts 24 --num-warmups 4 --output-len 128 \
      --speculation none,draft_model:4:adaptive --request-rate-sweep inf --result-json $1.json > $1.log 2>&1
}
run replan_1 replan; run dropped_1 dropped; run dropped_2 dropped; run replan_2 replan
