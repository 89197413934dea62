"""BlockPool and KVCacheManager: exact block ids, free-queue order, rollback, leaks."""
from __future__ import annotations

import random

import pytest

from specserve.errors import KVCacheError
from specserve.kv_cache import BlockPool, KVCacheManager


def used_block_ids(kv: KVCacheManager, req_ids) -> list[int]:
    return [b for req_id in req_ids for b in kv.block_table(req_id)]


def check_invariants(kv: KVCacheManager, req_ids) -> None:
    """No block in two tables or both used and free; free + used covers the pool exactly."""
    used = used_block_ids(kv, req_ids)
    free = kv.pool.free_block_ids()
    assert len(set(used)) == len(used), f"a block sits in two tables: {used}"
    assert len(set(free)) == len(free), f"duplicate ids in the free queue: {free}"
    assert set(used).isdisjoint(free)
    assert sorted(used + free) == list(range(kv.num_blocks))
    assert kv.num_free_blocks == len(free)
    assert kv.num_used_blocks == len(used)


# ---------------------------------------------------------------------------- BlockPool
def test_fresh_pool_hands_out_ids_in_order():
    pool = BlockPool(5)
    assert pool.free_block_ids() == [0, 1, 2, 3, 4]
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    assert pool.free_block_ids() == [3, 4]
    assert pool.num_free_blocks == 2


def test_freed_blocks_go_to_the_back_of_the_free_queue():
    pool = BlockPool(5)
    pool.allocate(3)
    pool.free([1, 0])
    assert pool.free_block_ids() == [3, 4, 1, 0]
    # A just-released block is the last to be handed out again.
    assert pool.allocate(3) == [3, 4, 1]
    assert pool.free_block_ids() == [0]


def test_allocate_zero_blocks_is_a_no_op():
    pool = BlockPool(3)
    assert pool.allocate(0) == []
    assert pool.free_block_ids() == [0, 1, 2]


def test_allocate_more_than_free_raises_and_takes_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(KVCacheError):
        pool.allocate(2)
    assert pool.free_block_ids() == [2]


def test_pool_double_free_raises_and_frees_nothing_of_that_call():
    pool = BlockPool(4)
    pool.allocate(3)
    pool.free([0])
    with pytest.raises(KVCacheError, match="block 0 freed twice"):
        pool.free([1, 0])
    # Checked before any change: block 1 is still in use.
    assert pool.free_block_ids() == [3, 0]
    assert pool.num_free_blocks == 2


def test_freeing_a_never_allocated_block_raises():
    pool = BlockPool(3)
    with pytest.raises(KVCacheError):
        pool.free([2])
    assert pool.free_block_ids() == [0, 1, 2]


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_pool_needs_at_least_one_block(num_blocks):
    with pytest.raises(ValueError):
        BlockPool(num_blocks)


def test_pool_free_with_a_repeated_id_is_a_double_free():
    pool = BlockPool(4)
    pool.allocate(4)
    with pytest.raises(KVCacheError):
        pool.free([1, 1])
    assert pool.free_block_ids() == []


def test_pool_free_rejects_a_negative_block_id():
    pool = BlockPool(4)
    pool.allocate(4)
    with pytest.raises(KVCacheError):
        pool.free([-1])
    with pytest.raises(KVCacheError):
        pool.free([4])
    assert pool.free_block_ids() == []


# ---------------------------------------------------------------------------- KVCacheManager
def test_num_blocks_for_rounds_up():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert [kv.num_blocks_for(n) for n in (0, 1, 3, 4, 5, 8, 9)] == [0, 1, 1, 1, 2, 2, 3]


def test_allocate_and_grow_hand_out_exact_block_ids():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("a", 10)
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.allocate_slots("b", 4)
    assert kv.block_table("b") == [3]
    # Growing within the last block allocates nothing.
    assert kv.allocate_slots("a", 12)
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.allocate_slots("a", 13)
    assert kv.block_table("a") == [0, 1, 2, 4]
    # Asking for fewer slots than held never shrinks the table.
    assert kv.allocate_slots("a", 1)
    assert kv.block_table("a") == [0, 1, 2, 4]
    assert kv.pool.free_block_ids() == [5, 6, 7]
    check_invariants(kv, ["a", "b"])


def test_block_table_is_empty_for_an_unknown_request():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    assert kv.block_table("nobody") == []
    assert not kv.holds("nobody")


def test_allocate_slots_up_to_the_last_free_block_then_short():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate_slots("a", 8)              # [0, 1]
    assert kv.allocate_slots("a", 13)             # 2 more: exactly the 2 left
    assert kv.block_table("a") == [0, 1, 2, 3]
    assert kv.num_free_blocks == 0
    assert not kv.allocate_slots("a", 17)         # 1 more, none free
    assert kv.block_table("a") == [0, 1, 2, 3]
    assert kv.pool.free_block_ids() == []


def test_allocate_slots_all_or_nothing_for_a_growing_request():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    kv.allocate_slots("a", 8)                     # [0, 1]
    kv.allocate_slots("b", 8)                     # [2, 3]
    assert not kv.allocate_slots("a", 16)         # needs 2, only [4] free
    assert kv.block_table("a") == [0, 1]
    assert kv.pool.free_block_ids() == [4]
    check_invariants(kv, ["a", "b"])


def test_allocate_slots_all_or_nothing_for_a_new_request():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    kv.allocate_slots("a", 8)                     # [0, 1]
    assert not kv.allocate_slots("b", 5)          # needs 2, only [2] free
    assert not kv.holds("b")
    assert kv.block_table("b") == []
    assert kv.pool.free_block_ids() == [2]
    with pytest.raises(KVCacheError):
        kv.free("b")


@pytest.mark.parametrize("new_len, kept, freed", [
    (10, [0, 1, 2], []),
    (9, [0, 1, 2], []),
    (8, [0, 1], [2]),      # block 2 held slots 8..9 only: wholly past the new length
    (5, [0, 1], [2]),      # slot 4 still lives in block 1
    (4, [0], [1, 2]),
    (1, [0], [1, 2]),
    (0, [], [0, 1, 2]),
])
def test_truncate_frees_only_blocks_wholly_past_the_new_length(new_len, kept, freed):
    kv = KVCacheManager(num_blocks=5, block_size=4)
    kv.allocate_slots("a", 10)
    assert kv.truncate("a", new_len) == freed
    assert kv.block_table("a") == kept
    assert kv.pool.free_block_ids() == [3, 4] + freed
    assert kv.holds("a")


def test_truncate_then_grow_reuses_the_front_of_the_free_queue():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    kv.allocate_slots("a", 12)                    # [0, 1, 2]
    kv.truncate("a", 5)                           # frees [2] to the back
    assert kv.pool.free_block_ids() == [3, 4, 2]
    kv.allocate_slots("a", 9)
    assert kv.block_table("a") == [0, 1, 3]


def test_truncate_unknown_request_raises():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    with pytest.raises(KVCacheError):
        kv.truncate("nobody", 0)


def test_free_returns_the_table_and_double_free_raises():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    kv.allocate_slots("a", 8)                     # [0, 1]
    kv.allocate_slots("b", 4)                     # [2]
    assert kv.free("a") == [0, 1]
    assert not kv.holds("a")
    assert kv.pool.free_block_ids() == [3, 4, 5, 0, 1]
    with pytest.raises(KVCacheError, match="freed twice"):
        kv.free("a")
    assert kv.pool.free_block_ids() == [3, 4, 5, 0, 1]
    assert kv.block_table("b") == [2]


def test_counts_and_usage():
    kv = KVCacheManager(num_blocks=8, block_size=16)
    assert (kv.num_blocks, kv.num_free_blocks, kv.num_used_blocks, kv.usage) == (8, 8, 0, 0.0)
    kv.allocate_slots("a", 33)                    # 3 blocks
    kv.allocate_slots("b", 16)                    # 1 block
    assert (kv.num_free_blocks, kv.num_used_blocks, kv.usage) == (4, 4, 0.5)
    kv.truncate("a", 16)
    assert (kv.num_free_blocks, kv.num_used_blocks, kv.usage) == (6, 2, 0.25)
    kv.free("a")
    kv.free("b")
    assert (kv.num_free_blocks, kv.num_used_blocks, kv.usage) == (8, 0, 0.0)


def test_failed_allocate_keeps_a_request_truncated_to_zero():
    """A failed allocate_slots changes nothing, even for a request whose table is empty."""
    kv = KVCacheManager(num_blocks=2, block_size=4)
    kv.allocate_slots("a", 4)
    kv.truncate("a", 0)
    assert not kv.allocate_slots("a", 100)
    assert kv.holds("a")
    assert kv.free("a") == []


# ---------------------------------------------------------------------------- randomized
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
def test_random_allocate_grow_truncate_free_keeps_invariants(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    kv = KVCacheManager(num_blocks=rng.randint(4, 40), block_size=block_size)
    lengths: dict[str, int] = {}   # req_id -> slots its table covers (model of the manager)
    next_id = 0

    for _ in range(600):
        op = rng.random()
        if op < 0.3 or not lengths:
            req_id, next_id = f"r{next_id}", next_id + 1
            _try_allocate(kv, lengths, req_id, rng.randint(1, 6 * block_size))
        elif op < 0.6:
            req_id = rng.choice(sorted(lengths))
            _try_allocate(kv, lengths, req_id, lengths[req_id] + rng.randint(1, 3 * block_size))
        elif op < 0.8:
            req_id = rng.choice(sorted(lengths))
            new_len = rng.randint(1, lengths[req_id])
            before_table, before_free = kv.block_table(req_id)[:], kv.pool.free_block_ids()
            freed = kv.truncate(req_id, new_len)
            keep = kv.num_blocks_for(new_len)
            assert freed == before_table[keep:]
            assert kv.block_table(req_id) == before_table[:keep]
            assert kv.pool.free_block_ids() == before_free + freed
            lengths[req_id] = new_len
        else:
            req_id = rng.choice(sorted(lengths))
            table = kv.block_table(req_id)[:]
            assert kv.free(req_id) == table
            with pytest.raises(KVCacheError):
                kv.free(req_id)
            del lengths[req_id]
        check_invariants(kv, lengths)
        for req_id, n in lengths.items():
            assert len(kv.block_table(req_id)) == kv.num_blocks_for(n)

    for req_id in list(lengths):
        kv.free(req_id)
    assert kv.num_free_blocks == kv.num_blocks
    assert sorted(kv.pool.free_block_ids()) == list(range(kv.num_blocks))


def _try_allocate(kv: KVCacheManager, lengths: dict[str, int], req_id: str, num_tokens: int):
    """allocate_slots must succeed exactly when the missing blocks are free, else change nothing."""
    held = len(kv.block_table(req_id))
    missing = kv.num_blocks_for(num_tokens) - held
    before_table, before_free = kv.block_table(req_id)[:], kv.pool.free_block_ids()
    ok = kv.allocate_slots(req_id, num_tokens)
    assert ok == (missing <= len(before_free))
    if ok:
        assert kv.block_table(req_id) == before_table + before_free[:missing]
        assert kv.pool.free_block_ids() == before_free[missing:]
        lengths[req_id] = num_tokens
    else:
        assert missing > len(before_free)
        assert kv.block_table(req_id) == before_table
        assert kv.pool.free_block_ids() == before_free
        assert kv.holds(req_id) == (req_id in lengths)
