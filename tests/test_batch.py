"""The one builder of a step's host lists (``batch.host_batch``): its ragged layout (the
eager pass and the ragged graphs) and its padded one (the padded graphs), row by row."""
from __future__ import annotations

from specserve.batch import host_batch
from specserve.sampling_params import SamplingParams
from specserve.scheduler import ScheduledRequest

GREEDY = SamplingParams(temperature=0)


def _steps():
    """A verify span (1 token + 2 drafts at positions 6-8: blocks 3 and 7), a prefill chunk that does not
    sample yet (3 tokens at position 0, block 5) and a decode row (position 4, blocks 1, 2)."""
    return [ScheduledRequest("v", [11], 6, [9, 3, 7], GREEDY, num_lookahead=2, draft_token_ids=[21, 22]),
            ScheduledRequest("p", [31, 32, 33], 0, [5], GREEDY, sample=False),
            ScheduledRequest("d", [41], 4, [1, 2], GREEDY)]


def test_the_ragged_layout_has_every_request_s_rows_one_after_another():
    host = host_batch(_steps(), block_size=4, device_counts=[2, 0, 0])
    assert host.input_ids == [11, 21, 22, 31, 32, 33, 41]
    assert host.positions == [6, 7, 8, 0, 1, 2, 4]
    assert host.slots == [3 * 4 + 2, 3 * 4 + 3, 7 * 4 + 0, 20, 21, 22, 2 * 4 + 0]
    assert host.logits_rows == [0, 1, 2, 6]  # the verify span's 1 + k rows, the decode row
    assert host.query_lens == [3, 3, 1] and host.seq_lens == [9, 3, 5]
    assert host.cu_query_lens == [0, 3, 6, 7]
    assert host.device_rows == [1, 2]  # the drafts still on the device
    host.add_padding(5)  # a ragged graph's padding request up to its token bucket
    assert host.input_ids[7:] == [0] * 5 and host.positions[7:] == [0, 1, 2, 3, 4]
    assert host.slots[7:] == [-1] * 5 and host.query_lens[-1] == host.seq_lens[-1] == 5


def test_the_padded_layout_pads_each_request_after_its_real_rows():
    steps = [s for s in _steps() if s.req_id != "p"]  # a padded graph runs decode and verify rows
    host = host_batch(steps, block_size=4, device_counts=[2, 0], span=3)
    assert host.input_ids == [11, 21, 22, 41, 0, 0]
    assert host.positions == [6, 7, 8, 4, 5, 6]  # padding rows after the real ones: causal
    assert host.slots == [14, 15, 28, 8, -1, -1]  # never stored
    assert host.logits_rows == [0, 1, 2, 3]
    assert host.query_lens == [3, 3] and host.seq_lens == [9, 7]
    assert host.device_rows == [1, 2]
    host.add_padding(3, 2)  # two padding requests up to the batch bucket
    assert host.input_ids[6:] == [0] * 6 and host.positions[6:] == [0, 1, 2, 0, 1, 2]
    assert host.slots[6:] == [-1] * 6 and host.cu_query_lens == [0, 3, 6, 9, 12]
    assert host.seq_lens == [9, 7, 3, 3]
