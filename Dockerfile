# The two images the chart runs:
#   docker build --target runtime  -t kvfleet/runtime:0.1.0 .    # `kvfleet serve`, `kvfleet download-model`
#   docker build --target operator -t kvfleet/operator:0.1.0 .   # `kvfleet operator` and `kvfleet gateway`, no torch
# Both run as uid/gid 1000, the user the chart and the rendered pods ask for.
# BASE_IMAGE: any Debian bookworm with Python 3.11 as `python` and `pip`; `make images` builds one from Debian's
# packages and builds both images on it with podman, no daemon (docs/images.md).

ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kvfleet kvfleet
COPY runtime runtime
COPY operator operator
COPY gateway gateway
COPY contract contract
# -P: the source tree's operator/ must not shadow the standard library's operator module.
RUN python -P -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${BASE_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --gid 1000 kvfleet \
    && useradd --uid 1000 --gid 1000 --home-dir /home/kvfleet --create-home --shell /usr/sbin/nologin kvfleet
WORKDIR /home/kvfleet

FROM base AS runtime
# Triton compiles a small launcher module with the C compiler the first time a kernel runs; the C++ compiler
# builds the CPU operations below.
RUN apt-get update \
    && apt-get install --yes --no-install-recommends gcc g++ libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY requirements/core.txt requirements/tracing.txt requirements/runtime.txt /tmp/requirements/
RUN pip install --requirement /tmp/requirements/runtime.txt
COPY --from=wheel /wheels /tmp/wheels
RUN pip install --no-deps /tmp/wheels/*.whl && rm -rf /tmp/wheels /tmp/requirements
# The C++ CPU operations, built for every x86-64 level into a folder pods only read: a pod loads its node's
# level from there instead of compiling (the compiler stays for Triton and for CPUs of other architectures).
ENV KVFLEET_PREBUILT_KERNELS=/opt/kvfleet/kernels
RUN TORCH_EXTENSIONS_DIR=/tmp/kernel-builds kvfleet build-kernels "$KVFLEET_PREBUILT_KERNELS" \
    && rm -rf /tmp/kernel-builds
USER 1000:1000
EXPOSE 8000
ENTRYPOINT ["kvfleet"]
CMD ["serve", "--help"]

FROM base AS operator
COPY requirements/core.txt requirements/tracing.txt requirements/operator.txt requirements/gateway.txt \
    /tmp/requirements/
RUN pip install --requirement /tmp/requirements/operator.txt --requirement /tmp/requirements/gateway.txt
COPY --from=wheel /wheels /tmp/wheels
RUN pip install --no-deps /tmp/wheels/*.whl && rm -rf /tmp/wheels /tmp/requirements
USER 1000:1000
EXPOSE 8080 8081
ENTRYPOINT ["kvfleet"]
CMD ["operator"]
