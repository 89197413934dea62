"""Paged KV-cache bookkeeping: a pool of fixed-size, reference-counted blocks, one block
table per request, and the prefix cache.

Only block ids live here; the KV tensors belong to the model runners. A block id indexes the
same block in every cache (the target model's and a draft model's), so one block table
serves them all and both are accounted in one memory budget.

Prefix caching (``enable_prefix_caching``): a block gets a hash once all its tokens are
committed (computed and accepted, never a draft). The hash chains the parent block's hash
with the block's token ids (``block_hash``), so equal hashes mean equal prefixes. A block
whose last holder lets go keeps its hash and waits in an LRU pool of evictable blocks until
the space is needed; a request admitted later takes the longest run of cached blocks that
starts its tokens and computes only what follows. Blocks are shared by reference count and
a shared block is never written: rollback only frees blocks past the committed length
(never hashed, never shared), and a draft path's fork copies the one block it writes into.

A draft model's cache lives under the same block ids, so each block also records whether
the draft's entries for it are valid (``mark_draft_valid``): a cached block the target
computed may lack them, and the draft then catches up on what it lacks.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from specserve.errors import KVCacheError

ROOT_HASH = b""  # the parent of a request's first block


def block_hash(parent: bytes, token_ids: Sequence[int], extra_key: bytes = b"") -> bytes:
    """A full block's key: its parent block's hash, the engine's extra key (whatever else
    changes its KV) and its token ids, in one 128-bit BLAKE2b digest."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(extra_key)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockPool:
    """A fixed set of reference-counted block ids with O(1) allocate and free.

    Free blocks without a hash sit in a FIFO queue: allocation takes from the front, freeing
    appends to the back, so a block just released is the last to be handed out again.
    Free blocks with a hash (cached prefixes) sit in an LRU pool after them, and are only
    evicted, least recently freed first, once the plain free blocks are gone.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free_queue: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.ref_counts = [0] * num_blocks
        # Per block: its hash, and the parent hash and token ids it was made of (kept so
        # a hit is checked token for token and the storm tests can recompute the hash).
        self.hashes: list[bytes | None] = [None] * num_blocks
        self.contents: list[tuple[bytes, tuple[int, ...]] | None] = [None] * num_blocks
        self.draft_valid = bytearray(num_blocks)
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds: never cached, or cached and evictable."""
        return len(self._free_queue) + len(self._evictable)

    def free_block_ids(self) -> list[int]:
        """In the order ``allocate`` hands them out."""
        return list(self._free_queue) + list(self._evictable)

    def evictable_block_ids(self) -> list[int]:
        return list(self._evictable)

    def reset_cache(self) -> None:
        """Forget every cached block nobody holds (they become plain free blocks)."""
        while self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._forget(block_id)
            self._free_queue.append(block_id)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > self.num_free_blocks:
            raise KVCacheError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        block_ids = []
        for _ in range(num_blocks):
            if self._free_queue:
                block_id = self._free_queue.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                self._forget(block_id)
                self.num_evictions += 1
            self.ref_counts[block_id] = 1
            self.draft_valid[block_id] = 0
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Sequence[int]) -> None:
        """One more holder for each of ``block_ids`` (a cache hit, a fork): a free cached
        block leaves the evictable pool."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                if block_id not in self._evictable:
                    raise KVCacheError(f"block {block_id} is free and not cached: nothing to share")
                del self._evictable[block_id]
            self.ref_counts[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """One holder fewer for each of ``block_ids``; a block nobody holds is free again:
        at the back of the free queue, or if it has a hash, the most recently used of the
        evictable ones, the last of ``block_ids`` first to go (a prefix's tail is evicted
        before its head, which more requests share). Checked before any change."""
        if len(set(block_ids)) != len(block_ids):
            raise KVCacheError(f"block ids {list(block_ids)} repeat: a block freed twice")
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise KVCacheError(f"block id {block_id} is not in [0, {self.num_blocks})")
            if self.ref_counts[block_id] == 0:
                raise KVCacheError(f"block {block_id} freed twice")
        cached = []
        for block_id in block_ids:
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if self.hashes[block_id] is None:
                    self._free_queue.append(block_id)
                else:
                    cached.append(block_id)
        for block_id in reversed(cached):
            self._evictable[block_id] = None

    # ------------------------------------------------------------------ hashes
    def set_hash(self, block_id: int, parent: bytes, token_ids: tuple[int, ...], key: bytes) -> bool:
        """Make ``block_id`` the cached block for ``key``; False (nothing changes) when
        another block holds that key already (two requests computed the same prefix)."""
        if key in self.cached or self.hashes[block_id] is not None:
            return False
        self.cached[key] = block_id
        self.hashes[block_id] = key
        self.contents[block_id] = (parent, token_ids)
        return True

    def lookup(self, key: bytes, parent: bytes, token_ids: tuple[int, ...]) -> int | None:
        """The cached block for ``key`` if its parent hash and tokens are these."""
        block_id = self.cached.get(key)
        if block_id is None or self.contents[block_id] != (parent, token_ids):
            return None
        return block_id

    def _forget(self, block_id: int) -> None:
        key = self.hashes[block_id]
        if key is not None:
            del self.cached[key]
            self.hashes[block_id] = None
            self.contents[block_id] = None


@dataclass
class PrefixHit:
    """What admission may reuse of a request's tokens: cached blocks that start them."""

    block_ids: list[int]
    num_draft_valid: int  # of which the leading ones whose draft-cache entries are valid too


class KVCacheManager:
    """Per-request block tables over one BlockPool, and the prefix cache over them.

    A request's table always covers the slots it may write this step: its computed tokens,
    the new tokens scheduled now and any lookahead slots for draft tokens. After
    verification ``truncate`` rewinds it to the accepted length, returning every block that
    lies wholly past that length to the pool in the same step; ``commit`` then hashes the
    blocks the accepted tokens filled.

    ``draft_cache`` says how a drafter with a cache of its own uses cached blocks: None (no
    such cache: n-gram, layer-skip, speculation off), ``"tokens"`` (a draft model: it
    catches up from the blocks whose draft entries are valid) or ``"features"`` (an EAGLE
    head: its entries need the target's hidden states, which a hit does not recompute, so a
    hit reaches only as far as the head's entries are valid, and stops one block short of
    them: the head's entry at a block's last position pairs it with the next block's first
    token, which only a hit on that next block vouches for).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 draft_cache: str | None = None, extra_key: bytes = b"") -> None:
        if draft_cache not in (None, "tokens", "features"):
            raise ValueError(f"draft_cache must be None, 'tokens' or 'features', got {draft_cache!r}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.draft_cache = draft_cache
        self.extra_key = extra_key
        self._block_tables: dict[str, list[int]] = {}
        # req_id -> (blocks shared with the request, {branch: the branch's block table})
        self._branches: dict[str, tuple[int, dict[int, list[int]]]] = {}
        # req_id -> hashes of its full blocks so far (the chain commit extends)
        self._hashes: dict[str, list[bytes]] = {}
        self._committed: dict[str, int] = {}  # req_id -> blocks of its table hashed (or tried)
        self._draft_marked: dict[str, int] = {}  # req_id -> blocks marked draft-valid
        self.num_query_tokens = 0  # prompt tokens looked up at admission
        self.num_hit_tokens = 0    # of which served from the cache

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

    @property
    def num_cached_blocks(self) -> int:
        return len(self.pool.cached)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, req_id: str) -> list[int]:
        return self._block_tables.get(req_id, [])

    # ------------------------------------------------------------------ prefix cache
    def find_prefix(self, req_id: str, token_ids: Sequence[int], root: bytes = ROOT_HASH) -> PrefixHit:
        """The cached blocks that start ``token_ids``, for a request about to be admitted
        with nothing computed. The last token is never covered (its logits are needed), and
        the rule of ``draft_cache`` applies. Allocates nothing: ``allocate_slots`` takes
        the hit. ``root``: the parent of the first block, for KV computed another way (the
        same root in ``commit``)."""
        if not self.enable_prefix_caching:
            return PrefixHit([], 0)
        hashes = self._hashes.setdefault(req_id, [])
        bs, pool = self.block_size, self.pool
        blocks: list[int] = []
        parent = root
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            if i == len(hashes):
                hashes.append(block_hash(parent, tokens, self.extra_key))
            block_id = pool.lookup(hashes[i], parent, tokens)
            if block_id is None:
                break
            blocks.append(block_id)
            parent = hashes[i]
        valid = 0
        while valid < len(blocks) and pool.draft_valid[blocks[valid]]:
            valid += 1
        if self.draft_cache == "features":
            del blocks[min(valid, len(blocks) - 1):]
            valid = len(blocks)
        return PrefixHit(blocks, valid)

    def commit(self, req_id: str, token_ids: Sequence[int], num_tokens: int, root: bytes = ROOT_HASH) -> None:
        """Hash ``req_id``'s blocks wholly within its first ``num_tokens`` tokens (its
        committed ones: computed, and accepted where they were drafts), so that later
        requests can share them."""
        if not self.enable_prefix_caching:
            return
        table = self._block_tables[req_id]
        done = self._committed.get(req_id, 0)
        # A stop token among accepted drafts leaves computed positions past the request's
        # last token: they were never its tokens.
        full = min(min(num_tokens, len(token_ids)) // self.block_size, len(table))
        if full <= done:
            return
        hashes = self._hashes.setdefault(req_id, [])
        bs, pool = self.block_size, self.pool
        for i in range(done, full):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            parent = hashes[i - 1] if i else root
            if i == len(hashes):
                hashes.append(block_hash(parent, tokens, self.extra_key))
            pool.set_hash(table[i], parent, tokens, hashes[i])
        self._committed[req_id] = full

    def prefix_ready(self, req_id: str, num_tokens: int) -> bool:
        """Whether ``req_id``'s whole blocks before its ``num_tokens``-th token are cached
        for a request that starts the same way (committed, and where the draft cache's rule
        needs them, holding its entries): there is nothing to wait for when caching is off
        or those tokens fill no whole block."""
        full = (num_tokens - 1) // self.block_size
        if not self.enable_prefix_caching or full == 0:
            return True
        if self._committed.get(req_id, 0) < full:
            return False
        return self.draft_cache != "features" or self._draft_marked.get(req_id, 0) >= full

    def mark_draft_valid(self, req_id: str, num_tokens: int) -> None:
        """The draft cache holds valid entries for ``req_id``'s first ``num_tokens``
        positions: mark the blocks wholly within them."""
        if not self.enable_prefix_caching or self.draft_cache is None:
            return
        table = self._block_tables.get(req_id)
        if table is None:
            return
        done = self._draft_marked.get(req_id, 0)
        full = min(num_tokens // self.block_size, len(table))
        for block_id in table[done:full]:
            self.pool.draft_valid[block_id] = 1
        if full > done:
            self._draft_marked[req_id] = full

    # ------------------------------------------------------------------ tables
    def allocate_slots(self, req_id: str, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Grow ``req_id``'s table to hold ``num_tokens`` slots in all; a new request's
        table starts with ``hit``'s cached blocks.

        All or nothing: returns False and allocates nothing when the pool is short.
        """
        table = self._block_tables.get(req_id)
        cached = hit.block_ids if hit and table is None else []
        have = len(table) if table is not None else len(cached)
        missing = self.num_blocks_for(num_tokens) - have
        # A cached block nobody holds counts as free until this request takes it.
        reclaimed = sum(1 for b in cached if self.pool.ref_counts[b] == 0)
        if max(missing, 0) + reclaimed > self.pool.num_free_blocks:
            return False
        if table is None:
            self.pool.touch(cached)
            table = self._block_tables[req_id] = list(cached)
            self._committed[req_id] = self._draft_marked[req_id] = len(cached)
            if hit is not None:
                self._draft_marked[req_id] = hit.num_draft_valid
        if missing > 0:
            table.extend(self.pool.allocate(missing))
        return True

    def reset_prefix_cache(self) -> None:
        """Forget the cached prefixes no request holds (a benchmark's cold start)."""
        self.pool.reset_cache()

    def record_admission(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a prefix-cache query of ``num_tokens`` tokens, ``num_hit_tokens`` of them hits."""
        if self.enable_prefix_caching:
            self.num_query_tokens += num_tokens
            self.num_hit_tokens += num_hit_tokens

    def truncate(self, req_id: str, num_tokens: int) -> list[int]:
        """Shrink ``req_id``'s table to ``num_tokens`` slots; returns the freed block ids.
        Only blocks the request holds alone and never committed can go: a rollback never
        reaches a shared or cached block."""
        table = self._block_tables.get(req_id)
        if table is None:
            raise KVCacheError(f"request {req_id!r} holds no KV blocks")
        keep = self.num_blocks_for(num_tokens)
        freed = table[keep:]
        for block_id in freed:
            if self.pool.ref_counts[block_id] != 1 or self.pool.hashes[block_id] is not None:
                raise KVCacheError(f"request {req_id!r}: rollback to {num_tokens} tokens reaches "
                                   f"block {block_id}, which is shared or committed")
        del table[keep:]
        self.pool.free(freed)
        self._committed[req_id] = min(self._committed.get(req_id, 0), keep)
        self._draft_marked[req_id] = min(self._draft_marked.get(req_id, 0), keep)
        return freed

    def free(self, req_id: str) -> list[int]:
        """Release every block of ``req_id`` (its branches' too); cached blocks stay cached
        (``BlockPool.free``). Freeing a request twice is an error."""
        table = self._block_tables.pop(req_id, None)
        if table is None:
            raise KVCacheError(f"request {req_id!r} holds no KV blocks (freed twice?)")
        self.pool.free(table)
        self.merge(req_id, None)
        self._hashes.pop(req_id, None)
        self._committed.pop(req_id, None)
        self._draft_marked.pop(req_id, None)
        return table

    def forget(self, req_id: str) -> None:
        """Drop what ``find_prefix`` kept of a request that holds no blocks (it was never
        admitted, or was preempted and waits again)."""
        if req_id not in self._block_tables:
            self._hashes.pop(req_id, None)

    # ------------------------------------------------------------------ branches
    # A request may branch for one step (a draft path, spec/paths.py): each branch gets a
    # block table of its own, whose blocks before the first position any pass of the step
    # writes are shared with the request (by reference count) and the rest are the
    # branch's. ``merge`` then keeps the winning branch's table and frees the others.

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
        self.pool.touch(table[:shared])
        own = self.pool.allocate(missing)
        branches[branch] = table[:shared] + own
        return table[shared], own[0]

    def branch_block_table(self, req_id: str, branch: int) -> list[int]:
        return self._branches[req_id][1][branch]

    def merge(self, req_id: str, winner: int | None) -> None:
        """End ``req_id``'s branches: ``winner``'s table (a branch forked this step)
        replaces the request's own; every other table is freed (all the branches' when
        ``winner`` is None: the request's own table won)."""
        shared, branches = self._branches.pop(req_id, (0, {}))
        if winner is not None:
            old = self._block_tables[req_id]
            self._block_tables[req_id] = branches.pop(winner)
            self.pool.free(old)
            # The winner's blocks from the fork on are new to the request: not yet hashed.
            self._committed[req_id] = min(self._committed.get(req_id, 0), shared)
            self._draft_marked[req_id] = min(self._draft_marked.get(req_id, 0), shared)
        for table in branches.values():
            self.pool.free(table)

    def num_branches(self, req_id: str) -> int:
        """Branches forked for ``req_id`` and not merged yet."""
        return len(self._branches.get(req_id, (0, {}))[1])

    def holds(self, req_id: str) -> bool:
        return req_id in self._block_tables

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Raise KVCacheError unless the books balance: each block's reference count is the
        number of tables (branches included) that hold it; no block is both free and held;
        every cached block's hash is that of the parent hash and tokens it was made of."""
        pool = self.pool
        holders = [0] * pool.num_blocks
        tables = list(self._block_tables.values())
        tables += [t for _, branches in self._branches.values() for t in branches.values()]
        for table in tables:
            if len(set(table)) != len(table):
                raise KVCacheError(f"a block table holds a block twice: {table}")
            for block_id in table:
                holders[block_id] += 1
        if holders != pool.ref_counts:
            wrong = [b for b in range(pool.num_blocks) if holders[b] != pool.ref_counts[b]]
            raise KVCacheError(f"reference counts differ from the tables' at blocks {wrong[:10]}")
        free = pool.free_block_ids()
        if len(set(free)) != len(free) or any(holders[b] for b in free):
            raise KVCacheError("a block is both free and held, or free twice")
        if len(free) + sum(1 for h in holders if h) != pool.num_blocks:
            raise KVCacheError("blocks are lost: neither free nor held")
        for key, block_id in pool.cached.items():
            parent, tokens = pool.contents[block_id]
            if pool.hashes[block_id] != key or block_hash(parent, tokens, self.extra_key) != key:
                raise KVCacheError(f"cached block {block_id}'s hash is not that of its tokens")
