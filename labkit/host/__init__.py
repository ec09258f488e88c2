"""The host under a training job: its memory and files, data-loader shared memory, pinned pages,
huge pages, and PyTorch's CUDA caching allocator modelled in Python."""
