run() { # label old-parts workload rate
  SPECSERVE_OLD=$2 /tmp/devvenv/bin/python /tmp/mb/bench_var.py bench offline --workload $3 --num-prompts 24 --num-warmups 4 --output-len 128 \
      --speculation none,draft_model:4:adaptive --request-rate-sweep $4 --result-json $1.json > $1.log 2>&1
}
O=replan,dropped,firstpass
run codeinf_new_1 "" code-edit inf; run codeinf_old_1 $O code-edit inf
run chat2_old_1 $O chat 2; run chat2_new_1 "" chat 2
run codeinf_old_2 $O code-edit inf; run codeinf_new_2 "" code-edit inf
run chat2_new_2 "" chat 2; run chat2_old_2 $O chat 2
