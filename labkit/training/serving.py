"""How a server sizes its KV-cache block pool: vLLM's profiling run (lab 07).

A server takes a fixed share of the GPU, ``gpu_memory_utilization`` (vLLM's default 0.9), for
everything it holds: the weights, the activations of its largest step and the KV-cache blocks.
It loads the weights, runs one forward pass of the largest step it will schedule
(``max_num_batched_tokens`` tokens over ``max_num_seqs`` requests, the sampler on the last
token of each), and notes the peak. What is left of the share becomes blocks, allocated at once.

    pool = size_block_pool("llama-2-13b", "a100-40gb")
    pool.blocks, pool.tokens, pool.concurrency(4096)

Here the profile is labkit's model on fake tensors (real shapes, no memory) under the tracker.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from labkit.core.config import ModelConfig, preset
from labkit.core.gpus import GPU, gpu
from labkit.core.units import check_positive, fmt_bytes, torch_dtype
from labkit.predict import kv_cache_bytes
from labkit.training.track import MemoryTracker
from labkit.transformer.model import PackedRotary, build_model, embed_tokens


@dataclass(frozen=True)
class Profile:
    """What the profiling run saw: the weights, and the forward's peak above them."""

    weights: int
    activations: int


@dataclass(frozen=True)
class BlockPool:
    """The server's share of the GPU, spent: weights, the profiled peak, other bytes named by
    the caller, and what is left as whole blocks of ``block_size`` tokens."""

    share: int                  # the GPU's memory x gpu_memory_utilization
    weights: int
    activations: int            # the profiling run's peak above the weights
    other: int                  # non-torch memory (NCCL, cuBLAS workspaces, CUDA graphs)
    block_bytes: int            # one block of every layer's keys and values
    block_size: int
    blocks: int

    @property
    def kv_bytes(self) -> int:
        return self.blocks * self.block_bytes

    @property
    def tokens(self) -> int:
        """Tokens the pool holds ("GPU KV cache size" in vLLM's log)."""
        return self.blocks * self.block_size

    def as_dict(self, max_model_len: int) -> dict:
        return {**asdict(self), "kv_bytes": self.kv_bytes, "tokens": self.tokens,
                "max_model_len": max_model_len, "concurrency": self.concurrency(max_model_len)}

    def table(self, max_model_len: int) -> str:
        """The share spent, row by row, then the blocks and what they hold."""
        rows = {"share (gpu_memory_utilization x memory)": self.share, "weights": self.weights,
                "profiled peak above the weights": self.activations,
                "other (NCCL, CUDA graphs: given)": self.other, "KV-cache pool": self.kv_bytes}
        return "\n".join([f"{k:<40}{fmt_bytes(v):>13}" for k, v in rows.items()] + [
            f"{'blocks':<40}{self.blocks:>13,} of {self.block_size} tokens "
            f"({fmt_bytes(self.block_bytes)} each)",
            f"{'tokens the pool holds':<40}{self.tokens:>13,}",
            f"{'max concurrency':<40}{self.concurrency(max_model_len):>13.2f} requests of "
            f"{max_model_len:,} tokens"])

    def concurrency(self, tokens_per_request: int) -> float:
        """Requests of that many tokens the pool holds at once, each in whole blocks (vLLM's
        "Maximum concurrency")."""
        check_positive("tokens_per_request", tokens_per_request)
        return self.blocks / -(-tokens_per_request // self.block_size)


def rank_shard(cfg: ModelConfig | str, tp: int = 1) -> ModelConfig:
    """What one of ``tp`` tensor-parallel ranks holds, as a model of its own: a share of the
    heads (kv heads replicated when fewer than ranks), of each MLP and expert, of the
    vocabulary (rounded up); norms and the residual stream whole."""
    c = preset(cfg) if isinstance(cfg, str) else cfg
    check_positive("tp", tp)
    if tp == 1:
        return c
    widths = {"heads": c.heads, "ffn": c.ffn, "moe_ffn": c.moe_ffn}
    uneven = [f"{k} {v}" for k, v in widths.items() if v % tp]
    if c.kv_heads % tp and tp % c.kv_heads:              # neither split nor replicated evenly
        uneven.append(f"kv_heads {c.kv_heads}")
    if uneven:
        raise ValueError(f"tp={tp} does not divide {', '.join(uneven)} of {c.name}: pick a tp "
                         f"that divides them")
    return c.replace(name=f"{c.name} (1 of tp={tp})", heads=c.heads // tp,
                     kv_heads=max(1, c.kv_heads // tp), head_dim=c.head_dim,
                     ffn=c.ffn // tp, moe_ffn=c.moe_ffn // tp,
                     vocab_size=-(-c.vocab_size // tp))


@functools.lru_cache(maxsize=16)          # a sweep over the share profiles each step once
def profile_forward(cfg: ModelConfig | str, max_num_batched_tokens: int = 8192,
                    max_num_seqs: int = 256, dtype: str = "bf16", fake: bool = True,
                    device: str = "cpu", gathered_vocab: int | None = None) -> Profile:
    """One no-grad forward of ``max_num_batched_tokens`` tokens of ``max_num_seqs`` requests
    in one row (positions restart per request; one causal SDPA over the row), then the LM head
    and a sampler (fp32 logits, softmax, exponential noise divided in place, as vLLM's; no
    top-k/top-p) on each request's last token. ``gathered_vocab``: a tensor-parallel shard's
    logits are all-gathered to the whole vocabulary first, as vLLM does. Bytes of labkit's
    model on fake tensors (``fake=False``: real ones, on ``device``)."""
    c = preset(cfg) if isinstance(cfg, str) else cfg
    tokens = check_positive("max_num_batched_tokens", max_num_batched_tokens)
    requests = min(tokens, check_positive("max_num_seqs", max_num_seqs))
    # requests of equal length, the remainder to the last, as vLLM's dummy run makes them
    lengths = [tokens // requests] * requests
    lengths[-1] += tokens % requests
    if lengths[-1] > c.max_seq:
        raise ValueError(f"a profiled request of {lengths[-1]} tokens exceeds labkit's RoPE "
                         f"tables (max_seq {c.max_seq}); raise max_num_seqs, lower "
                         f"max_num_batched_tokens, or pass cfg.replace(max_seq=...)")
    with FakeTensorMode() if fake else torch.device(device):
        positions = torch.cat([torch.arange(n) for n in lengths])[None]  # restart per request
        last = torch.tensor(lengths).cumsum(0) - 1                       # each request's last token
        model = build_model(c, torch_dtype(dtype)).eval()
        ids = torch.zeros(1, tokens, dtype=torch.long)
        with torch.no_grad(), MemoryTracker(model) as mt:
            weights = mt.current
            rope = PackedRotary(model.rope, positions)
            x = embed_tokens(model.embed, ids, c)                           # (1, T, hidden)
            x = model.run_blocks(x, 0, c.layers, rope)
            logits = model.lm_head(model.norm(x[0, last]))                  # (requests, vocab/tp)
            del x
            if gathered_vocab:                                              # (requests, vocab)
                logits = logits.new_empty(len(lengths), gathered_vocab)
            probs = F.softmax(logits.float(), dim=-1)
            del logits
            noise = torch.empty_like(probs).exponential_()
            probs.div_(noise).argmax(dim=-1)
    return Profile(weights, mt.peak - weights)


def size_block_pool(cfg: ModelConfig | str, device: GPU | str,
                    gpu_memory_utilization: float = 0.9, max_num_batched_tokens: int = 8192,
                    max_num_seqs: int = 256, block_size: int = 16, dtype: str = "bf16",
                    kv_dtype: str | None = None, other: int = 0, tp: int = 1,
                    max_model_len: int | None = None) -> BlockPool:
    """The blocks a vLLM-style server allocates on each of ``tp`` GPUs ``device``: its share
    of the GPU (the table's memory, nvidia-smi's: CUDA reports about 0.5 GiB less) less one
    rank's weights, its profiled forward's peak and ``other`` bytes, in whole blocks. With
    ``max_model_len`` it refuses a pool that cannot hold one such request, as vLLM does."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization is a fraction in (0, 1], got "
                         f"{gpu_memory_utilization!r}")
    if other < 0:
        raise ValueError(f"other is bytes, zero or more, got {other!r}")
    c = preset(cfg) if isinstance(cfg, str) else cfg
    check_positive("block_size", block_size)
    if max_model_len is not None and check_positive("max_model_len", max_model_len) > c.max_seq:
        raise ValueError(f"max_model_len {max_model_len} exceeds {c.name}'s context "
                         f"({c.max_seq} tokens); lower it")
    profile = profile_forward(rank_shard(c, tp), max_num_batched_tokens, max_num_seqs, dtype,
                              gathered_vocab=c.vocab_size if tp > 1 else None)
    g = gpu(device)
    share = int(g.memory * gpu_memory_utilization)
    # every layer's blocks per token: vLLM V1 frees a windowed layer's old blocks (not modelled)
    block_bytes = block_size * kv_cache_bytes(c, 1, 1, kv_dtype or dtype, tp=tp, windows=False)
    blocks = max(0, share - profile.weights - profile.activations - other) // block_bytes
    needed = -(-(max_model_len or 1) // block_size)
    if blocks < needed:
        wanted = (f"the {needed} one request of {max_model_len} tokens needs" if max_model_len
                  else "one")
        raise ValueError(f"{c.name}'s weights ({profile.weights / 2**30:.2f} GiB) and profiled "
                         f"peak ({profile.activations / 2**30:.2f} GiB) leave {blocks} blocks in "
                         f"{gpu_memory_utilization:.0%} of {g.name}, below {wanted}: raise "
                         f"gpu_memory_utilization, lower max_model_len or "
                         f"max_num_batched_tokens, or shard the model over more GPUs (tp)")
    return BlockPool(share, profile.weights, profile.activations, other, block_bytes,
                     block_size, blocks)
