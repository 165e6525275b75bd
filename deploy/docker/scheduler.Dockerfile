# syntax=docker/dockerfile:1
# vnfarm-scheduler (with the `vnfarm` command line beside it). Build from the repository root:
#   docker build -f deploy/docker/scheduler.Dockerfile -t vnfarm-scheduler .
#
# The scheduler does not link libtorch: its dependencies (proto, bus, storage, config, signals,
# metrics and crates.io crates) reach neither tch nor torch-sys, so it builds on a plain Rust
# image and runs on a slim Debian one, as a user of its own.
ARG RUST_IMAGE=rust:1.95.0-slim-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

FROM ${RUST_IMAGE} AS build
# cmake and a C compiler for aws-lc-sys (rustls' crypto).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake pkg-config \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
ENV CARGO_INCREMENTAL=0
RUN cargo build --release --locked -p vnfarm-scheduler -p vnfarm-cli \
 && install -D -m 0755 target/release/vnfarm-scheduler /out/vnfarm-scheduler \
 && install -D -m 0755 target/release/vnfarm /out/vnfarm

FROM ${RUNTIME_IMAGE}
# ca-certificates: HTTPS to S3; curl: the health check.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 vnfarm \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin vnfarm
COPY --from=build /out/vnfarm-scheduler /out/vnfarm /usr/local/bin/
COPY deploy/scheduler.toml /etc/vnfarm/scheduler.toml
ENV VNFARM_CONFIG=/etc/vnfarm/scheduler.toml
USER 10001:10001
EXPOSE 8080
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD ["curl", "-fsS", "-o", "/dev/null", "http://127.0.0.1:8080/healthz"]
ENTRYPOINT ["/usr/local/bin/vnfarm-scheduler"]
