# Under load on the CPU (2026-12-06): n-gram adaptive stopping by its matches (the new
# default on a CPU), planning k (stop=plan, the default before) and speculation off,
# taking turns in each round.
for w in code-edit chat; do
  specserve bench offline --workload $w --num-prompts 32 --num-warmups 8 --output-len 128 \
      --speculation none,ngram:4:adaptive,ngram:4:adaptive:stop=plan --request-rate-sweep 2,inf --rounds 2 \
      --result-json sweep_${w/-/_}.json > sweep_${w/-/_}.log 2>&1
done
specserve bench offline --workload chat --num-prompts 32 --num-warmups 8 --output-len 128 \
    --speculation none,ngram:4:adaptive,ngram:4:adaptive:stop=plan --request-rate-sweep inf --rounds 6 \
    --result-json chat_inf_rounds.json > chat_inf_rounds.log 2>&1
