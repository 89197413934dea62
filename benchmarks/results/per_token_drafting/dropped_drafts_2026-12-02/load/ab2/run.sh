NEW='/tmp/devvenv/bin/python -c "import sys; from specserve.cli import main; sys.exit(main())"'
OLD='/tmp/devvenv/bin/python /tmp/mb/bench_old.py'
run() { # label variant workload rate
  eval "${!2}" bench offline --workload $3 --num-prompts 24 --num-warmups 4 --output-len 128 \
      --speculation none,draft_model:4:adaptive --request-rate-sweep $4 --result-json $1.json > $1.log 2>&1
}
for r in 1 2; do
  if [ $r = 1 ]; then A=NEW; B=OLD; else A=OLD; B=NEW; fi
  run chat2_${A}_$r $A chat 2; run chat2_${B}_$r $B chat 2
  run codeinf_${A}_$r $A code-edit inf; run codeinf_${B}_$r $B code-edit inf
done
