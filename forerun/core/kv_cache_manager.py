"""Per-request block tables on top of the block pool, with prefix-cache lookup and registration."""

from __future__ import annotations

from dataclasses import dataclass

from forerun.core.block_pool import BlockPool, KVBlock, chain_hash
from forerun.request import Request


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    """Maps request ids to their blocks.

    Invariants: a request's block list covers at least its `num_computed_tokens`; only full blocks of
    committed tokens are ever hashed (in-flight tokens are unknown here); the last prompt token is never
    served from the cache, so every admitted request computes at least one token. Where the block that
    holds it is cached too, the request gets a copy of that block (the worker copies it before the
    step) and computes only that token, not the whole block again, as llama.cpp's server reuses a
    cached prompt up to its last token.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._num_hashed: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        # The scheduler step being formed: a block indexed in it is computed by that step's forward, so
        # it may be shared within the step but not copied (the worker copies before the forward).
        self.step = 0

    def new_step(self) -> None:
        """Called as the scheduler starts forming a step."""
        self.step += 1

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """Ids of the request's blocks from index `start` on (the scheduler sends only new ones)."""
        blocks = self.req_blocks.get(request_id)
        if not blocks or len(blocks) <= start:
            return []
        return [b.block_id for b in blocks[start:]]

    def _update_hashes(self, req: Request) -> None:
        bs = self.block_size
        tokens = req.all_token_ids
        while (len(req.block_hashes) + 1) * bs <= len(tokens):
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if i else None
            req.block_hashes.append(chain_hash(parent, tuple(tokens[i * bs:(i + 1) * bs])))

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int, KVBlock | None]:
        """Longest cached prefix of a request that has no blocks yet: the blocks it shares, how many
        tokens are computed with them, and the cached block to copy into its next block, or None. The
        copy comes where every token but the last is cached and the last fills its block: that block
        is cached too, and its first tokens are reused while the last one is computed again."""
        # A request asking for prompt logprobs must compute every prompt position, as in vLLM.
        if not self.enable_caching or req.pooling or req.prompt_logprobs is not None:
            return [], 0, None
        self._update_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        bs = self.block_size
        for i, h in enumerate(req.block_hashes[:max_blocks]):
            block = self.pool.lookup(h, tuple(req.all_token_ids[i * bs:(i + 1) * bs]))
            if block is None:
                break
            hits.append(block)
        num_cached, copy_from = len(hits) * bs, None
        if len(hits) == max_blocks and req.num_tokens % bs == 0:
            last = self.pool.lookup(req.block_hashes[max_blocks], tuple(req.all_token_ids[max_blocks * bs:]))
            if last is not None and last.cached_step < self.step:
                num_cached, copy_from = req.num_tokens - 1, last
        self.stats.queried_tokens += req.num_tokens
        self.stats.hit_tokens += num_cached
        return hits, num_cached, copy_from

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None,
                       num_cached: int | None = None) -> bool:
        """Make room for `num_new_tokens` after the computed ones; False (and no change) if the pool is short.
        At admission, `computed_blocks` and `num_cached` are get_computed_blocks' (the tokens may reach
        into a block after the shared ones: the copied one, allocated here)."""
        held = self.req_blocks.get(req.request_id, [])
        if not computed_blocks and num_cached is None:
            if -(-(req.num_computed_tokens + num_new_tokens) // self.block_size) <= len(held):
                return True  # the common case, a decode inside its last block: nothing changes (every step)
        computed_blocks = computed_blocks or []
        num_computed = req.num_computed_tokens + (len(computed_blocks) * self.block_size if num_cached is None
                                                  else num_cached)
        needed = -(-(num_computed + num_new_tokens) // self.block_size) - len(held) - len(computed_blocks)
        revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if max(needed, 0) + revived > self.pool.num_free_blocks:
            return False
        self.pool.touch(computed_blocks)
        blocks = self.req_blocks.setdefault(req.request_id, [])
        blocks.extend(computed_blocks)
        if computed_blocks:
            self._num_hashed[req.request_id] = len(blocks)
        if needed > 0:
            blocks.extend(self.pool.allocate(needed))
        return True

    def cache_blocks(self, req: Request, num_tokens: int) -> None:
        """Index the request's full blocks up to `num_tokens` (committed and scheduled) in the prefix cache."""
        if not self.enable_caching or req.pooling:
            return
        start = self._num_hashed.get(req.request_id, 0)
        if num_tokens // self.block_size <= start:
            return  # no block filled since the last call: most steps of a decode (hashes stay lazy)
        blocks = self.req_blocks.get(req.request_id)
        if not blocks:
            return
        self._update_hashes(req)
        full = min(num_tokens // self.block_size, len(req.block_hashes), len(blocks))
        bs = self.block_size
        for i in range(start, full):
            self.pool.cache(blocks[i], req.block_hashes[i], tuple(req.all_token_ids[i * bs:(i + 1) * bs]), self.step)
        if full > start:
            self._num_hashed[req.request_id] = full

    def free(self, req: Request) -> None:
        blocks = self.req_blocks.pop(req.request_id, None)
        self._num_hashed.pop(req.request_id, None)
        if blocks:
            self.pool.free(blocks)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_cache()


class NoKVCache(KVCacheManager):
    """For encoder-only models: no blocks at all, every allocation succeeds, nothing is cached."""

    def __init__(self) -> None:
        self.block_size = 1
        self.enable_caching = False
        self.req_blocks = {}
        self._num_hashed = {}
        self.stats = PrefixCacheStats()
        self.pool = BlockPool(1, False)  # a stand-in so counters read "all free"
        self.step = 0

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None,
                       num_cached: int | None = None) -> bool:
        return True
