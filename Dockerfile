# syntax=docker/dockerfile:1
# Multi-stage build of the payledger release binary. The proto is compiled by the pure-Rust
# protox crate and SQLite is bundled, so the builder needs no protoc and no libsqlite3.

FROM rust:1.95-bookworm AS builder
WORKDIR /src
# Dependencies first, so they are cached until Cargo.toml or Cargo.lock change.
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto ./proto
RUN mkdir src \
 && echo 'fn main() {}' > src/main.rs \
 && echo '' > src/lib.rs \
 && cargo build --release --locked \
 && rm -rf src
COPY src ./src
COPY migrations ./migrations
# Touch the sources so cargo rebuilds the crate itself over the cached dummy.
RUN touch src/main.rs src/lib.rs \
 && cargo build --release --locked \
 && strip target/release/payledger

FROM debian:bookworm-slim AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --home-dir /var/lib/payledger --create-home payledger
COPY --from=builder /src/target/release/payledger /usr/local/bin/payledger
USER payledger
WORKDIR /var/lib/payledger
ENV PAYLEDGER_LISTEN=0.0.0.0:50051 \
    PAYLEDGER_LOG_FORMAT=json \
    DATABASE_URL=sqlite:/var/lib/payledger/payledger.db
VOLUME ["/var/lib/payledger"]
EXPOSE 50051
# SIGTERM: health turns NOT_SERVING, calls in flight get PAYLEDGER_SHUTDOWN_GRACE_SECONDS.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/payledger"]
CMD ["serve"]
