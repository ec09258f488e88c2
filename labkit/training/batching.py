"""Padding vs packing, and gradient accumulation: how documents of many lengths become batches.

- ``pad_batches``: documents in dataset order, each batch padded to its longest document
  (or to a fixed length): every padding position costs memory and compute for nothing.
- ``bucket_batches``: documents sorted by length first, so each batch pads little.
- ``budget_batches``: sorted too, but each batch takes as many documents as fit in a budget
  of padded positions (a "token budget", as fairseq's ``max_tokens``): many short documents
  or a few long ones, so every batch is about the size the memory was planned for.
- ``pack_batches``: whole documents packed into rows of fixed length (first-fit decreasing
  bin packing), with position ids that restart in each document and a block-diagonal causal
  mask, or variable-length attention over the documents' offsets (no mask), so that no token
  attends across documents (Krell et al., 2021, "Efficient Sequence Packing without
  Cross-contamination").

``accumulate_gradients`` sums the gradients of k micro-batches into those of one large batch:
the activations shrink with the micro-batch, the optimizer state does not change.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

from labkit.core.config import preset
from labkit.core.units import check_positive
from labkit.training.measure import init_optimizer_state
from labkit.training.step import make_optimizer
from labkit.training.track import MemoryTracker
from labkit.transformer.model import build_model

IGNORE = -100          # F.cross_entropy's ignore_index: positions that predict nothing


# ---- a realistic spread of document lengths ------------------------------------------------
def document_lengths(n: int, max_len: int = 2048, median: float = 256, sigma: float = 1.0,
                     min_len: int = 16, seed: int = 0) -> list[int]:
    """``n`` log-normal document lengths, clipped to [min_len, max_len]; repeatable per seed.

    Log-normal: most documents are short, a long tail is long (median ``median``; ``sigma``
    is the spread of log-length). The defaults are illustrative, not fitted to a corpus.
    """
    if n <= 0 or not 2 <= min_len <= max_len:
        raise ValueError(f"need n > 0 and 2 <= min_len <= max_len, got n={n}, "
                         f"min_len={min_len}, max_len={max_len}")
    g = torch.Generator().manual_seed(seed)
    raw = torch.empty(n, dtype=torch.float64).log_normal_(math.log(median), sigma, generator=g)
    return raw.round().clamp(min_len, max_len).long().tolist()


def make_documents(lengths: list[int], vocab_size: int = 256, seed: int = 0) -> list[torch.Tensor]:
    """Random token ids, one int64 tensor per document length."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g) for n in lengths]


# ---- batches and what they cost ------------------------------------------------------------
@dataclass
class Batch:
    """One batch. A document of L tokens fills L positions and predicts L - 1 next tokens."""

    tokens: torch.Tensor                      # (B, T) int64 inputs, 0 on padding
    targets: torch.Tensor                     # (B, T) int64 next token, IGNORE where none
    real_tokens: int                          # positions holding a document token
    position_ids: torch.Tensor | None = None  # (B, T) position in its document (packing only)
    doc_ids: torch.Tensor | None = None       # (B, T) document index in its row, -1 on padding

    @property
    def padding(self) -> int:
        return self.tokens.numel() - self.real_tokens

    @property
    def nbytes(self) -> int:
        """Bytes of the batch's tensors (what the data loader hands to the device)."""
        return sum(t.nbytes for t in (self.tokens, self.targets, self.position_ids,
                                      self.doc_ids) if t is not None)

    @property
    def mask_bytes(self) -> int:
        """Elements of packing's dense (B, 1, T, T) mask, one byte each; 0 if none.

        The model turns ``doc_ids`` into one additive ``labkit.transformer.model.document_mask`` in
        its compute dtype: x2 or x4 these bytes as bf16/fp32. Right padding needs no mask: a
        causal model never looks ahead at it.
        """
        B, T = self.tokens.shape
        return B * T * T if self.doc_ids is not None else 0


@dataclass
class Batching:
    """A batcher's output and its totals: real tokens, padding positions, tensor bytes."""

    name: str
    batches: list[Batch] = field(repr=False)
    tokens: int
    padding: int
    nbytes: int
    mask_bytes: int

    @property
    def waste(self) -> float:
        """Fraction of all positions that are padding."""
        return self.padding / (self.tokens + self.padding)

    @property
    def largest_batch(self) -> int:
        """Positions (B x T) of the largest batch: what sets the activation peak."""
        return max(b.tokens.numel() for b in self.batches)

    @property
    def steps(self) -> int:
        return len(self.batches)

    @property
    def utilisation(self) -> float:
        """Real tokens per step over the largest batch's positions: the share of the activation
        memory a run must plan for (the largest batch) that real tokens use, on average."""
        return self.tokens / (self.steps * self.largest_batch)

    @property
    def largest_mask_bytes(self) -> int:
        """The largest one step's dense mask, one byte per element (x4 as an fp32 mask)."""
        return max(b.mask_bytes for b in self.batches)


def summarise(name: str, batches: list[Batch]) -> Batching:
    """Totals over ``batches``."""
    return Batching(name, batches, sum(b.real_tokens for b in batches),
                    sum(b.padding for b in batches), sum(b.nbytes for b in batches),
                    sum(b.mask_bytes for b in batches))


def _rows(rows: list[list[torch.Tensor]], T: int, packed: bool) -> Batch:
    """Lay each row's documents side by side in T positions; padding at the end."""
    B = len(rows)
    tokens = torch.zeros(B, T, dtype=torch.long)
    targets = torch.full((B, T), IGNORE, dtype=torch.long)
    positions = torch.zeros(B, T, dtype=torch.long)
    doc_ids = torch.full((B, T), -1, dtype=torch.long)
    start = [0] * B
    for r, docs in enumerate(rows):
        for d, doc in enumerate(docs):
            s, n = start[r], len(doc)
            if s + n > T:
                raise ValueError(f"a document of {n} tokens does not fit in rows of {T}; "
                                 f"raise the row length or split long documents first")
            tokens[r, s:s + n] = doc
            targets[r, s:s + n - 1] = doc[1:]
            positions[r, s:s + n] = torch.arange(n)
            doc_ids[r, s:s + n] = d
            start[r] = s + n
    if not packed:
        return Batch(tokens, targets, sum(start))
    return Batch(tokens, targets, sum(start), positions, doc_ids)


def _padded(docs: list[torch.Tensor], batch_size: int, pad_to: int | None) -> list[Batch]:
    """One document per row, ``batch_size`` rows per batch, padded to ``pad_to`` or the longest."""
    check_positive("batch_size", batch_size)
    groups = [docs[i:i + batch_size] for i in range(0, len(docs), batch_size)]
    return [_rows([[d] for d in g], pad_to or max(map(len, g)), packed=False) for g in groups]


def pad_batches(docs: list[torch.Tensor], batch_size: int, pad_to: int | None = None) -> Batching:
    """Batches of ``batch_size`` documents in order, padded to the longest (or to ``pad_to``)."""
    name = "pad to max" if pad_to else "pad to longest"
    return summarise(name, _padded(docs, batch_size, pad_to))


def bucket_batches(docs: list[torch.Tensor], batch_size: int) -> Batching:
    """Documents sorted by length, then batched and padded to each batch's longest."""
    return summarise("length buckets", _padded(sorted(docs, key=len), batch_size, None))


def budget_groups(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Document indices per batch: shortest first, each batch as many documents as fit in
    ``max_tokens`` positions once padded to its longest (its last, as they are sorted)."""
    check_positive("max_tokens", max_tokens)
    if max(lengths) > max_tokens:
        raise ValueError(f"a document of {max(lengths)} tokens does not fit in a budget of "
                         f"{max_tokens} positions; raise max_tokens or split long documents")
    groups: list[list[int]] = [[]]
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if (len(groups[-1]) + 1) * lengths[i] > max_tokens:       # padded to this, the longest
            groups.append([])
        groups[-1].append(i)
    return groups


def budget_batches(docs: list[torch.Tensor], max_tokens: int) -> Batching:
    """Documents sorted by length, each batch filled up to ``max_tokens`` padded positions."""
    groups = budget_groups([len(d) for d in docs], max_tokens)
    return summarise("token budget", [_rows([[docs[i]] for i in g], len(docs[g[-1]]), packed=False)
                                      for g in groups])


def compare_batching(lengths: list[int], max_tokens: int, seed: int = 0) -> list[Batching]:
    """Every batcher planned for the same peak of ``max_tokens`` positions a step: fixed
    batches of max_tokens // longest documents (padded to the longest document, to each
    batch's longest, in length buckets), a token budget, and packing into rows as long as the
    longest document."""
    docs, seq = make_documents(lengths, seed=seed), max(lengths)
    if max_tokens < seq:
        raise ValueError(f"max_tokens={max_tokens} is below the longest document ({seq}); "
                         f"plan at least one longest document per step")
    batch = max_tokens // seq
    return [pad_batches(docs, batch, pad_to=seq), pad_batches(docs, batch),
            bucket_batches(docs, batch), budget_batches(docs, max_tokens),
            pack_batches(docs, seq, rows_per_batch=batch)]


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Document indices per row: longest first, each into the first row with room for it."""
    rows, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = next((r for r, free in enumerate(room) if lengths[i] <= free), len(rows))
        if r == len(rows):
            rows.append([])
            room.append(capacity)
        rows[r].append(i)
        room[r] -= lengths[i]
    return rows


def pack_batches(docs: list[torch.Tensor], seq: int, rows_per_batch: int = 1) -> Batching:
    """Whole documents packed into rows of ``seq`` tokens, ``rows_per_batch`` rows a batch."""
    check_positive("seq", seq)
    check_positive("rows_per_batch", rows_per_batch)
    rows = [[docs[i] for i in row] for row in first_fit_decreasing([len(d) for d in docs], seq)]
    batches = [_rows(rows[i:i + rows_per_batch], seq, packed=True)
               for i in range(0, len(rows), rows_per_batch)]
    return summarise("packing", batches)


# ---- attention inside documents only ------------------------------------------------------
@dataclass
class PackedLossCheck:
    """Loss of packed rows vs each document run alone."""

    packed: float                # mean over every predicted token of the packed rows
    per_document: list[float]    # each document's own mean loss
    predictions: list[int]       # tokens each document predicts (its length - 1)

    @property
    def document_mean(self) -> float:
        """Per-document losses averaged with weights = tokens predicted (what packing computes)."""
        total = sum(loss * n for loss, n in zip(self.per_document, self.predictions))
        return total / sum(self.predictions)


ATTENTION = ("mask", "varlen", "causal")


def packing_inputs(batch: Batch, attention: str = "mask") -> dict:
    """The model's keyword arguments for packed rows: documents isolated by a dense ``"mask"``,
    by ``"varlen"`` attention over their offsets, or not at all (``"causal"``: they leak)."""
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
    if batch.doc_ids is None:
        raise ValueError("this batch is not packed: make it with pack_batches")
    if attention == "causal":
        return {}
    return dict(position_ids=batch.position_ids, doc_ids=batch.doc_ids,
                varlen=attention == "varlen")


@dataclass
class PackedStepMemory:
    """Bytes of one forward + backward pass over packed rows."""

    attention: str
    kept: int       # activations alive at the end of the forward pass
    peak: int       # the most bytes alive at once, weights included


def packed_step_memory(model, batch: Batch, attention: str = "mask") -> PackedStepMemory:
    """Forward and backward of ``model`` on one packed batch under the tracker."""
    packing = packing_inputs(batch, attention)
    model.zero_grad(set_to_none=True)
    with MemoryTracker(model) as mt:
        with mt.phase("forward"):
            loss = model(batch.tokens, batch.targets, **packing)
        kept = mt.by_category["activations"]
        with mt.phase("backward"):
            loss.backward()
    model.zero_grad(set_to_none=True)
    return PackedStepMemory(attention, kept, mt.peak)


def packed_gradients(model, batch: Batch, attention: str = "mask") -> list[torch.Tensor]:
    """The loss and every parameter's gradient after one packed batch: to compare the paths."""
    model.zero_grad(set_to_none=True)
    loss = model(batch.tokens, batch.targets, **packing_inputs(batch, attention))
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


@torch.no_grad()
def packed_loss_equals_per_document_loss(model, docs: list[torch.Tensor], seq: int,
                                         isolate: bool = True,
                                         varlen: bool = False) -> PackedLossCheck:
    """Run ``docs`` packed into rows of ``seq`` and one by one; both losses, side by side.

    With ``isolate=False`` the rows use plain causal attention and running positions:
    tokens then see the previous documents, and the losses differ. ``varlen=True`` isolates
    them by attention over their offsets instead of a dense mask.
    """
    batch = _rows([[docs[i] for i in row] for row in
                   first_fit_decreasing([len(d) for d in docs], seq)], seq, packed=True)
    attention = ("varlen" if varlen else "mask") if isolate else "causal"
    packed = model(batch.tokens, batch.targets, **packing_inputs(batch, attention)).item()
    alone = [model(d[None, :-1], d[None, 1:]).item() for d in docs]          # (1, L - 1) each
    return PackedLossCheck(packed, alone, [len(d) - 1 for d in docs])


# ---- gradient accumulation ---------------------------------------------------------------
def accumulate_gradients(model, micro_batches, tracker=None) -> float:
    """Backward over each (tokens, targets) micro-batch; ``.grad`` then holds the whole batch's.

    Each micro-batch's mean loss is weighted by its share of the predicted tokens: 1/k for k
    equal micro-batches, and still exact when padding makes their token counts differ.
    Returns the whole batch's loss.
    """
    phase = tracker.phase if tracker is not None else (lambda name: contextlib.nullcontext())
    counts = [int((targets != IGNORE).sum()) for _, targets in micro_batches]
    total, loss_sum = sum(counts), 0.0
    for (tokens, targets), n in zip(micro_batches, counts):
        with phase("forward"):
            loss = model(tokens, targets) * (n / total)
        with phase("backward"):
            loss.backward()
        loss_sum += loss.item()
        del loss
    return loss_sum


@dataclass
class AccumulationMemory:
    """Bytes at the peak of one accumulated step (fp32, AdamW), and the largest of each kind."""

    micro_batch: int
    steps: int
    peak: int
    activations: int      # most activation bytes alive at once
    grads: int
    optimizer: int


def measure_accumulation(cfg, micro_batch: int, steps: int, seq: int = 128,
                         seed: int = 0) -> AccumulationMemory:
    """One training step of ``micro_batch`` x ``steps`` sequences under the tracker.

    All micro-batches' token ids stay resident (8 bytes per position): the only activation
    bytes that grow with ``steps``.
    """
    check_positive("micro_batch", micro_batch)
    check_positive("steps", steps)
    cfg = preset(cfg) if isinstance(cfg, str) else cfg
    torch.manual_seed(seed)
    model = build_model(cfg)
    opt = make_optimizer(model.parameters())
    init_optimizer_state(model, opt)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch * steps, seq + 1))
    micro = [(t[:, :-1], t[:, 1:]) for t in tokens.split(micro_batch)]      # (b, T) each
    with MemoryTracker(model, opt) as mt:
        accumulate_gradients(model, micro, tracker=mt)
        with mt.phase("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
    by = mt.timeline.by_category
    return AccumulationMemory(micro_batch, steps, mt.peak, max(by["activations"]),
                              max(by["grads"]), mt.by_category["optimizer"])
