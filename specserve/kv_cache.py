"""Paged KV-cache bookkeeping: a pool of fixed-size blocks and one block table per request.

Only block ids live here; the KV tensors belong to the model runners. A block id indexes the
same block in every cache (the target model's and a draft model's), so one block table
serves them all and both are accounted in one memory budget.
"""
from __future__ import annotations

from collections import deque

from specserve.errors import KVCacheError


class BlockPool:
    """A fixed set of block ids with O(1) allocate and free.

    Free blocks sit in a FIFO queue: allocation takes from the front, freeing appends to the
    back, so a block just released is the last to be handed out again.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free_queue: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    def free_block_ids(self) -> list[int]:
        return list(self._free_queue)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free_queue):
            raise KVCacheError(f"asked for {num_blocks} blocks, {len(self._free_queue)} free")
        block_ids = [self._free_queue.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._is_free[block_id] = False
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        if len(set(block_ids)) != len(block_ids):
            raise KVCacheError(f"block ids {block_ids} repeat: a block freed twice")
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise KVCacheError(f"block id {block_id} is not in [0, {self.num_blocks})")
            if self._is_free[block_id]:
                raise KVCacheError(f"block {block_id} freed twice")
        for block_id in block_ids:
            self._is_free[block_id] = True
            self._free_queue.append(block_id)


class KVCacheManager:
    """Per-request block tables over one BlockPool.

    A request's table always covers the slots it may write this step: its computed tokens,
    the new tokens scheduled now and any lookahead slots for draft tokens. After
    verification ``truncate`` rewinds it to the accepted length, returning every block that
    lies wholly past that length to the pool in the same step.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._block_tables: dict[str, list[int]] = {}
        # req_id -> (blocks shared with the request, {branch: the branch's own blocks after them})
        self._branches: dict[str, tuple[int, dict[int, list[int]]]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, req_id: str) -> list[int]:
        return self._block_tables.get(req_id, [])

    def allocate_slots(self, req_id: str, num_tokens: int) -> bool:
        """Grow ``req_id``'s table to hold ``num_tokens`` slots in all.

        All or nothing: returns False and allocates nothing when the pool is short.
        """
        table = self._block_tables.get(req_id, [])
        missing = self.num_blocks_for(num_tokens) - len(table)
        if missing > self.pool.num_free_blocks:
            return False
        self._block_tables[req_id] = table
        if missing > 0:
            table.extend(self.pool.allocate(missing))
        return True

    def truncate(self, req_id: str, num_tokens: int) -> list[int]:
        """Shrink ``req_id``'s table to ``num_tokens`` slots; returns the freed block ids."""
        table = self._block_tables.get(req_id)
        if table is None:
            raise KVCacheError(f"request {req_id!r} holds no KV blocks")
        keep = self.num_blocks_for(num_tokens)
        freed = table[keep:]
        del table[keep:]
        self.pool.free(freed)
        return freed

    def free(self, req_id: str) -> list[int]:
        """Release every block of ``req_id`` (its branches' too). Freeing a request twice is an error."""
        table = self._block_tables.pop(req_id, None)
        if table is None:
            raise KVCacheError(f"request {req_id!r} holds no KV blocks (freed twice?)")
        self.pool.free(table)
        self.merge(req_id, None)
        return table

    # ------------------------------------------------------------------ branches
    # A request may branch for one step (a draft path, spec/paths.py): each branch gets a
    # block table of its own, whose blocks before the first position any pass of the step
    # writes are shared with the request and the rest are the branch's. ``merge`` then
    # keeps the winning branch's blocks and frees the others.

    def fork(self, req_id: str, branch: int, first_written: int, num_tokens: int) -> tuple[int, int] | None:
        """A block table for ``req_id``'s ``branch`` (1, 2, ...) holding ``num_tokens``
        slots: the request's blocks wholly before position ``first_written`` are shared,
        the rest are the branch's own. Returns the block copy (source, destination) that
        gives the branch's first own block the request's tokens (all of them, since a cache
        may hold the token at ``first_written`` already: one the target computed, which a
        draft cache still lacks) for the caller to make in every cache; or None,
        allocating nothing, when the pool is short."""
        table = self._block_tables[req_id]
        shared = first_written // self.block_size
        missing = self.num_blocks_for(num_tokens) - shared
        if missing > self.pool.num_free_blocks:
            return None
        shared_before, branches = self._branches.setdefault(req_id, (shared, {}))
        if branch in branches or shared_before != shared:
            raise KVCacheError(f"request {req_id!r}: branch {branch} forked twice, or at another position")
        own = branches[branch] = self.pool.allocate(missing)
        return table[shared], own[0]

    def branch_block_table(self, req_id: str, branch: int) -> list[int]:
        shared, branches = self._branches[req_id]
        return self._block_tables[req_id][:shared] + branches[branch]

    def merge(self, req_id: str, winner: int | None) -> None:
        """End ``req_id``'s branches: ``winner``'s blocks (a branch forked this step)
        replace the request's own from the fork on; every other branch's are freed (all of
        them when ``winner`` is None: the request's own table won)."""
        shared, branches = self._branches.pop(req_id, (0, {}))
        if winner is not None:
            table = self._block_tables[req_id]
            self.pool.free(table[shared:])
            table[shared:] = branches.pop(winner)
        for own in branches.values():
            self.pool.free(own)

    def num_branches(self, req_id: str) -> int:
        """Branches forked for ``req_id`` and not merged yet."""
        return len(self._branches.get(req_id, (0, {}))[1])

    def holds(self, req_id: str) -> bool:
        return req_id in self._block_tables
