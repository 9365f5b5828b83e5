# The akri agent image: `akri agent` (the DaemonSet) and `akri handler NAME` (external
# handlers). Build: docker build -t ghcr.io/akri-py/akri-agent:0.1.0 .
#
# Stage 1 builds the wheel; the final stage installs only that wheel and its runtime
# dependencies (no compiler, no test tools, no sources).
ARG PYTHON=3.12

FROM python:${PYTHON}-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent ./agent
COPY discovery_handlers ./discovery_handlers
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:${PYTHON}-slim
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="akri-py-agent" \
      org.opencontainers.image.description="Akri-compatible device discovery agent for Kubernetes" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/akri-py/akri-py-agent" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /wheels /wheels
# binary wheels only (grpcio, protobuf, PyYAML, aiohttp): nothing is compiled here
RUN pip install --no-cache-dir --only-binary=:all: /wheels/*.whl \
    && rm -rf /wheels \
    && python -m compileall -q /usr/local/lib/python*/site-packages/agent \
       /usr/local/lib/python*/site-packages/discovery_handlers
# Runs as root, and only because the kubelet's host sockets and directories it must write
# (device-plugins, plugins_registry, plugins, /var/run/cdi, /var/lib/akri) belong to root.
# The DaemonSet drops every capability and mounts the root filesystem read-only.
USER 0
ENTRYPOINT ["akri"]
CMD ["agent"]
