cd /tmp/rs2
source /tmp/devvenv/bin/activate
export TORCH_EXTENSIONS_DIR=/tmp/dev_ext2
specserve bench offline --workload chat --num-prompts 24 --num-warmups 4 --output-len 128 \
      --speculation none,draft_model:4,draft_model:4:adaptive --request-rate-sweep 0.5,1,2,inf \
      --result-json sweep_cpu_chat.json > sweep_cpu_chat.log 2>&1
specserve bench offline --workload chat --num-prompts 24 --num-warmups 4 --output-len 128 \
      --speculation none,draft_model:4:adaptive --request-rate-sweep inf,inf \
      --result-json sweep_cpu_chat_inf_repeat.json > sweep_cpu_chat_inf_repeat.log 2>&1
specserve bench offline --workload code-edit --num-prompts 24 --num-warmups 4 --output-len 128 \
      --speculation none,draft_model:4,draft_model:4:adaptive --request-rate-sweep 0.5,1,2,inf \
      --result-json sweep_cpu_code_edit.json > sweep_cpu_code_edit.log 2>&1
