#!/bin/bash
# On CUDA, until $1 seconds after $2 (a start time, date +%s): the tests that were changed
# without a GPU to rerun them, then the 93 tests of the CUDA-path files that did not run.
set -u
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
left() { echo $(( $1 - ($(date +%s) - $2) )); }
CHANGED="a_feed_after_the_targets_pass_that_fails or a_fixed_tree_takes_every_depths or a_graph_step_after_a_tree
  or a_tree_moves_its_paths_kv or adaptive_trees_with_penalties or an_eagle_head_grows_trees or reads_the_device_once
  or candidates_ranked_after_the_last_pass or fixed_trees_beside_logprobs or greedy_trees_are_decided_in_settling
  or greedy_with_a_draft_tree_equals or padded_graph_path or padding_rows_never_reach or ragged_graph_path_equals_eager
  or gpu_memory_budget_reserves or graph_path_hands_the_head or target_keeps_its_feature_layers"
CHANGED=$(echo $CHANGED)
PYTHONPATH=$PWD timeout $(left $1 $2) python -m pytest -q -p no:cacheprovider -rf tests/test_draft_tree.py \
  tests/test_cuda_graphs.py tests/test_eagle.py tests/test_model_drafter.py tests/test_eagle3.py -k "$CHANGED" \
  > $OUT/changed_tests.log 2>&1
echo "changed: rc $?"; grep -E "^FAILED|passed|failed" $OUT/changed_tests.log | head -20
PYTHONPATH=$PWD timeout $(left $1 $2) python -m pytest -q -p no:cacheprovider -rf tests/test_eagle3.py tests/test_eagle.py \
  tests/test_model_drafter.py tests/test_deterministic.py tests/test_confidence_stopping.py -k "not ($CHANGED)" \
  > $OUT/rest_tests.log 2>&1
echo "rest: rc $?"; grep -E "^FAILED|passed|failed" $OUT/rest_tests.log | head -30
