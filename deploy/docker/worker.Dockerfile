# syntax=docker/dockerfile:1
# vnfarm-worker for ROCm GPU boxes. Build from the repository root:
#   docker build -f deploy/docker/worker.Dockerfile -t vnfarm-worker:rocm .
#
# The worker links libtorch through tch (torch-sys), and torch-sys takes the libtorch of the
# `torch` Python package first on PATH (LIBTORCH_USE_PYTORCH=1; worker/models/README.md). A ROCm
# PyTorch image carries exactly that: a HIP build of torch with its libtorch_hip, the HIP headers
# the C++ shims compile against (/opt/rocm/include) and the ROCm runtime. The binary records that
# libtorch's lib/ as its RUNPATH (build-support), so the runtime stage is the same image: the path
# exists there and nothing needs LD_LIBRARY_PATH.
#
# torch-sys accepts libtorch 2.11.0 only: ROCM_PYTORCH_IMAGE must carry torch 2.11.0 (check
# `python3 -c 'import torch; print(torch.__version__, torch.version.hip)'` in it). The default tag
# follows rocm/pytorch's naming; pick the ROCm release the box's kernel and driver want
# (docs/operations.md §2).
ARG ROCM_PYTORCH_IMAGE=rocm/pytorch:rocm7.2_ubuntu24.04_py3.12_pytorch_release_2.11.0

FROM ${ROCM_PYTORCH_IMAGE} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Build tools for the C/C++ parts (aws-lc-sys through rustls, the model crate's C++ shims).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake pkg-config curl ca-certificates git \
 && rm -rf /var/lib/apt/lists/*
# The toolchain of rust-toolchain.toml.
ENV RUSTUP_HOME=/opt/rustup CARGO_HOME=/opt/cargo PATH=/opt/cargo/bin:$PATH
COPY rust-toolchain.toml /tmp/rust-toolchain.toml
RUN channel=$(sed -n 's/^channel = "\(.*\)"/\1/p' /tmp/rust-toolchain.toml) \
 && curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain "$channel" \
 && rustc --version
WORKDIR /src
COPY . .
# torch-sys links the libtorch of this image's `python3`; the worker's build script finds
# libtorch_hip.so beside it and links the HIP backend (build-support).
ENV LIBTORCH_USE_PYTORCH=1 CARGO_INCREMENTAL=0
RUN python3 -c 'import torch, sys; print("torch", torch.__version__, "hip", torch.version.hip); sys.exit(torch.version.hip is None)' \
 && cargo build --release --locked -p vnfarm-worker --bin vnfarm-worker \
 && install -D -m 0755 target/release/vnfarm-worker /out/vnfarm-worker \
 && readelf -d /out/vnfarm-worker | grep -E 'RUNPATH|torch_hip'

FROM ${ROCM_PYTORCH_IMAGE}
# A user of its own; `video` and `render` (the GPU device nodes) are added at run time
# (worker-box.yml's group_add, or `docker run --group-add`).
RUN groupadd --gid 10001 vnfarm \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /var/lib/vnfarm --shell /usr/sbin/nologin vnfarm \
 && install -d -o 10001 -g 10001 /var/lib/vnfarm /var/cache/vnfarm /var/cache/miopen /var/cache/miopen/kernels /etc/vnfarm
COPY --from=build /out/vnfarm-worker /usr/local/bin/vnfarm-worker
COPY deploy/worker.toml /etc/vnfarm/worker.toml
ENV VNFARM_CONFIG=/etc/vnfarm/worker.toml \
    VNFARM_LISTEN=0.0.0.0:9101 \
    MIOPEN_USER_DB_PATH=/var/cache/miopen \
    MIOPEN_CUSTOM_CACHE_DIR=/var/cache/miopen/kernels
USER 10001:10001
WORKDIR /var/lib/vnfarm
EXPOSE 9101
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=15s --timeout=5s --start-period=5m --retries=4 \
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9101/healthz', timeout=3)"]
ENTRYPOINT ["/usr/local/bin/vnfarm-worker"]
