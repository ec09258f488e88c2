# GPU Memory Labs on a CPU: JupyterLab with labkit and the notebooks, nothing else.
#
#   docker build -t gpu-memory-labs .
#   docker run --rm -p 8888:8888 --shm-size=1g gpu-memory-labs
#
# then open the http://127.0.0.1:8888/lab?token=... address the container prints.
# --shm-size: Docker gives a container 64 MiB of /dev/shm; the labs that start DataLoader
# workers (torch.multiprocessing) pass tensors through it (container/README.md: how much).
# A GPU machine: container/cuda.Dockerfile and the flags in container/README.md.
FROM python:3.11-slim

# The PyTorch wheel index with the CPU-only build (~200 MB instead of several GB of CUDA
# libraries). An empty value uses pip's configured index: `--build-arg TORCH_INDEX_URL=`.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# The torch the course is checked with; pyproject.toml requires torch>=2.13 (labs 04-05).
ARG TORCH_VERSION=2.13.0
# labkit's extras: dev = JupyterLab, papermill and the test tools; add ",hf" for transformers.
ARG EXTRAS=dev

# no pip cache in a layer (a smaller image); no .pyc files written beside the sources;
# logs straight to `docker logs`; no warning for installing as root (the build runs as root).
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# the course's folder: the notebooks, labkit and its data
WORKDIR /labs

# torch first, from its CPU index: labkit's `torch>=2.13` is then already met, so the next
# step cannot pull a CUDA build from PyPI.
RUN python -m pip install --no-cache-dir ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
        "torch==${TORCH_VERSION}"

# What the install needs, before the notebooks: editing a notebook keeps this layer cached.
COPY pyproject.toml README.md LICENSE ./
COPY labkit/ labkit/
COPY data/ data/
# editable: a learner's change to labkit inside the container takes effect at the next import
RUN python -m pip install --no-cache-dir -e ".[${EXTRAS}]"

# the rest: notebooks, tests, scripts (.dockerignore leaves out .venv, .git and caches)
COPY . .

# The install works: labkit imports and lists its presets, and torch is the CPU build.
RUN python -m labkit presets \
    && python -c "import torch; assert torch.version.cuda is None, torch.version.cuda"

# A non-root user: Jupyter refuses to run as root without --allow-root, and the notebooks
# should not be able to change the image. Owns only the course folder.
# dockerfile_run: skip (creates a user account; only inside the image, never on the host)
RUN useradd --create-home --uid 1000 learner && chown -R learner /labs
USER learner

# JupyterLab's port: publish it with -p 8888:8888
EXPOSE 8888
# --ip=0.0.0.0: listen on the container's interface, or -p cannot reach it;
# --no-browser: there is no browser in the container. The token is printed in the log.
# Rooted at /labs (the working folder), opened on the landing page that links every lab
CMD ["jupyter", "lab", "--ip=0.0.0.0", "--no-browser", "START_HERE.ipynb"]
