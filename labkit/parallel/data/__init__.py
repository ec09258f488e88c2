"""Data parallelism: DDP, ZeRO stages 1-3 (labkit's and PyTorch's), FSDP2, and ZeRO's byte rule
(``zero``, torch-free, read by the estimate)."""
