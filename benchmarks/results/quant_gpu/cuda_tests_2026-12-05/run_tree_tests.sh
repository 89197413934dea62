#!/bin/bash
# On CUDA: the draft-tree and EAGLE-3 tests that failed there (run_engine_and_files.sh),
# after the tests choose their trees on any device and keep their eager passes eager
# (those failing only for want of llguidance or fastapi on the device left out).
set -u
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
nvidia-smi --query-gpu=name --format=csv,noheader
T0=$(date +%s)
PYTHONPATH=$PWD timeout ${1:-110} python -m pytest -q -p no:cacheprovider -rf \
  "tests/test_draft_tree.py::test_greedy_with_a_draft_tree_equals_speculation_off" \
  "tests/test_draft_tree.py::test_sampling_through_trees_has_the_target_distribution" \
  "tests/test_draft_tree.py::test_an_eagle_head_grows_trees_and_reads_the_features_of_the_path" \
  "tests/test_eagle3.py::test_the_target_keeps_its_feature_layers_on_every_path" > $OUT/tree_tests.log 2>&1
echo "rc $? at $(( $(date +%s) - T0 )) s"; grep -E "^E  |FAILED|passed|failed" $OUT/tree_tests.log | head -30
