# dynpart: one image for both components (`dynpart planner run`, `dynpart agent run`).
#
#   docker build -t ghcr.io/dynpart/dynpart:0.1.0 .
#
# The dependencies are the exact versions pinned in pyproject.toml. The image runs as the
# non-root user 10001 (the Helm chart's planner runs as it); the node agent's pod overrides the
# user to root for the kubelet's PodResources socket. NVML (libnvidia-ml.so.1) is not in the
# image: the NVIDIA container runtime injects the host driver's copy
# (NVIDIA_VISIBLE_DEVICES=all, NVIDIA_DRIVER_CAPABILITIES=compute,utility; set by the chart).
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/dynpart
WORKDIR /src
COPY . .
RUN /opt/dynpart/bin/pip install . \
    && /opt/dynpart/bin/dynpart --version

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="dynpart" \
      org.opencontainers.image.description="Dynamic GPU partitioning (MIG and MPS) for Kubernetes" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/dynpart/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    MPLCONFIGDIR=/tmp/matplotlib
COPY --from=build /opt/dynpart /opt/dynpart
# tini: `dynpart agent mps-control` starts the MPS control daemon with `-d`, which forks; when the
# daemon ends it is reaped by tini, as PID 1 or, in the host's PID namespace (the chart's default
# for mps-control), as a subreaper (TINI_SUBREAPER): dynpart is not written to reap (a zombie per
# daemon restart)
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 dynpart \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin dynpart
USER 10001:10001
ENTRYPOINT ["tini", "--", "dynpart"]
CMD ["--help"]
