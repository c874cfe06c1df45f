# Images of the disaggregated data loader.
#
#   service  (default target) the CPU-side loader service: numpy, pyzmq, FastAPI, decoders; no torch
#   trainer  the client library + torch (CPU build) + the demo trainer (python -m client.demo)
#
# The ordinary build (a machine with internet access; what `docker compose up` does):
#   docker build --target service -t remote-loader/service:0.1.0 .
#   docker build --target trainer -t remote-loader/trainer:0.1.0 .
# starts from python:3.11-slim-bookworm (tini added with apt) and installs the Python packages
# from the package index: PyPI, and torch from PyTorch's CPU-only index (TORCH_INDEX_URL).
#
# The air-gapped build (no network, no registry; docs/deployment.md, "Air-gapped build"):
#   sudo deploy/docker/build-base.sh      # debootstrap Debian bookworm -> image loader-base:bookworm
#   deploy/docker/fetch-wheels.sh         # every wheel the images install -> deploy/docker/wheels/
#   DOCKER_BUILDKIT=0 docker build --network none --build-arg BASE_IMAGE=loader-base:bookworm \
#       --build-arg WHEELS=required --target service -t remote-loader/service:0.1.0 .
# (or `docker compose -f docker-compose.yml -f docker-compose.airgap.yml build`). Wheels in
# deploy/docker/wheels/<target>/ are always used when present (pip --no-index); WHEELS=required
# makes their absence an error instead of a fallback to the index.
#
# No `# syntax=` line and no BuildKit-only instructions (RUN --mount, heredocs): the file builds
# with the classic builder of Debian's docker.io as well as with BuildKit, and BuildKit would try
# to pull a syntax frontend image from a registry.
#
# BASE_IMAGE: any Debian-based image with python3 (>= 3.11, for the wheels and tomllib): the
# official python:3.11-slim-bookworm (default; its python3 is /usr/local/bin/python3), the
# debootstrapped loader-base:bookworm, debian:bookworm-slim, ... The base stage installs with
# apt whatever the base lacks of tini and python3-venv (then it needs the network).
ARG BASE_IMAGE=python:3.11-slim-bookworm

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
    pkgs=""; \
    [ -x /usr/bin/tini ] || pkgs="$pkgs tini"; \
    python3 -c 'import ensurepip, venv' 2>/dev/null || pkgs="$pkgs python3 python3-venv"; \
    [ -s /etc/ssl/certs/ca-certificates.crt ] || pkgs="$pkgs ca-certificates"; \
    if [ -n "$pkgs" ]; then \
        apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $pkgs \
        && rm -rf /var/lib/apt/lists/*; \
    fi; \
    groupadd --system --gid 10001 loader; \
    useradd --system --uid 10001 --gid loader --home-dir /home/loader --create-home --shell /usr/sbin/nologin loader

# ---------------------------------------------------------------------------------------------
# Build stages: a virtual environment in /opt/venv (deploy/docker/pip-install.sh: from the wheels
# in deploy/docker/wheels/<target>/ if there are any, --no-index; else from the package index).
# The wheels folders hold a tracked .keep file, so these COPYs work when they have no wheels.
FROM base AS build-service
ARG WHEELS=auto
COPY deploy/docker/wheels/service/ /wheels/service/
COPY pyproject.toml deploy/docker/requirements.py deploy/docker/pip-install.sh /src/
RUN python3 -m venv /opt/venv && sh /src/pip-install.sh deps service
# The native JPEG kernel (loader_service/decode/_jpegroi.c) needs a C compiler, Python's and
# libjpeg-turbo's headers here (the air-gapped base has them: deploy/docker/build-base.sh); the image must have
# the fast path, so LOADER_REQUIRE_NATIVE_JPEG=1 makes a failed build fail the image build.
RUN set -eu; pkgs=""; \
    [ -f /usr/include/jpeglib.h ] || pkgs="$pkgs libjpeg62-turbo-dev"; \
    command -v gcc >/dev/null || pkgs="$pkgs gcc libc6-dev"; \
    python3 -c 'import os, sysconfig; assert os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h"))' \
        2>/dev/null || pkgs="$pkgs python3-dev"; \
    [ -z "$pkgs" ] || { apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $pkgs \
        && rm -rf /var/lib/apt/lists/*; }
# The project itself, from source. --no-deps: the project's own dependency list includes torch,
# which the service never imports.
COPY pyproject.toml setup.py README.m[d] /src/
COPY loader_service/ /src/loader_service/
COPY wire/ /src/wire/
COPY client/ /src/client/
RUN LOADER_REQUIRE_NATIVE_JPEG=1 sh /src/pip-install.sh project service \
    && LOADER_REQUIRE_NATIVE_JPEG=1 python3 -c 'import loader_service.decode.jpeg as j; print(j.decode_path())' \
    && loader-service --help >/dev/null \
    && python3 -c 'import loader_service.service, loader_service.control.http_api, loader_service.cli.consumer, os; assert os.path.isfile(os.path.join(loader_service.control.http_api.STATIC_DIR, "index.html"))' \
    && ! python3 -c 'import torch' 2>/dev/null

FROM base AS build-trainer
ARG WHEELS=auto
# Where torch comes from without wheels: the CPU-only build (PyPI's torch is the CUDA one).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
COPY deploy/docker/wheels/trainer/ /wheels/trainer/
COPY deploy/docker/wheels/service/ /wheels/service/
COPY pyproject.toml deploy/docker/requirements.py deploy/docker/pip-install.sh /src/
RUN python3 -m venv /opt/venv && sh /src/pip-install.sh deps trainer
COPY pyproject.toml setup.py README.m[d] /src/
COPY loader_service/ /src/loader_service/
COPY wire/ /src/wire/
COPY client/ /src/client/
RUN sh /src/pip-install.sh project trainer \
    && python3 -c 'import torch, client; from client.demo import consume'

# ---------------------------------------------------------------------------------------------
# The trainer: the demo trainer by default; any training script that uses client.RemoteLoader.
FROM base AS trainer
COPY --from=build-trainer /opt/venv /opt/venv
# /keys: CURVE keys (docker-compose.curve.yml mounts a volume here; a fresh one inherits the owner)
RUN mkdir -p /keys && chown loader:loader /keys
USER 10001:10001
WORKDIR /home/loader
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["python3", "-m", "client.demo", "--endpoint", "tcp://loader:5555", "--epochs", "1"]

# The default demo set (2000 JPEGs, ~100 MB), made once here rather than at every first start:
# `docker compose up` is then ready in seconds. Deterministic, so every build makes the same bytes.
FROM build-service AS demo
RUN python3 -c 'from loader_service.sources.demo import ensure_demo; ensure_demo(base="/demo", quiet=True).close()' \
    && du -sh /demo

# ---------------------------------------------------------------------------------------------
# The service (last stage: the default target).
FROM base AS service
# the native JPEG kernel's runtime library
RUN [ -e /usr/lib/x86_64-linux-gnu/libjpeg.so.62 ] || [ -n "$(find /usr/lib -name 'libjpeg.so.62' | head -1)" ] \
    || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libjpeg62-turbo \
         && rm -rf /var/lib/apt/lists/*; }
COPY --from=build-service /opt/venv /opt/venv
# read-only, looked in before /cache (loader_service/sources/demo.py)
COPY --from=demo /demo /usr/share/loader-service/demo
# /data: mount datasets here (read-only is fine). /cache: demo sets of other sizes, generated at
# first start (LOADER_CACHE_DIR); owned by the service user so a fresh named volume inherits that.
# /keys: CURVE keys (docker-compose.curve.yml).
RUN mkdir -p /data /cache /keys && chown loader:loader /cache /keys
ENV LOADER_HOST=0.0.0.0 \
    LOADER_DATA_PORT=5555 \
    LOADER_HTTP_PORT=8080 \
    LOADER_CACHE_DIR=/cache \
    LOADER_DEMO_BUILTIN=/usr/share/loader-service/demo \
    HOME=/home/loader
EXPOSE 5555 8080
USER 10001:10001
WORKDIR /home/loader
# Liveness. Compose and Kubernetes gate traffic on /readyz themselves (workers up); this one
# only says the process answers. The start period covers scanning a large dataset (or
# generating a demo set of a size other than the built-in 2000).
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('LOADER_HTTP_PORT', '8080'), timeout=4)"]
# tini is PID 1: it forwards SIGTERM/SIGINT to the service (which stops its workers, unlinks its
# /dev/shm segments and exits 0) and reaps any orphan. `docker stop` is therefore graceful.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/bin/tini", "--", "loader-service"]
# Configure with LOADER_* variables: LOADER_DEMO=1, or LOADER_DATA=/data (os.pathsep-separated
# list), LOADER_WORKERS, LOADER_MAX_SHM_MB, LOADER_API_TOKEN / LOADER_API_TOKEN_FILE, ...
CMD ["serve"]
