# syntax=docker/dockerfile:1
# Multi-stage build of the payledger release binary. The proto is compiled by the pure-Rust
# protox crate and SQLite is bundled, so the builder needs no protoc and no libsqlite3.

FROM rust:1.95-bookworm AS builder
WORKDIR /src
# Dependencies first, so they are cached until a manifest or Cargo.lock changes. Cargo loads
# every workspace member's manifest, so each gets its manifest and an empty stand-in source;
# only the server (`-p payledger`) and the client crate it uses are built.
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto ./proto
COPY client ./client
COPY tools/Cargo.toml ./tools/Cargo.toml
COPY examples/checkout-service/Cargo.toml ./examples/checkout-service/Cargo.toml
RUN mkdir -p src tools/src examples/checkout-service/src \
 && echo 'fn main() {}' > src/main.rs \
 && echo '' > src/lib.rs \
 && echo 'fn main() {}' > tools/src/main.rs \
 && echo '' > tools/src/lib.rs \
 && echo 'fn main() {}' > examples/checkout-service/src/main.rs \
 && cargo build --release --locked -p payledger \
 && rm -rf src
COPY src ./src
COPY migrations ./migrations
# The git commit payledger_build_info names (build.rs); the context carries no .git, so pass
# `--build-arg PAYLEDGER_BUILD_COMMIT=$(git rev-parse HEAD)`. Declared here, after the
# dependency layer, so that a new commit does not rebuild the dependencies.
ARG PAYLEDGER_BUILD_COMMIT=unknown
# Touch the sources so cargo rebuilds the crate itself over the cached stand-in. The image
# carries the server binary only: the test tools (payledger-tools) are not built into it.
# Not stripped: the release profile keeps line tables (`debug = "line-tables-only"`) so that
# a panic's backtrace names files and lines. Those sections are compressed instead (zlib,
# which the standard library's backtrace reads): the binary goes from about 120 MB to 47 MB.
RUN touch src/main.rs src/lib.rs \
 && cargo build --release --locked -p payledger --bin payledger \
 && objcopy --compress-debug-sections=zlib target/release/payledger

FROM debian:bookworm-slim AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 payledger \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/payledger --create-home payledger
COPY --from=builder /src/target/release/payledger /usr/local/bin/payledger
# Numeric, so that a runtime that forbids root (Kubernetes runAsNonRoot) can verify it.
USER 10001:10001
WORKDIR /var/lib/payledger
# Listening beyond loopback, `serve` refuses to start without caller authentication: mount the
# JWKS (and TLS files) under /etc/payledger and set PAYLEDGER_AUTH_JWKS, PAYLEDGER_AUTH_ISSUER,
# PAYLEDGER_AUTH_AUDIENCE (and PAYLEDGER_TLS_CERT, PAYLEDGER_TLS_KEY), or
# PAYLEDGER_INSECURE_ALLOW_UNAUTHENTICATED=true behind a mesh that authenticates callers.
ENV PAYLEDGER_LISTEN=0.0.0.0:50051 \
    PAYLEDGER_LOG_FORMAT=json \
    DATABASE_URL=sqlite:/var/lib/payledger/payledger.db
VOLUME ["/var/lib/payledger"]
# gRPC; and Prometheus /metrics when PAYLEDGER_METRICS_LISTEN=0.0.0.0:9464 is set.
EXPOSE 50051 9464
# Readiness through gRPC health: NOT_SERVING (exit 1) while the database does not answer.
# It asks 127.0.0.1 at PAYLEDGER_LISTEN's port, over TLS when PAYLEDGER_TLS_CERT is set; then
# also set PAYLEDGER_HEALTH_TLS_CA (the CA of the server's certificate) and
# PAYLEDGER_HEALTH_TLS_DOMAIN (a name the certificate carries), and for mutual TLS
# PAYLEDGER_HEALTH_TLS_CERT / PAYLEDGER_HEALTH_TLS_KEY.
HEALTHCHECK --interval=10s --timeout=5s --start-period=40s --retries=3 \
  CMD ["/usr/local/bin/payledger", "health", "--timeout-ms", "3000"]
# SIGTERM: health turns NOT_SERVING, calls in flight get PAYLEDGER_SHUTDOWN_GRACE_SECONDS (10),
# then the pool closes. Give the container longer than that to stop (`docker run
# --stop-timeout 20`, compose `stop_grace_period`, Kubernetes `terminationGracePeriodSeconds`):
# Docker's default of 10 s can SIGKILL it while calls finish or the pool closes.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/payledger"]
CMD ["serve"]
