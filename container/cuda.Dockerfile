# GPU Memory Labs on an NVIDIA GPU: the same course on PyTorch's CUDA runtime image.
# Not built by the course's CI (no GPU, no Docker engine there); it is parsed by its tests.
#
#   docker build -f container/cuda.Dockerfile -t gpu-memory-labs:cuda .
#   docker run --rm --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
#       -p 8888:8888 gpu-memory-labs:cuda
#
# Why each flag (container/README.md has the sources):
#   --gpus all              the NVIDIA Container Toolkit mounts the GPUs and the driver's
#                           user-space libraries into the container; without it CUDA sees no GPU
#   --ipc=host              the host's IPC namespace and its /dev/shm (usually half the RAM)
#                           instead of Docker's private 64 MiB one: DataLoader workers and NCCL's
#                           shared-memory transport put buffers there. --shm-size=8g is the
#                           alternative that keeps the container's own namespace.
#   --ulimit memlock=-1     no limit on locked memory: NCCL's InfiniBand/RoCE transport
#                           registers (pins) its buffers with the RDMA driver, which counts
#                           against RLIMIT_MEMLOCK; Docker's default limit is small
#   --ulimit stack=67108864 a 64 MiB stack limit, as NVIDIA's NGC images recommend; a finite
#                           value (not "unlimited", which glibc turns into 2 MiB thread stacks)
#   -p 8888:8888            JupyterLab's port

# PyTorch's runtime image: <torch>-cuda<major.minor>-cudnn<N>-runtime (the tag scheme of
# pytorch/pytorch's .github/workflows/docker-release.yml). labkit needs torch >= 2.13
# (all_gather_single); choose the CUDA that the host's driver supports, and check that the
# tag exists on Docker Hub: it was not pulled here.
ARG PYTORCH_TAG=2.13.0-cuda12.8-cudnn9-runtime
FROM pytorch/pytorch:${PYTORCH_TAG}

ARG EXTRAS=dev
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

WORKDIR /labs

# torch comes with the base image: labkit's `torch>=2.13` is met, so pip keeps the CUDA build.
COPY pyproject.toml README.md LICENSE ./
COPY labkit/ labkit/
COPY data/ data/
RUN python -m pip install --no-cache-dir -e ".[${EXTRAS}]"

COPY . .

# The install works and torch is a CUDA build (no GPU is needed to check that at build time).
RUN python -m labkit presets \
    && python -c "import torch; assert torch.version.cuda, 'torch is not a CUDA build'"

# dockerfile_run: skip (creates a user account; only inside the image, never on the host)
RUN useradd --create-home --uid 1000 learner && chown -R learner /labs
USER learner

EXPOSE 8888
# Rooted at /labs (the working folder), opened on the landing page that links every lab
CMD ["jupyter", "lab", "--ip=0.0.0.0", "--no-browser", "START_HERE.ipynb"]
