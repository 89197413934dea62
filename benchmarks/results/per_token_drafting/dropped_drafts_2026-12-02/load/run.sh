for w in code-edit chat; do
  /tmp/devvenv/bin/python -c "import sys; from specserve.cli import main; sys.exit(main())" bench offline --workload $w --num-prompts 24 --num-warmups 4 --output-len 128 \
      --speculation none,draft_model:4:adaptive --request-rate-sweep 0.5,1,2,inf \
      --result-json sweep_cpu_${w/-/_}.json > sweep_cpu_${w/-/_}.log 2>&1
done
