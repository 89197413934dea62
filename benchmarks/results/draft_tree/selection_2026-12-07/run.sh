#!/bin/bash
# The pools (each ~1.5 min on the 2-core machine) and the offline table.
set -e
cd "$(dirname "$0")"
python dump_trees.py 2 2 6 3 8 float32 base.json.gz > base.log 2>&1
python dump_trees.py 6 4 6 3 8 float32 rich.json.gz > rich.log 2>&1
python dump_trees.py 8 6 8 1 8 float32 rich8.json.gz > rich8.log 2>&1
python dump_trees.py 6 4 6 3 8 float32 rich_bf16_draft.json.gz none > rich_bf16_draft.log 2>&1
python select_eval.py base.json.gz rich.json.gz rich8.json.gz rich_bf16_draft.json.gz | tee select_eval.log
