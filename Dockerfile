# kvpilot images, two targets from one file:
#
#   docker build --target runtime  -t kvpilot-runtime .            # CUDA (the engine pods)
#   docker build --target runtime  -t kvpilot-runtime:cpu \
#       --build-arg RUNTIME_BASE=ubuntu:24.04 \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .
#   docker build --target operator -t kvpilot-operator .           # kopf only: no torch, no CUDA
#
# Dependencies are installed before the source is copied, so a code change rebuilds one thin
# layer. No model weights are baked in: the operator mounts them. Kubernetes probes /health,
# so there is no HEALTHCHECK. Both images run as UID 1000, the user the operator's pod
# security context asks for.

ARG RUNTIME_BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG OPERATOR_BASE=python:3.11.11-slim-bookworm

# ---------------------------------------------------------------------------------------------
FROM ${RUNTIME_BASE} AS runtime-build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
# The distribution's python3 is the interpreter of the final image too; its version is whatever
# the base release ships, so apt versions are not pinned (the Python packages are).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/kvpilot
ENV PATH=/opt/kvpilot/bin:$PATH
WORKDIR /src
COPY pyproject.toml constraints.txt ./
RUN pip install --no-cache-dir torch==2.13.0 --index-url "${TORCH_INDEX}"
RUN python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['runtime']))" > runtime-requirements.txt \
    && pip install --no-cache-dir -c constraints.txt -r runtime-requirements.txt
COPY runtime runtime
COPY kernels kernels
COPY operator operator
COPY setup.py ./
RUN pip install --no-cache-dir --no-deps .

FROM ${RUNTIME_BASE} AS runtime
# A C compiler at run time, in both images: the CPU kernels (kernels/cpu/) are compiled on first
# use for the machine they run on (-march=native), and Triton compiles its launcher against
# Python.h. Without them a CPU engine falls back to the slower torch attention, and Triton fails.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 1000 --create-home --shell /usr/sbin/nologin kvpilot
COPY --from=runtime-build /opt/kvpilot /opt/kvpilot
# Caches (the default model, fetched by pip on first use) go to a writable volume: the root filesystem is read-only.
ENV PATH=/opt/kvpilot/bin:$PATH \
    XDG_CACHE_HOME=/var/cache/kvpilot \
    HF_HUB_OFFLINE=1
USER 1000
EXPOSE 8000
ENTRYPOINT ["kvpilot"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]

# ---------------------------------------------------------------------------------------------
FROM ${OPERATOR_BASE} AS operator-build
RUN python -m venv /opt/kvpilot
ENV PATH=/opt/kvpilot/bin:$PATH
WORKDIR /src
COPY pyproject.toml constraints.txt ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['operator']))" > operator-requirements.txt \
    && pip install --no-cache-dir -c constraints.txt -r operator-requirements.txt
COPY runtime runtime
COPY kernels kernels
COPY operator operator
COPY setup.py ./
RUN pip install --no-cache-dir --no-deps .

FROM ${OPERATOR_BASE} AS operator
RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin kvpilot
COPY --from=operator-build /opt/kvpilot /opt/kvpilot
ENV PATH=/opt/kvpilot/bin:$PATH
USER 1000
ENTRYPOINT ["kvpilot", "operator"]
