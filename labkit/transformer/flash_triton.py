"""FlashAttention-2 as Triton kernels: the forward pass and the backward pass of Dao (2023),
Algorithms 1 and 2, with the structure of Triton's fused-attention tutorial.

``labkit.transformer.attention.TiledAttention`` runs the same loops in PyTorch, one (B, H) batch of
tiles per step; here each loop body is a GPU program that holds its tiles in on-chip memory (SRAM)
and registers, so the (T_q, T_k) scores never reach GPU memory (HBM):

- ``_forward_kernel``: one program per (query tile, batch, head). It loads a tile of Q, loops
  over the tiles of K and V with a running max and sum (the online softmax), and writes O and
  one log-sum-exp per row.
- ``_delta_kernel``: D = rowsum(dO * O), the term the softmax's backward pass needs per row.
- ``_dkdv_kernel``: one program per (key tile, batch, key/value head). It loops over the query
  tiles (of every query head sharing its key/value head) and accumulates dK and dV, recomputing
  the probabilities from the saved log-sum-exp.
- ``_dq_kernel``: one program per (query tile, batch, head) looping over the key tiles for dQ.
  The paper's Algorithm 2 adds each tile's dQ into HBM with atomics from the dK/dV loop; a
  second loop (as Triton's tutorial does) needs no atomics and gives the same numbers each run.

Conventions as ``labkit.transformer.attention``: (B, H, T, d) tensors, grouped key/value heads,
causal = top-left aligned as SDPA (query i sees keys 0..i). Every tile multiplies in the inputs'
dtype and accumulates in fp32; fp32 inputs multiply in full fp32 ("ieee", not Triton's
default tf32). Production kernels also fold log2(e) into the scale and use exp2, and skip the
causal mask off the diagonal; this one keeps exp and one mask so that it reads as the paper.

Triton is optional (``pip install -e ".[triton]"``); no labkit module but this one imports it.
On a CPU, Triton's interpreter runs the kernels on CPU tensors (fp32 and fp16; slow, for small
shapes). It needs ``TRITON_INTERPRET=1`` before triton is first imported - and
``import labkit`` imports it when it is installed (``torch.utils.flop_counter`` does) - so set it
first: ``TRITON_INTERPRET=1 python ...``, or ``os.environ`` in a notebook's first cell.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:           # labkit works without triton; flash_attention says how to get it
    triton = tl = None

HEAD_DIMS = (16, 32, 64, 128)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INSTALL = 'pip install -e ".[triton]"'


def jit(fn):
    """``triton.jit(fn)``; without triton the kernel stays a plain function that is never run."""
    return fn if triton is None else triton.jit(fn)


@jit
def _load_tile(ptr, index, stride, dims, n):
    """The rows ``index`` (those below n; zeros past it) of a (n, d) matrix: (len(index), d)."""
    return tl.load(ptr + index[:, None] * stride + dims[None, :], mask=index[:, None] < n,
                   other=0.0)


# ---- forward: Algorithm 1 ----------------------------------------------------------------------
@jit
def _forward_kernel(Q, K, V, O, LSE,
                    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                    stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot,
                    H, GROUP, T_Q, T_K, scale,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """O and the log-sum-exp of one tile of BLOCK_M queries of one (batch, head)."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H       # int64: offsets past 2**31 numbers stay right
    kv_h = h // GROUP                           # the key/value head this query head reads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                          # (BLOCK_M,)
    dims = tl.arange(0, HEAD_DIM)                                           # (d,)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + kv_h * stride_kh
    V += b * stride_vb + kv_h * stride_vh
    q = _load_tile(Q, rows, stride_qt, dims, T_Q)                           # (BLOCK_M, d)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)  # m: the largest score so far
    row_sum = tl.zeros([BLOCK_M], tl.float32)                 # l: sum of exp(score - m)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)           # sum of exp(score - m) * v
    end = T_K
    if CAUSAL:                        # no key past the tile's last row is seen by any of it
        end = tl.minimum(T_K, (pid_m + 1) * BLOCK_M)
    for start in range(0, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)                                # (BLOCK_N,)
        k = _load_tile(K, cols, stride_kt, dims, T_K)                       # (BLOCK_N, d)
        v = _load_tile(V, cols, stride_vt, dims, T_K)                       # (BLOCK_N, d)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale      # (BLOCK_M, BLOCK_N)
        seen = cols[None, :] < T_K
        if CAUSAL:
            seen = seen & (cols[None, :] <= rows[:, None])
        s = tl.where(seen, s, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, 1))   # finite: every row sees key 0 first
        p = tl.exp(s - new_max[:, None])                                    # (BLOCK_M, BLOCK_N)
        rescale = tl.exp(row_max - new_max)       # what the old sums were counted in
        row_sum = row_sum * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        row_max = new_max
    o = acc / row_sum[:, None]                                              # (BLOCK_M, d)
    O += b * stride_ob + h * stride_oh
    tl.store(O + rows[:, None] * stride_ot + dims[None, :], o.to(O.dtype.element_ty),
             mask=rows[:, None] < T_Q)
    # log-sum-exp of the row's scores: all the backward pass needs to make P again
    tl.store(LSE + (b * H + h) * T_Q + rows, row_max + tl.log(row_sum), mask=rows < T_Q)


# ---- backward: Algorithm 2 ---------------------------------------------------------------------
@jit
def _delta_kernel(O, DO, DELTA,
                  stride_ob, stride_oh, stride_ot, stride_db, stride_dh, stride_dt,
                  H, T_Q, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """D = rowsum(dO * O) of one tile of rows (= rowsum(dP * P), the softmax's backward term)."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    o = _load_tile(O + b * stride_ob + h * stride_oh, rows, stride_ot, dims, T_Q)  # (BLOCK_M, d)
    do = _load_tile(DO + b * stride_db + h * stride_dh, rows, stride_dt, dims, T_Q)  # (BLOCK_M, d)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)                 # (BLOCK_M,)
    tl.store(DELTA + (b * H + h) * T_Q + rows, delta, mask=rows < T_Q)


@jit
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV,
                 stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                 stride_vb, stride_vh, stride_vt, stride_db, stride_dh, stride_dt,
                 stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt,
                 H, GROUP, T_Q, T_K, scale,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """dK and dV of one tile of BLOCK_N keys of one (batch, key/value head), summed over the
    query heads that share it. Works on transposed tiles (keys by queries) so that no
    product needs a transpose of its result."""
    pid_n, bh = tl.program_id(0), tl.program_id(1)
    H_KV = H // GROUP
    b, kv_h = (bh // H_KV).to(tl.int64), bh % H_KV
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                          # (BLOCK_N,) keys
    dims = tl.arange(0, HEAD_DIM)
    K += b * stride_kb + kv_h * stride_kh
    V += b * stride_vb + kv_h * stride_vh
    k = _load_tile(K, cols, stride_kt, dims, T_K)                           # (BLOCK_N, d)
    v = _load_tile(V, cols, stride_vt, dims, T_K)                           # (BLOCK_N, d)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    start_m = 0
    if CAUSAL:                          # the first query tile with a row that sees these keys
        start_m = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M
    for h in range(kv_h * GROUP, (kv_h + 1) * GROUP):    # the query heads reading these keys
        q_ptr = Q + b * stride_qb + h * stride_qh
        do_ptr = DO + b * stride_db + h * stride_dh
        row_ptr = (b * H + h) * T_Q                           # into LSE and DELTA (B, H, T_q)
        for start in range(start_m, T_Q, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)                            # (BLOCK_M,) queries
            q = _load_tile(q_ptr, rows, stride_qt, dims, T_Q)               # (BLOCK_M, d)
            do = _load_tile(do_ptr, rows, stride_dt, dims, T_Q)             # (BLOCK_M, d)
            lse = tl.load(LSE + row_ptr + rows, mask=rows < T_Q, other=0.0)      # (BLOCK_M,)
            delta = tl.load(DELTA + row_ptr + rows, mask=rows < T_Q, other=0.0)  # (BLOCK_M,)
            s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * scale  # (BLOCK_N, BLOCK_M)
            seen = (cols[:, None] < T_K) & (rows[None, :] < T_Q)
            if CAUSAL:
                seen = seen & (cols[:, None] <= rows[None, :])
            p_t = tl.where(seen, tl.exp(s_t - lse[None, :]), 0.0)   # the forward's P, again
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)   # (BLOCK_N, d)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)       # (BLOCK_N, BLOCK_M)
            ds_t = p_t * (dp_t - delta[None, :])                    # the softmax's backward
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)    # (BLOCK_N, d)
    dk *= scale                         # S = scale * Q K^T: dK = scale * dS^T Q
    DK += b * stride_dkb + kv_h * stride_dkh
    DV += b * stride_dvb + kv_h * stride_dvh
    tl.store(DK + cols[:, None] * stride_dkt + dims[None, :], dk.to(DK.dtype.element_ty),
             mask=cols[:, None] < T_K)
    tl.store(DV + cols[:, None] * stride_dvt + dims[None, :], dv.to(DV.dtype.element_ty),
             mask=cols[:, None] < T_K)


@jit
def _dq_kernel(Q, K, V, DO, LSE, DELTA, DQ,
               stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
               stride_vb, stride_vh, stride_vt, stride_db, stride_dh, stride_dt,
               stride_dqb, stride_dqh, stride_dqt,
               H, GROUP, T_Q, T_K, scale,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """dQ of one tile of BLOCK_M queries of one (batch, head): the forward's loop over keys,
    with P made again from the log-sum-exp."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    kv_h = h // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                          # (BLOCK_M,)
    dims = tl.arange(0, HEAD_DIM)
    K += b * stride_kb + kv_h * stride_kh
    V += b * stride_vb + kv_h * stride_vh
    q = _load_tile(Q + b * stride_qb + h * stride_qh, rows, stride_qt, dims, T_Q)  # (BLOCK_M, d)
    do = _load_tile(DO + b * stride_db + h * stride_dh, rows, stride_dt, dims, T_Q)  # (BLOCK_M, d)
    lse = tl.load(LSE + (b * H + h) * T_Q + rows, mask=rows < T_Q, other=0.0)       # (BLOCK_M,)
    delta = tl.load(DELTA + (b * H + h) * T_Q + rows, mask=rows < T_Q, other=0.0)   # (BLOCK_M,)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    end = T_K
    if CAUSAL:
        end = tl.minimum(T_K, (pid_m + 1) * BLOCK_M)
    for start in range(0, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)                                # (BLOCK_N,)
        k = _load_tile(K, cols, stride_kt, dims, T_K)                       # (BLOCK_N, d)
        v = _load_tile(V, cols, stride_vt, dims, T_K)                       # (BLOCK_N, d)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale      # (BLOCK_M, BLOCK_N)
        seen = (cols[None, :] < T_K) & (rows[:, None] < T_Q)
        if CAUSAL:
            seen = seen & (cols[None, :] <= rows[:, None])
        p = tl.where(seen, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)            # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)          # (BLOCK_M, d)
    dq *= scale
    DQ += b * stride_dqb + h * stride_dqh
    tl.store(DQ + rows[:, None] * stride_dqt + dims[None, :], dq.to(DQ.dtype.element_ty),
             mask=rows[:, None] < T_Q)


# ---- the autograd Function and its checks ------------------------------------------------------
def interpreted() -> bool:
    """Whether the kernels run under Triton's interpreter (``TRITON_INTERPRET=1`` when this
    module was imported): on CPU tensors then, else compiled for the GPU."""
    return triton is not None and not isinstance(_forward_kernel, triton.runtime.JITFunction)


def _rows(x):
    """(B, H, T, d) with d contiguous, as the kernels read it: ``x`` itself when it is (a view
    of a projection's (B, T, H, d) output is), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _bht(x):
    """The (batch, head, time) strides the kernels take: (B, H, T, d) with a d stride of 1."""
    return x.stride(0), x.stride(1), x.stride(2)


def _precision(dtype) -> str:
    """fp32 tiles multiply in fp32 ("ieee"); Triton's tf32 default keeps 10 mantissa bits."""
    return "ieee" if dtype == torch.float32 else "tf32"     # (16-bit inputs ignore it)


def launch_options(dtype) -> dict:
    """Triton's compile options for the kernels. ``num_stages``: tile loads in flight per loop
    (software pipelining); fp32 tiles are twice the bytes, and with 3 stages the d=128 dK/dV
    kernel would need 169 KiB of shared memory, more than an A100's 163 KiB (2 stages: 104 KiB;
    compiled for sm_80, blocks 64 x 32). ``enable_fp_fusion``: a * b + c as one FMA, Triton
    3.9's default, stated so that 3.10 (off by default) runs the same code."""
    return dict(num_stages=2 if dtype == torch.float32 else 3, enable_fp_fusion=True)


class FlashAttention(torch.autograd.Function):
    """FlashAttention-2's forward and backward kernels (Algorithms 1 and 2 of Dao 2023).

    Keeps for backward: q, k, v, the output O and the log-sum-exp of each row (B, H, T_q) in
    fp32 - what ``TiledAttention`` and SDPA's flash kernel keep. The gradients are written in
    the inputs' dtype, tile by tile, from fp32 accumulators in registers.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, block_m: int, block_n: int):
        q, k, v = _rows(q), _rows(k), _rows(v)
        B, H, T_q, d = q.shape
        H_kv, T_k = k.shape[1], k.shape[2]
        # (B, H, T_q, d) over (B, T_q, H, d) memory: wo's layout, a model's reshape copies nothing
        out = q.new_empty(B, T_q, H, d).transpose(1, 2)                      # (B, H, T_q, d)
        lse = torch.empty(B, H, T_q, dtype=torch.float32, device=q.device)   # (B, H, T_q)
        grid = (triton.cdiv(T_q, block_m), B * H)
        _forward_kernel[grid](q, k, v, out, lse, *_bht(q), *_bht(k), *_bht(v), *_bht(out),
                              H, H // H_kv, T_q, T_k, d ** -0.5,
                              HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
                              PRECISION=_precision(q.dtype), **launch_options(q.dtype))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.block_m, ctx.block_n = causal, block_m, block_n
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        do = _rows(grad_out)                                                 # (B, H, T_q, d)
        B, H, T_q, d = q.shape
        H_kv, T_k = k.shape[1], k.shape[2]
        block_m, block_n, causal = ctx.block_m, ctx.block_n, ctx.causal
        delta = torch.empty_like(lse)                                        # (B, H, T_q) fp32
        _delta_kernel[(triton.cdiv(T_q, block_m), B * H)](
            out, do, delta, *_bht(out), *_bht(do), H, T_q, HEAD_DIM=d, BLOCK_M=block_m,
            **launch_options(q.dtype))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        shared = dict(HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
                      PRECISION=_precision(q.dtype), **launch_options(q.dtype))
        _dkdv_kernel[(triton.cdiv(T_k, block_n), B * H_kv)](
            q, k, v, do, lse, delta, dk, dv,
            *_bht(q), *_bht(k), *_bht(v), *_bht(do), *_bht(dk), *_bht(dv),
            H, H // H_kv, T_q, T_k, d ** -0.5, **shared)
        _dq_kernel[(triton.cdiv(T_q, block_m), B * H)](
            q, k, v, do, lse, delta, dq,
            *_bht(q), *_bht(k), *_bht(v), *_bht(do), *_bht(dq),
            H, H // H_kv, T_q, T_k, d ** -0.5, **shared)
        return dq, dk, dv, None, None, None


def _check(q, k, v, causal, block_m: int, block_n: int) -> None:
    """ImportError without triton; a ValueError naming the fix for what the kernels can't take."""
    if triton is None:
        raise ImportError(f"flash_attention needs Triton: {INSTALL} (or pip install "
                          f"'triton>=3.9'); labkit.transformer.attention.tiled_attention needs "
                          "nothing")
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if not q.dim() == k.dim() == v.dim() == 4:
        raise ValueError(f"q, k and v must be (B, H, T, d), got {shapes}: reshape them "
                         f"(labkit.transformer.attention.tiled_attention takes any leading dims)")
    if not q.shape[0] == k.shape[0] == v.shape[0] or k.shape[1] != v.shape[1]:
        raise ValueError(f"q, k and v must share the batch, and k and v the heads, got "
                         f"{shapes}: expand them to one batch size")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"kv heads ({k.shape[1]}) must divide query heads ({q.shape[1]}), "
                         f"got {shapes}: choose kv heads among the divisors of {q.shape[1]}")
    if k.shape[2] != v.shape[2] or min(q.shape[2], k.shape[2]) == 0:
        raise ValueError(f"k and v must hold the same number of keys and there must be one "
                         f"query and one key or more, got {shapes}: give one value per key")
    if not q.shape[3] == k.shape[3] == v.shape[3] or q.shape[3] not in HEAD_DIMS:
        raise ValueError(f"the kernels take one head dim for q, k and v among {HEAD_DIMS}, got "
                         f"{shapes}: use labkit.transformer.attention.tiled_attention for other "
                         "head dims")
    if not q.dtype == k.dtype == v.dtype or q.dtype not in DTYPES:
        raise ValueError(f"q, k and v must share one dtype among fp32, bf16 and fp16, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}: cast them (.to(torch.bfloat16))")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    for name, block in (("block_m", block_m), ("block_n", block_n)):
        if isinstance(block, bool) or not isinstance(block, int) or block < 16 \
                or block & (block - 1):
            raise ValueError(f"{name} must be a power of two, 16 or more (tl.dot's smallest "
                             f"tile, tl.arange's sizes), got {block!r}: try 64")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, "
                         f"{v.device}: move them with .to()")
    first = ("before triton is first imported (import labkit imports it, through "
             "torch.utils.flop_counter): TRITON_INTERPRET=1 python ..., or os.environ in a "
             "notebook's first cell")
    if q.device.type == "cpu" and not interpreted():
        raise ValueError(f"CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 {first}; "
                         f"or move q, k and v to the GPU")
    if interpreted() and q.dtype == torch.bfloat16:
        raise ValueError("Triton's interpreter multiplies bf16 tiles as raw bits (tl.dot; "
                         "triton-lang/triton#11584): use fp16 or fp32 on the CPU, bf16 on a GPU")
    if interpreted() and isinstance(tl.sum, triton.runtime.JITFunction):
        raise ValueError(f"TRITON_INTERPRET=1 came after triton was imported, so triton's own "
                         f"helpers (tl.sum, tl.max) are compiled ones: set it {first}")


def flash_attention(q, k, v, causal: bool = True, block_m: int = 64, block_n: int = 32):
    """``F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)``'s result
    from Triton kernels, ``block_m`` queries by ``block_n`` keys per tile.

    q: (B, H, T_q, d); k, v: (B, Hkv, T_k, d) with Hkv dividing H; d among 16, 32, 64, 128;
    fp32, bf16 or fp16, on a GPU (or the CPU under Triton's interpreter). Returns (B, H, T_q, d).
    Causal: query i sees keys 0..i (top-left, as SDPA). The default tiles fit every dtype and
    head dim in the shared memory of an A100 and an H100 (compiled for sm_80 and sm_90).
    """
    _check(q, k, v, causal, block_m, block_n)
    if q.is_cuda:                     # Triton launches on the current device: make it q's
        with torch.cuda.device(q.device):
            return FlashAttention.apply(q, k, v, causal, block_m, block_n)
    return FlashAttention.apply(q, k, v, causal, block_m, block_n)
