"""The worked answer to every exercise of ``labkit.course.exercises``, computed with labkit the way
the exercise's hint suggests: the code an instructor types to show where the number comes from.

scripts/build_workshop.py copies each ``# %% <exercise id>`` cell below into that lab's
workshop/solutions/NN_solutions.ipynb, after ``print(solution(id))``, and ends it with
``check(id, answer)``; the ``from ... import ...`` lines at the top of a cell move to the
notebook's one import cell. A new exercise needs a cell here (the build names the missing ones);
``python -m pytest -m slow tests/test_workshop.py`` runs every cell and checks it prints ✅.
``python workshop/answers.py`` runs them all as one script.
"""
import labkit as lk

# %% 01-foreach-over-for-loop
kw = dict(seq=256, precision="fp32", device="cpu")
impls = ("foreach", "for-loop")
est = {impl: lk.estimate("small", optimizer_impl=impl, **kw) for impl in impls}
for impl, e in est.items():                    # which moment sets each peak at 256 tokens?
    print(impl, max(e.moments, key=e.moments.get), f"{e.total:,} B")
peaks = {impl: lk.measure_step("small", optimizer_impl=impl, fake=False, **kw).total for impl in impls}
answer = peaks["foreach"] - peaks["for-loop"]
print(f"predicted {est['foreach'].total - est['for-loop'].total:,} B, measured {answer:,} B")

# %% 01-mistral-7b-megatron-states
n = lk.count_params("mistral-7b").total
answer = n * (2 + 4 + 4 + 4 + 4) / 2**30     # bf16 weight, fp32 main_grad, fp32 master, m, v: 18 B, GiB

# %% 01-zero-grad-placement
from labkit.training.measure import init_optimizer_state
from labkit.training.train import make_optimizer, train_step
import torch
model = lk.build_model(lk.preset("small"))
opt = make_optimizer(model.parameters(), "adamw", "fused")
init_optimizer_state(model, opt)
ids = torch.randint(0, model.cfg.vocab_size, (1, 256 + 1))
x, y = ids[:, :-1], ids[:, 1:]
with lk.MemoryTracker(model, opt) as usual:
    train_step(model, opt, x, y, tracker=usual)                # zero_grad right after step()
model(x, y).backward(); opt.step()                            # a late-zero_grad step leaves its gradients
with lk.MemoryTracker(model, opt) as late:                    # loss; zero_grad; backward; step
    with late.phase("forward"):
        loss = model(x, y)
    with late.phase("backward"):
        opt.zero_grad(); loss.backward()
    with late.phase("optimizer"):
        opt.step()
answer = late.peak - usual.peak
print(f"{usual.peak:,} B during {usual.peak_phase} -> {late.peak:,} B during {late.peak_phase}")

# %% 01-moe-idle-expert-states
c = lk.preset("deepseek-moe-16b")
expert = 3 * c.hidden * c.moe_ffn                          # one SwiGLU expert: gate, up, down
answer = 16 * (c.routed_experts - c.top_k) * expert / 2**30   # 16 B each (bf16-master AdamW), GiB

# %% 01-small-params-by-hand
c = lk.preset("small")
attention = 2 * c.hidden * c.heads * c.head_dim + 2 * c.hidden * c.kv_heads * c.head_dim
layer = attention + 3 * c.hidden * c.ffn + 2 * c.hidden      # q, o, k, v; SwiGLU; two norms
answer = c.layers * layer + 2 * c.vocab_size * c.hidden + c.hidden   # embedding, head, final norm
print(f"lk.count_params: {lk.count_params(c).total:,}")

# %% 01-first-step-peak
kw = dict(seq=256, precision="fp32", optimizer_impl="for-loop", device="cpu")
e = lk.estimate("small", **kw)
moments = 8 * lk.count_params("small").total                  # AdamW's fp32 m and v
first = max(v if k == "optimizer step" else v - moments for k, v in e.moments.items())
print(f"predicted: first step {first:,} B, later steps {e.total:,} B")
answer = (lk.measure_step("small", fake=False, **kw).total
          - lk.measure_step("small", fake=False, warmup=False, **kw).total)

# %% 01-zero3-fewest-gpus
n = lk.count_params("llama-2-7b").total
answer = next(gpus for gpus in range(1, 1025)
              if lk.model_state_bytes(n, "bf16-mixed", "adamw", zero_stage=3, dp=gpus) <= 24 * 2**30)

# %% 01-predict-then-measure-sgd-momentum
print(f"states: {lk.count_params('small').total * (4 + 4 + 4):,} B")   # weight, gradient, momentum
e = lk.estimate("small", seq=64, precision="fp32", optimizer="sgd-momentum", device="cpu")
print({k: f"{v:,}" for k, v in e.moments.items()})             # the peak is the largest moment
m = lk.measure_step("small", seq=64, precision="fp32", optimizer="sgd-momentum", fake=False)
print(f"predicted {e.total:,} B, measured {m.total:,} B during {m.peak_phase}")
answer = m.total

# %% 01-peak-moves-to-backward
answer = next(seq for seq in range(512, 2**17, 512)
              if lk.estimate("llama-2-7b", seq=seq, precision="bf16-mixed",
                             device="cuda").peak_phase == "backward")

# %% 02-fp16-largest
from labkit.quantisation import precision as P
fp16 = next(f for f in P.format_table() if f.name == "fp16")
print(f"{fp16.exponent_bits} exponent bits, {fp16.mantissa_bits} mantissa bits: (2 - 2^-10) x 2^15")
answer = fp16.max

# %% 02-autocast-weight-copies
pc = lk.count_params("llama-2-7b")
matmul = pc.total - pc.by_component["norms"] - pc.by_component["embedding"]   # looked up, not multiplied
answer = 2 * matmul / 2**30
cache = lk.estimate("llama-2-7b", seq=512, precision="bf16-mixed").saved_weight_cache
print(f"the estimate's autocast weight cache: {cache / 2**30:.2f} GiB")

# %% 02-fp8-block-bytes
import torch
from labkit.quantisation import precision as P
w = torch.randn(7168, 7168) * 0.02
answer = P.quantize_fp8(w, fmt="fp8-e4m3", granularity="block").nbytes     # values + fp32 block scales
print(f"7168^2 x 1 B + (7168 / 128)^2 x 4 B = {7168**2 + (7168 // 128) ** 2 * 4:,} B")

# %% 02-mixed-saves-a-quarter
def saves_a_quarter(batch):
    mixed, fp32 = (lk.estimate("llama-2-7b", batch, 4096, precision=p, device="cuda").total
                   for p in ("bf16-mixed", "fp32"))
    return mixed <= 0.75 * fp32

batch = next(b for b in range(1, 65) if saves_a_quarter(b))
answer = batch * 4096                                 # tokens per step
mixed_peak = lk.estimate("llama-2-7b", batch, 4096, precision="bf16-mixed", device="cuda").total
print(f"batch {batch}: peak {mixed_peak / 2**30:.0f} GiB, more than any single GPU holds")

# %% 02-half-inference-saving
from labkit.quantisation.precision import inference_peak
fp32, half = (inference_peak("small", 2, 256, half=h) for h in (False, True))
answer = 100 * (1 - half.peak / fp32.peak)

# %% 02-fsdp-autocast-cache-gib
from labkit.parallel.data.fsdp import fake_fsdp2_peak
pc = lk.count_params("llama-2-7b")
answer = 2 * (pc.total - pc.by_component["norms"] - pc.by_component["embedding"]) / 2**30   # whole copies
rank = fake_fsdp2_peak("llama-2-7b", 8, 1, 4096, precision="bf16-mixed", recompute="full")
print(f"one rank of 8 holds {rank['by_category']['weight_cache'] / 2**30:.2f} GiB of copies at its peak")

# %% 03-full-recompute-kept
c = lk.preset("llama-2-7b")
answer = 4096 * c.hidden * 4 / 2**20                 # one layer's input: the fp32 residual stream
saved = {n: lk.estimate(c.replace(layers=n), batch=1, seq=4096, precision="bf16-mixed",
                        recompute="full").saved_activations for n in (c.layers, c.layers + 1)}
print(f"predicted {answer:.0f} MiB; lk.estimate, one layer more: "
      f"{(saved[c.layers + 1] - saved[c.layers]) / 2**20:.0f} MiB")

# %% 03-padding-waste
from labkit.training import batching
docs = batching.make_documents(batching.document_lengths(1000, max_len=4096, median=512, seed=3))
waste = {b: batching.bucket_batches(docs, b).waste for b in range(1, 41)}   # length buckets of b
print(", ".join(f"b = {b}: {100 * w:.2f}%" for b, w in waste.items() if 16 <= b <= 24))
answer = max(b for b, w in waste.items() if w < 0.05)     # b = 41 to 1000 all pad 5% or more

# %% 03-accumulation-fits-h100
from labkit.core.gpus import gpu, usable_memory
usable = usable_memory(gpu("h100-80gb"))
for answer in (1, 2, 4, 8, 16):                            # accumulation steps
    e = lk.estimate("llama-2-7b", batch=16 // answer, seq=4096, precision="bf16-master",
                    layout=lk.Layout(dp=8, zero_stage=3, micro_batches=answer))
    print(f"m = {answer:2d}: {e.total / 2**30:6.1f} GiB (optimizer {e.optimizer / 2**30:.2f} GiB)")
    if e.total <= usable:
        break

# %% 03-peak-leaves-optimizer-with-selective
def past_optimizer(seq):
    return lk.estimate("llama-2-7b", 1, seq, precision="bf16-mixed", device="cuda",
                       recompute="selective").peak_phase != "optimizer"

lo, hi = 4096, 32768                                       # not past at lo, past at hi: bisect
while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if past_optimizer(mid) else (mid, hi)
answer = hi

# %% 03-cheapest-recompute-fits-24gib
from labkit.core.gpus import gpu, usable_memory
usable = usable_memory(gpu("rtx-4090-24gb"))               # 90% of the card: the course's rule

def peak(k):
    return lk.estimate("llama-2-7b", batch=1, seq=4096, precision="bf16-master", zero_stage=3,
                       dp=16, recompute=f"every-{k}", device="cuda").total

answer = 1                                                 # every-1 = full recompute: fits
while peak(answer + 1) <= usable:                          # a larger k keeps more blocks whole
    answer += 1
print(f"every-{answer}: {peak(answer) / 2**30:.2f} GiB, every-{answer + 1}: "
      f"{peak(answer + 1) / 2**30:.2f} GiB; usable {usable / 2**30:.2f} GiB")

# %% 03-varlen-saving
import torch
from labkit.training import batching
c, T = lk.preset("tiny", max_seq=8192), 8192
mask = 2 * T * T                                           # the (1, 1, T, T) mask in bf16
lse = c.layers * c.heads * T * 4                           # fp32 log-sum-exp: layers x heads x T
print(f"predicted: {(mask + lse) / 2**20:.2f} MiB")
torch.manual_seed(0)
model = lk.build_model(c)
row = batching.pack_batches(batching.make_documents(batching.document_lengths(
    30, max_len=1024, median=400, seed=0)), T).batches[0]
kept = {}
for a in ("mask", "varlen"):                               # one autocast block each
    with torch.autocast("cpu", torch.bfloat16):
        kept[a] = batching.packed_step_memory(model, row, a).kept
answer = (kept["mask"] - kept["varlen"]) / 2**20           # measured

# %% 03-in-backward-saving
def peak(**kw):
    return lk.estimate("llama-2-7b", 1, 2048, precision="bf16", recompute="none",
                       device="cuda", **kw)

ordinary, in_backward = peak(), peak(optimizer_in_backward=True)
print(ordinary.details["peak moment"], "->", in_backward.details["peak moment"])
answer = (ordinary.total - in_backward.total) / 2**30

# %% 04-zero2-bytes-per-parameter
n = 8 * 10**6                                              # any count that 8 divides
answer = lk.model_state_bytes(n, "bf16-master", "adamw", zero_stage=2, dp=8) / n   # 2 + (2 + 12) / 8

# %% 04-bucket-view-saves
def peak(view):
    return lk.estimate("llama-2-13b", 1, 16, precision="fp32",
                       layout=lk.Layout(dp=8, gradient_as_bucket_view=view)).total

answer = (peak(False) - peak(True)) / 2**30

# %% 04-zero3-bytes-sent
n = lk.count_params("llama-2-7b").total
answer = 3 * (63 / 64) * n * 2 / 2**30                     # all-gather twice, reduce-scatter once, bf16
sent = lk.estimate("llama-2-7b", 1, 2048, precision="bf16-master",
                   layout=lk.Layout(dp=64, zero_stage=3)).details["bytes sent per step"]
print(f"the estimate's bytes sent per step: {sent / 2**30:.2f} GiB")

# %% 04-fewest-gpus-80gib
def peak(gpus):
    return lk.estimate("llama-2-13b", 1, 4096, precision="bf16-master", recompute="full",
                       layout=lk.Layout(dp=gpus, zero_stage=3)).total

answer = next(gpus for gpus in (2**k for k in range(11)) if peak(gpus) <= 80 * 2**30)

# %% 05-tp8-param-share
from labkit.predict.layers import block_weights, embedding_weights, head_weights
c = lk.preset("llama-2-7b")
weights = embedding_weights(c) + head_weights(c) + [
    w for i in range(c.layers) for w in block_weights(c, i >= c.dense_layers)]
answer = 100 * sum(w.local(tp=8) for w in weights) / sum(w.numel for w in weights)

# %% 05-1f1b-in-flight
from labkit.parallel.pipeline import pipeline_parallel as pipeline
answer = pipeline.in_flight(0, 8, 32, "1f1b")              # stage 0, p = 8, m = 32

# %% 05-bubble-m
answer = next(m for m in range(1, 1000) if lk.pipeline_bubble(8, m, "1f1b") < 0.05)

# %% 05-v3-experts-per-gpu
c = lk.preset("deepseek-v3")
per_gpu = c.routed_experts // 256                          # routed experts per MoE layer on one GPU
answer = c.moe_layers * per_gpu * 3 * c.hidden * c.moe_ffn / 1e9

# %% 05-mixtral-etp-activations
c = lk.preset("mixtral-8x7b")
row = 4 * c.hidden + 16                 # the gathered input's two bf16 copies + two int64 indices
answer = c.top_k * 4096 * c.moe_layers * row / 2**30       # the etp partner's rows, every MoE layer

# %% 06-nf4-bits
from labkit.quantisation import quant
answer = 4 + 8 / 64 + 32 / (64 * 256)                      # code + 8-bit scale + its fp32 scale
print(f"quant.nf4_bits_per_param(64, double_quant=True): {quant.nf4_bits_per_param(64, True):.4f}")

# %% 06-lora-share
from labkit.predict.layers import lora_weights
c = lk.preset("llama-2-7b")
trained = sum(w.numel for i in range(c.layers) for w in lora_weights(c, i >= c.dense_layers, 16))
answer = 100 * trained / lk.count_params(c).total

# %% 06-adamw8bit-state
from labkit.predict.layers import block_weights, embedding_weights, head_weights
from labkit.quantisation import optim8bit
c = lk.preset("llama-2-7b")
weights = embedding_weights(c) + head_weights(c) + [
    w for i in range(c.layers) for w in block_weights(c, i >= c.dense_layers)]
answer = sum(optim8bit.state_bytes(w.numel) for w in weights) / 2**30

# %% 06-qlora-7b-peak
e = lk.estimate("llama-2-7b", 1, 2048,
                recipe=lk.Recipe("bf16-master", trainable="lora", weight_format="nf4"))
print(e.explain())
answer = e.total / 2**30

# %% 06-paged-mistral-mib
from labkit.predict.layers import lora_weights
c = lk.preset("mistral-7b")
numbers = [w.numel for i in range(c.layers) for w in lora_weights(c, False, 16)]
answer = sum(2 * n for n in numbers if n >= 100_000) / 2**20     # two 1-byte moments each

# %% 07-naive-minus-sdpa-gqa
c, T = lk.preset("mistral-7b"), 4096
probs = c.heads * T * T * (4 + 2)                           # H x T x T pairs, fp32 + bf16 copy
repeat = 2 * (c.heads - c.kv_heads) * T * c.head_dim * 2    # k and v, the extra heads, bf16
lse = c.heads * T * 4                                       # SDPA's fp32 log-sum-exp
answer = c.layers * (probs + repeat - lse) / 2**30
saved = {a: lk.estimate(c, 1, T, precision="bf16-mixed", attention=a).saved_activations
         for a in ("naive", "sdpa")}
print(f"lk.estimate: {(saved['naive'] - saved['sdpa']) / 2**30:.2f} GiB")

# %% 07-tiled-peak-block
from labkit.transformer import attention
H, N, d = 8, 2048, 64
gap = H * N * d * 4 - 2 * H * N * 4          # SDPA's fifth (H, N, d) tensor less the tiled core's two rows
answer = next(b for b in (64, 128, 256, 512) if 5 * H * b * b * 4 > gap)    # the first whose tiles outweigh it
sdpa = attention.core_peak_bytes("sdpa", N)
for b in (128, answer):
    print(f"b = {b}: tiled {attention.core_peak_bytes('tiled', N, block=b) / 2**20:.2f} MiB, SDPA {sdpa / 2**20:.2f} MiB")

# %% 07-watermark-no-preemption
from labkit.transformer import paged
stream = paged.request_stream(500, seed=0)
for answer in range(5, 45, 5):                              # percent, in steps of 5
    s = paged.simulate("paged", 12 * 2**30, stream, watermark=answer / 100)
    print(f"{answer}%: {s.preempted} sent back, {s.mean_running:.1f} requests at once")
    if s.preempted == 0:
        break

# %% 07-paged-waste
per_token = lk.kv_cache_bytes("llama-2-13b", seq=1, dtype="fp16")   # one token, every layer
answer = (16 - 1) * per_token / 2**20                      # a last block holding one token of 16

# %% 07-decode-batch-for-80-percent
import math
from labkit.transformer.decoding import decode_step, largest_batch
one = decode_step("mistral-7b", 1, 4096)
answer = math.ceil(4 * one.weight_bytes / one.kv_bytes)    # b x K >= 0.8 (W + b x K)
s = decode_step("mistral-7b", answer, 4096)
print(answer, s.tokens_per_second("a100-80gb") / one.cache_ceiling("a100-80gb"),
      answer <= largest_batch("mistral-7b", 4096, "a100-80gb"))

# %% 07-prefix-shared-mib
c = lk.preset("llama-2-13b")
per_token = 2 * c.layers * c.kv_heads * c.head_dim * 2       # k and v, fp16
answer = 39 * (1000 // 16) * 16 * per_token / 2**20          # 39 copies of the full blocks saved

# %% 07-kv-int8-gib
from labkit.transformer.kv_quant import QuantisedKVCache
per_token = 32 * 8 * 2 * (128 + 4)                         # layers x KV heads x (k, v) x (codes + scale)
answer = 32 * 8192 * per_token / 2**30                     # GiB
one_layer = QuantisedKVCache(lk.preset("llama-3-8b").replace(layers=1), 32, 8192, fmt="int8",
                             device="meta")                 # sizes only, nothing allocated
print(answer, one_layer.nbytes * 32 / 2**30)

# %% 07-pool-share-tokens
from labkit.core.gpus import gpu
from labkit.training import serving
per_token = 2 * 32 * 8 * 128 * 2                            # k and v of every layer, bf16
answer = 0.05 * gpu("h100-80gb").memory / per_token         # 5% of the GPU, all from the pool
print(answer, serving.size_block_pool("llama-3-8b", "h100-80gb", 0.9).tokens
      - serving.size_block_pool("llama-3-8b", "h100-80gb", 0.85).tokens)

# %% 08-shm-image-loader
from labkit.host import shm
batch = 32 * 3 * 512 * 512 * 4                             # one batch of fp32 images
answer = shm.shm_needed(batch, 6, 4) / 2**20               # (6 x 4 in flight + 2) batches, whole pages

# %% 08-small-pool-tensors
from labkit.host import allocator
rounded = allocator.round_size(100_000)                    # a multiple of 512 B
answer = allocator.kSmallBuffer // rounded                 # in one 2 MiB segment

# %% 08-reserved-three-tensors
from labkit.host import allocator
a = allocator.CachingAllocator(record_trace=False)
for key, mib in enumerate((3, 7, 11)):
    a.malloc(mib * 2**20, key)
    print(f"{mib} MiB: reserved {a.stats().reserved_bytes / 2**20:g} MiB")
answer = a.stats().reserved_bytes / 2**20

# %% 08-max-split-needs
from labkit.host.alloc_need import need_band
from labkit.host.allocator import min_capacity, parse_alloc_conf, replay
seqs = [1024, 2048, 1536, 4096, 3072, 2560]                # section 3's six steps
cfg4 = lk.preset("llama-2-7b").replace(layers=4, name="llama-2-7b, 4 layers")
mv = lk.measure_step(cfg4, 1, seqs[0], precision="bf16-mixed", fake=True, device="cuda",
                     events=True, then=[(1, s) for s in seqs[1:]])
for conf in ("", "max_split_size_mb:128"):
    s = parse_alloc_conf(conf)
    need = min_capacity(mv.events, s, tolerance=4 * 2**20)  # runs there, 4 MiB less fails
    band = need_band(mv.events, s, step=4 * 2**20)          # and every 4 MiB below it, scanned
    print(f"{conf or 'defaults':22s} needs {need / 2**30:.2f} GiB bisected, runs from "
          f"{band.low / 2**30:.2f} GiB; reserves "
          f"{replay(mv.events, s, record_trace=False).peak_reserved / 2**30:.2f} GiB with no pressure")
answer = need / 2**30                                       # max_split_size_mb:128, the last

# %% 08-eval-leak-per-batch
import torch
c = lk.preset("small")
model = lk.build_model(c)
tokens = torch.randint(0, c.vocab_size, (8, 128 + 1))
x, y = tokens[:, :-1], tokens[:, 1:]
total, after = 0.0, []
with lk.MemoryTracker() as mt:
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):     # entered for each batch
            total = total + model(x, y)                       # a tensor: its graph stays
        after.append(mt.current)
answer = (after[1] - after[0]) / 2**20                       # MiB the second batch left alive
est = lk.estimate(c, 8, 128, precision="bf16-mixed")
print(f"predicted: saved activations + bf16 weight copies = "
      f"{(est.saved_activations + est.saved_weight_cache) / 2**20:.2f} MiB")

# %% 08-oom-capped-shortfall
from labkit.host.oom import parse_oom
from labkit.course.exercises.lab08 import OOM_MESSAGE
reserved = 35.50 + 1.20                                    # allocated + reserved but unallocated
room = min(40.10, 38.00 - reserved)                        # the fraction's cap, or the device
answer = 2.00 - room                                       # GiB the request lacked
print(answer, parse_oom(OOM_MESSAGE).verdict())

# %% 09-fewest-a100s-13b
import itertools
import labkit as lk
from labkit.course.plan import plan
states = 16 * lk.count_params("llama-2-13b").total / 2**30    # GiB: 16 bytes per parameter
print(f"paper bound: {states:.1f} GiB / 72 GiB usable = {states / 72:.2f} cards")
answer = next(gpus for gpus in itertools.count(1)          # one more GPU at a time
              if plan("llama-2-13b", "a100-80gb", gpus, seq=4096, offload=False, top=1).fits)
# plan() searches fused AdamW too where foreach fits nowhere: the label names it when it is used
print(plan("llama-2-13b", "a100-80gb", answer, seq=4096, offload=False, top=1).fits[0].label())

# %% 09-no-p2p-link
import dataclasses
from labkit.core.gpus import GPUS
from labkit.course.plan import plan

def every(gbps):                                           # every layout that fits, fastest first
    gpu = dataclasses.replace(GPUS["rtx-4090-24gb"], intra_node_gbps=gbps)
    return plan("deepseek-v2-lite", gpu, 2, seq=2048, trainable=("all", "lora", "qlora"),
                top=None, advice=False).fits

def gap(gbps):                                             # fastest tp 2 step less the fastest other's
    fits = every(gbps)
    return (min(k.time.dp_overlapped for k in fits if k.layout.tp == 2)
            - min(k.time.dp_overlapped for k in fits if k.layout.tp != 2))

lo, hi = 1.0, 32.0                                         # tp 2 faster at 32 GB/s, not at 1
while hi - lo > 0.05:
    mid = (lo + hi) / 2
    lo, hi = (lo, mid) if gap(mid) < 0 else (mid, hi)
answer = (lo + hi) / 2                                     # GB/s per direction: the times cross
print(f"the modelled times cross at {answer:.1f} GB/s; the planner's first there:", every(answer)[0].label())
