# Images of the disaggregated data loader, built with no network and no image registry.
#
#   service  (default target) the CPU-side loader service: numpy, pyzmq, FastAPI, decoders; no torch
#   trainer  the client library + torch (CPU build) + the demo trainer (python -m client.demo)
#
# Before building (see docs/deployment.md, "Air-gapped build"):
#   sudo deploy/docker/build-base.sh      # debootstrap Debian bookworm -> image loader-base:bookworm
#   deploy/docker/fetch-wheels.sh         # every wheel the images install -> deploy/docker/wheels/
#   DOCKER_BUILDKIT=0 docker build --target service -t remote-loader/service:0.1.0 .
#   DOCKER_BUILDKIT=0 docker build --target trainer -t remote-loader/trainer:0.1.0 .
#
# No `# syntax=` line and no BuildKit-only instructions (RUN --mount, heredocs): the file builds
# with the classic builder of Debian's docker.io as well as with BuildKit, and BuildKit would try
# to pull a syntax frontend image from a registry.
#
# BASE_IMAGE: any Debian-based image with python3 (>= 3.11, for the wheels and tomllib); the
# default is the debootstrapped one. On a base without tini/python3-venv (e.g. debian:bookworm-slim)
# the base stage installs them with apt, which then needs the network.
ARG BASE_IMAGE=loader-base:bookworm

# ---------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS base
ENV LANG=C.UTF-8 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
RUN set -eu; \
    if ! command -v tini >/dev/null 2>&1 || ! python3 -c 'import ensurepip, venv' 2>/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends tini python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi; \
    groupadd --system --gid 10001 loader; \
    useradd --system --uid 10001 --gid loader --home-dir /home/loader --create-home --shell /usr/sbin/nologin loader

# ---------------------------------------------------------------------------------------------
# Build stages: a virtual environment in /opt/venv, installed from the wheels only (--no-index).
FROM base AS build-service
COPY deploy/docker/wheels/service/ /wheels/service/
COPY pyproject.toml deploy/docker/requirements.py /src/
RUN python3 -m venv /opt/venv \
    && python3 /src/requirements.py service /src/pyproject.toml > /tmp/requirements.txt \
    && pip install --no-index --find-links /wheels/service -r /tmp/requirements.txt
# The project itself, from source (its build backend is in the wheels too). --no-deps: the
# project's own dependency list includes torch, which the service never imports.
COPY pyproject.toml README.m[d] /src/
COPY loader_service/ /src/loader_service/
COPY client/ /src/client/
RUN pip install --no-index --find-links /wheels/service --no-deps /src \
    && loader-service --help >/dev/null \
    && python3 -c 'import loader_service.service, loader_service.http_api' \
    && ! python3 -c 'import torch' 2>/dev/null

FROM base AS build-trainer
COPY deploy/docker/wheels/trainer/ /wheels/trainer/
COPY deploy/docker/wheels/service/ /wheels/service/
COPY pyproject.toml deploy/docker/requirements.py /src/
RUN python3 -m venv /opt/venv \
    && python3 /src/requirements.py trainer /src/pyproject.toml > /tmp/requirements.txt \
    && pip install --no-index --find-links /wheels/trainer --find-links /wheels/service -r /tmp/requirements.txt
COPY pyproject.toml README.m[d] /src/
COPY loader_service/ /src/loader_service/
COPY client/ /src/client/
RUN pip install --no-index --find-links /wheels/trainer --find-links /wheels/service --no-deps /src \
    && python3 -c 'import torch, client; from client.demo import consume'

# ---------------------------------------------------------------------------------------------
# The trainer: the demo trainer by default; any training script that uses client.RemoteLoader.
FROM base AS trainer
COPY --from=build-trainer /opt/venv /opt/venv
USER 10001:10001
WORKDIR /home/loader
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["python3", "-m", "client.demo", "--endpoint", "tcp://loader:5555", "--epochs", "1"]

# ---------------------------------------------------------------------------------------------
# The service (last stage: the default target).
FROM base AS service
COPY --from=build-service /opt/venv /opt/venv
# /data: mount datasets here (read-only is fine). /cache: the generated demo dataset
# (LOADER_CACHE_DIR); owned by the service user so a fresh named volume inherits that.
RUN mkdir -p /data /cache && chown loader:loader /cache
ENV LOADER_HOST=0.0.0.0 \
    LOADER_DATA_PORT=5555 \
    LOADER_HTTP_PORT=8080 \
    LOADER_CACHE_DIR=/cache \
    HOME=/home/loader
EXPOSE 5555 8080
USER 10001:10001
WORKDIR /home/loader
# Liveness. Compose and Kubernetes gate traffic on /readyz themselves (workers up); this one
# only says the process answers. The start period covers generating the demo dataset.
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('LOADER_HTTP_PORT', '8080'), timeout=4)"]
# tini is PID 1: it forwards SIGTERM/SIGINT to the service (which stops its workers, unlinks its
# /dev/shm segments and exits 0) and reaps any orphan. `docker stop` is therefore graceful.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/bin/tini", "--", "loader-service"]
# Configure with LOADER_* variables: LOADER_DEMO=1, or LOADER_DATA=/data (os.pathsep-separated
# list), LOADER_WORKERS, LOADER_MAX_SHM_MB, LOADER_API_TOKEN / LOADER_API_TOKEN_FILE, ...
CMD ["serve"]
