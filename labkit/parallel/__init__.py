"""Parallelism, one folder per kind: data (DDP, ZeRO, FSDP), tensor, pipeline, expert; the
local cluster every multi-process lab runs on (``cluster``)."""
