"""A small table of common training GPUs: memory, bf16 throughput and bandwidths (datasheets).

The planner (``labkit.course.plan``) reads per GPU: its memory and memory bandwidth, its dense
bf16 tensor throughput (no 2:4 sparsity), the bandwidth one GPU has to the others in its node
(NVLink, or PCIe where there is none) and to other nodes (InfiniBand / RoCE, one NIC per GPU
as in NVIDIA's DGX/HGX systems), each per direction, and for offloading its host link (PCIe),
the host memory and the host memory bandwidth a node has per GPU.
Describe your own with ``GPU(...)``, or as JSON (``gpu_from_json``; the command line's ``--gpu``).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

GiB, MiB = 2 ** 30, 2 ** 20


@dataclass(frozen=True)
class GPU:
    """One GPU type. ``memory``: bytes; throughput in TFLOP/s; bandwidths in GB/s (10^9 B/s)
    per direction, per GPU."""

    name: str
    memory: int
    bf16_tflops: float
    intra_node_gbps: float
    inter_node_gbps: float
    pcie_gbps: float = 32.0
    host_ram_per_gpu: int = 256 * 2**30    # bytes of host memory a node has per such GPU
    host_gbps: float = 70.4                # the node's DRAM bandwidth (GB/s) per such GPU
    hbm_gbps: float = 1000.0               # its memory's GB/s (QLoRA's dequantisation only)

    def __post_init__(self):
        for field in ("memory", "host_ram_per_gpu"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPU {field} is bytes, a positive int (e.g. 80 * 2**30), got "
                                 f"{value!r}")
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"GPU name must be a non-empty string, got {self.name!r}")
        for field in ("bf16_tflops", "intra_node_gbps", "inter_node_gbps", "pcie_gbps",
                      "host_gbps", "hbm_gbps"):
            value = getattr(self, field)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not 0 < value < math.inf):
                raise ValueError(f"GPU {field} must be a positive finite number, got {value!r}")

    def as_dict(self) -> dict:
        return asdict(self)


# Sources (dense bf16, i.e. half the "with sparsity" figure; NVLink: half the bidirectional
# figure; inter-node: one 200 Gb/s HDR (DGX A100) or 400 Gb/s NDR (DGX H100/H200/B200)
# ConnectX NIC per GPU):
#   A100: NVIDIA A100 Tensor Core GPU datasheet - 312 TFLOPS bf16, NVLink 600 GB/s, PCIe Gen4.
#   H100 SXM, H200 SXM: H100 / H200 datasheets - 989 TFLOPS bf16 (1,979 sparse), NVLink
#     900 GB/s, PCIe Gen5; H200 141 GB HBM3e.
#   B200: DGX B200 / HGX B200 datasheet - 180 GB, 2.25 PFLOPS dense fp16/bf16, NVLink 1.8 TB/s.
#   L4: NVIDIA L4 datasheet - 24 GB, 242 TFLOPS bf16 with sparsity (121 dense), PCIe Gen4 x16,
#     no NVLink; its inter-node figure (100 GbE per GPU) is an assumption, not a datasheet.
#   RTX A6000: NVIDIA RTX A6000 datasheet - 48 GB GDDR6, 154.8 TFLOPS bf16 dense (309.7 with
#     sparsity), a two-GPU NVLink bridge at 112.5 GB/s both ways, PCIe Gen4 x16; inter-node and
#     host memory assumed as for the RTX 4090 (a workstation card).
#   RTX 4090: Ada Lovelace architecture whitepaper - 165.2 TFLOPS bf16 with fp32 accumulate
#     (what training uses), PCIe Gen4 x16, no NVLink; inter-node assumed as for the L4.
# Memory: what nvidia-smi reports as the total (A100-80GB 81,920 MiB, H100 SXM 81,559 MiB,
# H200 SXM 143,771 MiB, B200 183,359 MiB, L4 23,034 MiB, RTX A6000 49,140 MiB, RTX 4090
# 24,564 MiB). The RTX 4090
# has no GPU-to-GPU P2P: its 32 GB/s "intra-node" link goes through host memory and is
# optimistic; PCIe figures are theoretical (about 25 GB/s is typical from pinned memory).
# Host memory per GPU (ZeRO-Offload's pinned states must fit in a node's): DGX A100 320GB 1 TB
# for 8 GPUs, DGX A100 640GB, DGX H100, DGX H200 and DGX B200 2 TB (their datasheets' base
# system memory), so 128 and 256 GiB per GPU; the L4 as in Google Cloud's g2-standard-96 (8 L4s,
# 384 GB: 48 GiB each); the RTX 4090 an assumption, a workstation's 128 GiB per GPU. A plan's
# node has this times its GPUs on the node. Pass host_ram= (--host-ram) for your own nodes.
#   H800 SXM: the H100 with NVLink cut to 400 GB/s (200 per direction), sold in China. Its links
#     are the DeepSeek-V3 report's (arXiv:2412.19437, section 3.2.2): NVLink 160 GB/s - unlike the
#     other rows, a practical maximum (DeepEP's README), about 80% of the 200 GB/s datasheet
#     figure - and InfiniBand 50 GB/s, the line rate of its 400 Gb/s NIC as for the H100. Its
#     memory (81,559 MiB) and host memory per GPU are assumed as for the H100 SXM / DGX H100.
# Host memory bandwidth per GPU (ZeRO-Offload's CPU optimizer step streams its states through
# it): the node's CPUs' theoretical DRAM bandwidth over its 8 GPUs. DGX A100: two AMD EPYC
# 7742, 8 channels of DDR4-3200 each (409.6 GB/s: 51.2 per GPU); DGX H100 / H200 / B200: two
# Xeon Platinum (8480C; 8570), 8 channels each holding 2 TB as two DIMMs per channel, which run
# at DDR5-4400 (563.2 GB/s: 70.4). The L4 (g2-standard-96: Cascade Lake, 2 x 6 channels of
# DDR4-2933, 281.6 GB/s: 35.2) and the workstation cards (8 channels of DDR4-3200 shared by 4
# GPUs: 51.2) are assumptions. The step-time model derates them (steptime.HOST_EFFICIENCY).
# GPU memory bandwidth (QLoRA dequantises its NF4 weights through it), the datasheets': A100
# 40GB 1,555 GB/s, 80GB SXM 2,039; H100 / H800 SXM 3,350; H200 4,800; B200 8,000; L4 300;
# RTX A6000 768; RTX 4090 1,008.
GPUS = {g.name: g for g in (
    GPU("a100-40gb", 40 * GiB, 312.0, 300.0, 25.0, 32.0, 128 * GiB, 51.2, 1555.0),
    GPU("a100-80gb", 80 * GiB, 312.0, 300.0, 25.0, 32.0, 256 * GiB, 51.2, 2039.0),
    GPU("h100-80gb", 81559 * MiB, 989.0, 450.0, 50.0, 64.0, 256 * GiB, 70.4, 3350.0),
    GPU("h800-80gb", 81559 * MiB, 989.0, 160.0, 50.0, 64.0, 256 * GiB, 70.4, 3350.0),
    GPU("h200-141gb", 143771 * MiB, 989.0, 450.0, 50.0, 64.0, 256 * GiB, 70.4, 4800.0),
    GPU("b200-180gb", 183359 * MiB, 2250.0, 900.0, 50.0, 64.0, 256 * GiB, 70.4, 8000.0),
    GPU("l4-24gb", 23034 * MiB, 121.0, 32.0, 12.5, 32.0, 48 * GiB, 35.2, 300.0),
    GPU("a6000-48gb", 49140 * MiB, 154.8, 56.25, 12.5, 32.0, 128 * GiB, 51.2, 768.0),
    GPU("rtx-4090-24gb", 24564 * MiB, 165.2, 32.0, 12.5, 32.0, 128 * GiB, 51.2, 1008.0),
)}


HEADROOM = 0.1     # of a GPU's memory, kept free for the CUDA context, NCCL and fragmentation


def usable_memory(g: GPU, headroom: float = HEADROOM) -> int:
    """Bytes a training step may peak at on ``g``: its memory less ``headroom`` of it (what the
    estimate leaves out: the CUDA context, NCCL buffers, allocator fragmentation)."""
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom is a fraction of the GPU's memory in [0, 1), got {headroom!r}")
    return int(g.memory * (1 - headroom))


def _no_constant(name: str):
    """json.loads reads NaN and Infinity as numbers; a GPU's figures must be finite."""
    raise ValueError(f"the GPU's JSON holds {name}: give finite numbers, e.g. '{JSON_EXAMPLE}'")


# A GPU of one's own as JSON: memory and host memory in GiB, the rest as GPU's fields
JSON_EXAMPLE = ('{"name": "my-gpu", "memory_gib": 48, "bf16_tflops": 181, '
                '"intra_node_gbps": 32, "inter_node_gbps": 12.5}')


def gpu(name: str | GPU) -> GPU:
    """The table's GPU of that name (a ``GPU`` passes through), or one described as JSON - a
    ``.json`` file or the text itself (``JSON_EXAMPLE``); ValueError lists the names."""
    if isinstance(name, GPU):
        return name
    if isinstance(name, str) and (name.lstrip().startswith("{")
                                  or name.lower().endswith(".json") or Path(name).is_file()):
        return gpu_from_json(name)
    if isinstance(name, str) and name.lower() in GPUS:          # "H100-80GB" as "h100-80gb"
        name = name.lower()
    if name not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; use one of {', '.join(GPUS)}, or describe "
                         f"yours as JSON ({JSON_EXAMPLE}, in a .json file or as the text), or "
                         f"with labkit.core.gpus.GPU(name, memory, bf16_tflops, intra_node_gbps, "
                         f"inter_node_gbps)")
    return GPUS[name]


def gpu_from_json(text_or_path: str) -> GPU:
    """A ``GPU`` from JSON text or a ``.json`` file: ``memory_gib`` (and ``host_ram_per_gpu_gib``)
    in GiB, the other fields as ``GPU``'s (``pcie_gbps``, ``host_gbps``, ``hbm_gbps`` and the
    host memory optional)."""
    if not isinstance(text_or_path, str):
        raise ValueError(f"a GPU as JSON is a string (the text or a file's path), got "
                         f"{type(text_or_path).__name__}")
    source = text_or_path
    if not text_or_path.lstrip().startswith("{"):
        path = Path(text_or_path)
        if not path.is_file():
            raise ValueError(f"no GPU file {text_or_path!r}: give a .json file that exists, or "
                             f"the JSON itself, e.g. '{JSON_EXAMPLE}'")
        try:
            source = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{text_or_path} is not UTF-8 text: save the GPU's JSON as UTF-8, "
                             f"e.g. '{JSON_EXAMPLE}'") from None
    try:
        spec = json.loads(source, parse_constant=_no_constant)
    except json.JSONDecodeError as error:
        raise ValueError(f"the GPU's JSON does not parse ({error}): write it as "
                         f"'{JSON_EXAMPLE}'") from None
    if not isinstance(spec, dict):
        raise ValueError(f"the GPU's JSON must be an object such as '{JSON_EXAMPLE}'")
    known = {f.name for f in fields(GPU)} - {"memory", "host_ram_per_gpu"}
    known |= {"memory_gib", "host_ram_per_gpu_gib"}
    required = {"name", "memory_gib", "bf16_tflops", "intra_node_gbps", "inter_node_gbps"}
    unknown, missing = sorted(set(spec) - known), sorted(required - set(spec))
    if unknown or missing:
        said = "; ".join(part for part in (
            unknown and f"unknown key(s) {unknown} (memory and host memory are in GiB: "
                        f"memory_gib, host_ram_per_gpu_gib)",
            missing and f"missing {missing}") if part)
        raise ValueError(f"the GPU's JSON: {said}; it needs {sorted(required)} (optional: "
                         f"pcie_gbps, host_ram_per_gpu_gib, host_gbps, hbm_gbps), e.g. "
                         f"'{JSON_EXAMPLE}'")
    for key in ("memory_gib", "host_ram_per_gpu_gib"):
        if key in spec and (isinstance(spec[key], bool) or not isinstance(spec[key], (int, float))
                            or not 1 / GiB <= spec[key] < math.inf):
            raise ValueError(f"the GPU's {key} must be a positive finite number of GiB (e.g. "
                             f"48), got {spec[key]!r}")
    bytes_of = {key[:-4]: int(spec.pop(key) * GiB) for key in ("memory_gib", "host_ram_per_gpu_gib")
                if key in spec}
    return GPU(**spec, **bytes_of)
