"""Serving memory: a paged KV cache beside per-request reservation (lab 07).

This follows PagedAttention (Kwon et al., "Efficient Memory Management for Large Language
Model Serving with PagedAttention", SOSP 2023, the vLLM paper). Servers before it reserved one
contiguous slab of ``max_seq`` tokens per request at admission, so most of the KV cache held
nothing: slots for tokens not generated yet, or never generated. A paged cache cuts every
layer's cache into a pool of fixed-size blocks; each request owns a *block table* (logical
block i -> physical block), takes a block only when its last one is full, and returns them all
when it finishes. The only waste left is the slack in each request's last block.

    cache = PagedKVCache(num_blocks=64, block_size=16, layers=2, kv_heads=2, head_dim=8)
    cache.admit("a"); cache.append("a", 0, k, v)     # k, v: (T, kv_heads, head_dim)
    k, v = cache.gather("a", 0)                       # in token order, ready for attention
    sims = compare_caches(12 * 2**30, request_stream(500, seed=0))
"""
from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from labkit.core.config import ModelConfig, preset
from labkit.core.units import check_choice, check_positive, torch_dtype
from labkit.predict import kv_cache_bytes


class CacheFull(MemoryError):
    """The cache has no room for the tokens asked for: free a request, or preempt one."""


class _KVCache:
    """What both caches share: geometry, per-layer token counts, and the byte accounting."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype, device):
        for name, value in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim)):
            check_positive(name, value)
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = torch_dtype(dtype), torch.device(device)
        # one token of one layer: a key and a value of kv_heads x head_dim numbers
        self.token_layer_bytes = 2 * kv_heads * head_dim * self.dtype.itemsize
        self.lengths: dict[object, list[int]] = {}        # request -> tokens held, per layer
        self._held = 0                                     # sum of all lengths

    @property
    def used_bytes(self) -> int:
        """Bytes of the tokens actually held, all requests and layers."""
        return self._held * self.token_layer_bytes

    @property
    def fragmentation_bytes(self) -> int:
        """Reserved but holding no token: what a request keeps and does not use (yet)."""
        return self.reserved_bytes - self.used_bytes

    def tokens(self, request) -> int:
        """Tokens the request holds (the most any layer holds)."""
        return max(self._lengths_of(request))

    def admit(self, request) -> None:
        if request in self.lengths:
            raise ValueError(f"request {request!r} is already admitted; free it first")
        self.lengths[request] = [0] * self.layers

    def grow(self, request, n: int = 1) -> None:
        """Account for ``n`` more tokens in every layer without writing them (the simulator's
        step; ``append`` is the same with real keys and values)."""
        lengths = self._lengths_of(request)
        self._make_room(request, max(lengths) + n)
        self.lengths[request] = [length + n for length in lengths]
        self._held += n * self.layers

    def append(self, request, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys and values for new tokens of one layer; k, v: (T_new, kv_heads, head_dim)."""
        lengths = self._lengths_of(request)
        if not 0 <= layer < self.layers:
            raise ValueError(f"layer must be in 0..{self.layers - 1}, got {layer}")
        shape = (self.kv_heads, self.head_dim)
        if k.dim() != 3 or tuple(k.shape[1:]) != shape or k.shape != v.shape:
            raise ValueError(f"k and v must both be (T_new, {shape[0]}, {shape[1]}), "
                             f"got {tuple(k.shape)} and {tuple(v.shape)}")
        start, end = lengths[layer], lengths[layer] + k.shape[0]
        self._make_room(request, end)
        self._write(request, layer, start, torch.stack([k, v], dim=1))   # (T_new, 2, Hkv, d)
        lengths[layer] = end
        self._held += k.shape[0]

    def gather(self, request, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values of the request, in token order: (T, kv_heads, head_dim)."""
        kv = self._read(request, layer, self._lengths_of(request)[layer])   # (T, 2, Hkv, d)
        return kv[:, 0], kv[:, 1]

    def free(self, request) -> None:
        self._held -= sum(self._lengths_of(request))
        del self.lengths[request]

    def _lengths_of(self, request) -> list[int]:
        if request not in self.lengths:
            raise ValueError(f"unknown request {request!r}; admit it first")
        return self.lengths[request]


class PagedKVCache(_KVCache):
    """A pool of ``num_blocks`` blocks of ``block_size`` tokens per layer, handed out on demand.

    A request's block table lists its physical blocks in order; every layer uses the same
    table (block b of layer l is ``pools[l][b]``). Reserved bytes are whole blocks, so the
    only waste is each request's last, partly filled block. Blocks can be shared, counted by
    reference: a prompt's prefix (``share``, vLLM's prefix caching) or a whole request
    (``fork``, parallel sampling in the PagedAttention paper); a request that writes into a
    shared block first copies it (copy-on-write). ``used_bytes`` counts a shared block's tokens once.
    """

    def __init__(self, num_blocks: int, block_size: int, layers: int, kv_heads: int,
                 head_dim: int, dtype=torch.float32, device="cpu"):
        super().__init__(layers, kv_heads, head_dim, dtype, device)
        check_positive("num_blocks", num_blocks)
        check_positive("block_size", block_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        # one pool per layer: (num_blocks, block_size, 2 for k and v, kv_heads, head_dim)
        self.pools = [torch.zeros(num_blocks, block_size, 2, kv_heads, head_dim,
                                  dtype=self.dtype, device=self.device) for _ in range(layers)]
        self.free_blocks = list(range(num_blocks - 1, -1, -1))   # pop() hands out block 0 first
        self.tables: dict[object, list[int]] = {}
        self.block_bytes = block_size * layers * self.token_layer_bytes
        self.refs = [0] * num_blocks            # requests holding each block
        self.copies = 0                         # blocks copied on a write (copy-on-write)
        self._duplicated = 0                    # tokens x layers a block's extra holders count again

    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def reserved_bytes(self) -> int:
        return (self.num_blocks - len(self.free_blocks)) * self.block_bytes

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    @property
    def used_bytes(self) -> int:
        """Bytes of the tokens held, a shared block's once."""
        return (self._held - self._duplicated) * self.token_layer_bytes

    def can_hold(self, request, tokens: int) -> bool:
        """Whether ``request`` (admitted or not) can grow to ``tokens`` tokens now."""
        held = len(self.tables.get(request, ()))
        copy = request in self.tables and self._shared_tail(request) is not None
        return self.blocks_for(tokens) - held + copy <= len(self.free_blocks)

    def can_admit(self, tokens: int, watermark: float = 0.0) -> bool:
        """Whether a new request of ``tokens`` fits and leaves ``watermark`` of the blocks
        free for the running ones to grow into (vLLM keeps 1%)."""
        spare = int(watermark * self.num_blocks)
        return self.blocks_for(tokens) + spare <= len(self.free_blocks)

    def admit(self, request) -> None:
        super().admit(request)
        self.tables[request] = []

    def share(self, source, request, tokens: int) -> int:
        """Admit ``request`` holding the full blocks of ``source``'s first ``tokens`` tokens (a
        prompt prefix both start with: vLLM shares full blocks only). Returns the tokens shared."""
        self._check_whole(source)
        blocks = min(tokens, self.tokens(source)) // self.block_size
        self.admit(request)
        self._take(request, self.tables[source][:blocks], blocks * self.block_size)
        return blocks * self.block_size

    def fork(self, parent, child) -> None:
        """Admit ``child`` holding every block of ``parent``, its last partly filled one too
        (parallel sampling, as the PagedAttention paper and vLLM V0 run it): the first of them to
        write there copies it. (vLLM V1 runs each sample as a request of its own sharing the
        prompt's full blocks through prefix caching: no partial block is shared.)"""
        self._check_whole(parent)
        self.admit(child)
        self._take(child, self.tables[parent], self.tokens(parent))

    def free(self, request) -> None:
        length = self.tokens(request)
        super().free(request)
        table = self.tables.pop(request)
        for k in reversed(range(len(table))):          # the first block is handed out next
            b = table[k]
            if self.refs[b] > 1:               # another holder keeps it: no longer a duplicate
                self._duplicated -= self._in_block(length, k) * self.layers
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free_blocks.append(b)

    def _check_whole(self, request) -> None:
        lengths = self._lengths_of(request)
        if min(lengths) != max(lengths):
            raise ValueError(f"request {request!r} is part-way through a step (its layers hold "
                             f"{min(lengths)}-{max(lengths)} tokens): share or fork it once every "
                             f"layer has its tokens")

    def _take(self, request, blocks: list[int], tokens: int) -> None:
        for b in blocks:
            self.refs[b] += 1
        self.tables[request] = list(blocks)
        self.lengths[request] = [tokens] * self.layers
        self._held += tokens * self.layers
        self._duplicated += tokens * self.layers

    def _in_block(self, length: int, k: int) -> int:
        """Tokens of a request of ``length`` tokens in its k-th block."""
        return max(0, min(self.block_size, length - k * self.block_size))

    def _shared_tail(self, request) -> int | None:
        """Index in the table of the request's partly filled last block if another request
        holds it too (the next write copies it), else None."""
        length, table = self.tokens(request), self.tables[request]
        k = length // self.block_size
        return k if length % self.block_size and self.refs[table[k]] > 1 else None

    def _make_room(self, request, tokens: int) -> None:
        table = self.tables[request]
        k = self._shared_tail(request) if tokens > self.tokens(request) else None
        missing = self.blocks_for(tokens) - len(table) + (k is not None)
        if missing > len(self.free_blocks):
            raise CacheFull(f"request {request!r} needs {missing} more blocks, "
                            f"{len(self.free_blocks)} free")
        if k is not None:                                      # copy-on-write
            old, new = table[k], self.free_blocks.pop()
            for pool in self.pools:
                pool[new] = pool[old]
            self.refs[old], self.refs[new], table[k] = self.refs[old] - 1, 1, new
            self._duplicated -= self._in_block(self.tokens(request), k) * self.layers
            self.copies += 1
            missing -= 1
        for _ in range(missing):
            table.append(self.free_blocks.pop())
            self.refs[table[-1]] = 1

    def _write(self, request, layer, start, kv):
        # token t of a request lives in block table[t // block_size], slot t % block_size
        positions = torch.arange(start, start + kv.shape[0])
        blocks = torch.tensor(self.tables[request])[positions // self.block_size]
        self.pools[layer][blocks, positions % self.block_size] = kv.to(self.pools[layer])

    def _read(self, request, layer, tokens):
        table = torch.tensor(self.tables[request], dtype=torch.long)
        blocks = self.pools[layer][table]                     # (n_blocks, block_size, 2, Hkv, d)
        return blocks.flatten(0, 1)[:tokens]                  # (T, 2, Hkv, d), a copy


class ContiguousKVCache(_KVCache):
    """One slab of ``max_seq`` tokens per request, reserved whole at admission (as servers
    before vLLM did: FasterTransformer, Orca); ``capacity_bytes`` bounds what all slabs take."""

    def __init__(self, capacity_bytes: int, max_seq: int, layers: int, kv_heads: int,
                 head_dim: int, dtype=torch.float32, device="cpu"):
        super().__init__(layers, kv_heads, head_dim, dtype, device)
        check_positive("capacity_bytes", capacity_bytes)
        check_positive("max_seq", max_seq)
        self.capacity_bytes, self.max_seq = capacity_bytes, max_seq
        self.slab_bytes = max_seq * layers * self.token_layer_bytes
        self.slabs: dict[object, torch.Tensor] = {}

    @property
    def reserved_bytes(self) -> int:
        return len(self.slabs) * self.slab_bytes

    def can_hold(self, request, tokens: int) -> bool:
        """Whether ``request`` (admitted or not) can grow to ``tokens`` tokens now."""
        return tokens <= self.max_seq if request in self.slabs else self.can_admit(tokens)

    def can_admit(self, tokens: int, watermark: float = 0.0) -> bool:
        """Whether a new request fits: a whole slab must, whatever its length (<= max_seq)."""
        room = self.capacity_bytes - self.reserved_bytes
        return tokens <= self.max_seq and self.slab_bytes <= room

    def admit(self, request) -> None:
        if request not in self.lengths and not self.can_admit(0):
            raise CacheFull(f"no room for another slab of {self.max_seq} tokens")
        super().admit(request)
        # (layers, max_seq, 2 for k and v, kv_heads, head_dim)
        self.slabs[request] = torch.zeros(self.layers, self.max_seq, 2, self.kv_heads,
                                          self.head_dim, dtype=self.dtype, device=self.device)

    def free(self, request) -> None:
        super().free(request)
        del self.slabs[request]

    def _make_room(self, request, tokens: int) -> None:
        if tokens > self.max_seq:
            raise CacheFull(f"request {request!r} would hold {tokens} tokens, "
                            f"its slab holds {self.max_seq}")

    def _write(self, request, layer, start, kv):
        self.slabs[request][layer, start:start + kv.shape[0]] = kv

    def _read(self, request, layer, tokens):
        return self.slabs[request][layer, :tokens]           # (T, 2, Hkv, d), a view


def decode_attention(cache: _KVCache, request, layer: int, q: torch.Tensor) -> torch.Tensor:
    """Attention of new queries q (heads, T_q, head_dim), the last T_q tokens of the request,
    over everything the cache holds for it (the decode step of a server)."""
    k, v = cache.gather(request, layer)                       # (T, Hkv, d) each
    k, v = k.transpose(0, 1), v.transpose(0, 1)               # (Hkv, T, d)
    T, T_q = k.shape[1], q.shape[1]
    causal = torch.arange(T) <= torch.arange(T - T_q, T)[:, None]         # (T_q, T)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=causal,
                                          enable_gqa=k.shape[0] != q.shape[0])[0]


# ---- a stream of requests and a server that admits them ----------------------------------

# Mean prompt and output lengths in tokens, from the vLLM paper's Fig. 11 (its workloads:
# ShareGPT chats, where prompts are 8.4x and outputs 5.8x longer than Alpaca instructions).
# The paper shows histograms, not a fit: a lognormal with these means and ``sigma`` (our
# choice, not the paper's) gives the same long right tail.
MEAN_LENGTHS = {"sharegpt": (161.31, 337.99), "alpaca": (19.31, 58.45)}


@dataclass(frozen=True)
class Request:
    id: int
    prompt: int        # tokens in the prompt (filled at admission, the prefill)
    output: int        # tokens generated, one per decode step


def request_stream(n: int, seed: int = 0, dataset: str = "sharegpt", max_seq: int = 2048,
                   sigma: float = 1.0) -> list[Request]:
    """``n`` requests with lognormal prompt and output lengths of the dataset's means, cut so
    prompt + output <= max_seq (the model's context: OPT's, in the paper, is 2048 tokens)."""
    check_positive("n", n)
    check_choice("dataset", dataset, MEAN_LENGTHS)
    check_positive("max_seq", max_seq)
    if max_seq < 2:
        raise ValueError("max_seq must be at least 2: one prompt token and one output token")
    rng = random.Random(seed)

    def draw(mean):     # lognormal of this mean: mu = ln(mean) - sigma^2 / 2
        return max(1, round(rng.lognormvariate(math.log(mean) - sigma ** 2 / 2, sigma)))

    prompt_mean, output_mean = MEAN_LENGTHS[dataset]
    stream = []
    for i in range(n):
        prompt = min(draw(prompt_mean), max_seq - 1)
        stream.append(Request(i, prompt, min(draw(output_mean), max_seq - prompt)))
    return stream


@dataclass
class Simulation:
    """One cache kind serving a stream on a fixed budget; bytes are int, per step timelines."""

    kind: str
    budget: int
    finished: int
    steps: int
    peak_reserved: int
    peak_used: int
    utilisation: float          # used / reserved, summed over the steps
    max_running: int            # most requests decoding at once
    mean_running: float         # requests decoding per step, on average (the batch size)
    preempted: int              # requests sent back to the queue for want of a block
    timeline: dict = field(default_factory=dict)     # reserved, used, running per step
    recomputed: int = 0         # tokens prefilled again after a preemption (its compute price)


def make_cache(kind: str, budget_bytes: int, cfg: ModelConfig | str = "llama-2-13b",
               block_size: int = 16, max_seq: int = 2048, dtype: str = "fp16",
               device="meta") -> _KVCache:
    """A cache of either kind that fits ``budget_bytes`` for the model's geometry; on the
    ``meta`` device the pools cost nothing, which is what a simulation needs."""
    check_choice("kind", kind, ("paged", "contiguous"))
    c = preset(cfg) if isinstance(cfg, str) else cfg
    if c.attention == "mla":
        raise ValueError("the caches hold keys and values per head; use a GQA/MHA preset")
    geometry = dict(layers=c.layers, kv_heads=c.kv_heads, head_dim=c.head_dim,
                    dtype=torch_dtype(dtype), device=device)
    if kind == "contiguous":
        return ContiguousKVCache(budget_bytes, max_seq, **geometry)
    block_bytes = block_size * kv_cache_bytes(c, batch=1, seq=1, dtype=dtype)
    if budget_bytes < block_bytes:
        raise ValueError(f"budget_bytes {budget_bytes} is below one block ({block_bytes})")
    return PagedKVCache(budget_bytes // block_bytes, block_size, **geometry)


def simulate(kind: str, budget_bytes: int, stream: list[Request],
             cfg: ModelConfig | str = "llama-2-13b", block_size: int = 16,
             max_seq: int = 2048, dtype: str = "fp16", watermark: float = 0.01,
             prefix: int = 0, prefix_caching: bool = False) -> Simulation:
    """Serve ``stream`` first come first served: admit while the cache has room (the prompt
    and the first token), decode one token per running request per step, free finished ones.
    A paged cache admits only while ``watermark`` of its blocks stay free; out of blocks, it
    preempts its newest request, which comes back later with its tokens so far as its prompt
    (vLLM's preemption by recomputation: it costs compute, not memory). ``prefix``: tokens of a
    system prompt every prompt starts with; ``prefix_caching`` (paged): a new request shares
    the full blocks of a running request's prefix (vLLM also keeps finished requests' blocks
    cached until it needs them: not modelled)."""
    cache = make_cache(kind, budget_bytes, cfg, block_size, max_seq, dtype)
    if prefix_caching and kind != "paged":
        raise ValueError("prefix_caching shares blocks: it needs kind='paged'")
    for request in stream:
        if not cache.can_hold(None, prefix + request.prompt + request.output):
            raise ValueError(f"request {request.id} ({request.prompt} + {request.output} tokens)"
                             f" cannot fit an empty {kind} cache (max_seq {max_seq}, "
                             f"{budget_bytes} bytes): raise the budget or shorten the stream")
    queue, running = deque(stream), {}                       # running: Request -> generated
    timeline = {"reserved": [], "used": [], "running": []}
    finished = preempted = recomputed = 0
    requeued = set()                                         # ids sent back, to be prefilled again
    while queue or running:
        holder = next(iter(running)).id if prefix_caching and prefix and running else None
        shared = prefix // block_size * block_size if holder is not None else 0
        while queue and cache.can_admit(prefix + queue[0].prompt + 1 - shared,
                                        watermark if running else 0.0):
            request = queue.popleft()
            if holder is not None:
                cache.share(holder, request.id, prefix)
            else:
                cache.admit(request.id)
            cache.grow(request.id, prefix + request.prompt - shared)     # the prefill
            if request.id in requeued:                        # its cache computed again
                recomputed += prefix + request.prompt - shared
            running[request] = 0
            if prefix_caching and prefix and holder is None:
                holder, shared = request.id, prefix // block_size * block_size
        for request in list(running):
            if request not in running:                       # preempted earlier in this step
                continue
            while not cache.can_hold(request.id, cache.tokens(request.id) + 1):
                victim = next(reversed(running))            # the newest request goes back
                done = running.pop(victim)
                cache.free(victim.id)
                queue.appendleft(Request(victim.id, victim.prompt + done, victim.output - done))
                preempted += 1
                requeued.add(victim.id)
                if victim is request:
                    break
            if request not in running:
                continue
            cache.grow(request.id, 1)                        # one decode step
            running[request] += 1
            if running[request] == request.output:
                cache.free(request.id)
                del running[request]
                finished += 1
        timeline["reserved"].append(cache.reserved_bytes)
        timeline["used"].append(cache.used_bytes)
        timeline["running"].append(len(running))
    return Simulation(kind, budget_bytes, finished, len(timeline["used"]),
                      max(timeline["reserved"]), max(timeline["used"]),
                      sum(timeline["used"]) / max(1, sum(timeline["reserved"])),
                      max(timeline["running"]),
                      sum(timeline["running"]) / len(timeline["running"]), preempted, timeline,
                      recomputed)


def compare_caches(budget_bytes: int, stream: list[Request], **kwargs) -> dict[str, Simulation]:
    """Both kinds on one budget and one stream: {"contiguous": ..., "paged": ...}."""
    return {kind: simulate(kind, budget_bytes, stream, **kwargs)
            for kind in ("contiguous", "paged")}
