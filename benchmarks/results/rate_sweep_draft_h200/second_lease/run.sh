# Call 3: the request-rate sweep on the GPU at the loads where the default lost, after the goodput-check change.
source device_carry_q3/setup.sh > /dev/null
for w in chat code-edit; do
  timeout 160 specserve bench offline --device cuda --workload $w --num-prompts 192 --num-warmups 64 --output-len 128 \
      --speculation none,draft_model:4,draft_model:4:adaptive \
      --request-rate-sweep 64,256,inf --quiet --result-json $OUT/sweep2_h200_${w/-/_}.json > $OUT/sweep2_h200_${w/-/_}.log 2>&1
  echo "== $w rc=$?"; grep -v -i warn $OUT/sweep2_h200_${w/-/_}.log | grep "^| " | cut -d'|' -f2-7,10-12
done
