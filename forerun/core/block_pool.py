"""A pool of fixed-size KV blocks with ref counts, a prefix-hash index and LRU eviction."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class KVBlock:
    """One block of KV slots. A block with a hash holds exactly the tokens `token_ids` after the prefix
    named by its parent hash; it stays findable in the cache while free until it is evicted."""

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = field(default=())
    cached_step: int = -1  # the scheduler step that indexed it (its tokens are computed in that step)


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    """A block's hash covers its parent's hash and its own tokens, so one hash names a whole prefix."""
    return hash((parent, token_ids))


class BlockPool:
    """Owns every block.

    Invariants: a block is in `_free` iff its ref_cnt is 0; `_cached` maps a hash to the one block that
    holds it; allocation takes the least recently freed block and drops its hash (eviction); a cached
    block is never handed out while someone holds it.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self._free):
            raise RuntimeError(f"BlockPool: asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None
            block.token_ids = ()

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> KVBlock | None:
        """The cached block for this hash, checked against its tokens so a hash collision never matches."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cache hits, pulling free ones out of the eviction queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference each; freed in reverse so a request's tail blocks are evicted first."""
        for block in reversed(blocks):
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def cache(self, block: KVBlock, block_hash: int, token_ids: tuple[int, ...], step: int) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is already indexed; this one stays private
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.cached_step = step
        self._cached[block_hash] = block

    def reset_cache(self) -> None:
        for block in self._cached.values():
            block.block_hash = None
            block.token_ids = ()
        self._cached.clear()
