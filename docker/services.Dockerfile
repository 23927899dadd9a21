# syntax=docker/dockerfile:1
# kforge's CPU services: kforge-gateway, kforge-orchestrator, kforge-reward and the kforge CLI.
# Build from the repository root:  docker build -f docker/services.Dockerfile -t kforge:0.1.0 .
# The runtime is distroless (glibc, CA certificates, no shell) running as uid 65532, the chart's default user.

ARG RUST_IMAGE=rust:1.90-bullseye
ARG RUNTIME_IMAGE=gcr.io/distroless/cc-debian12:nonroot

FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY . .
# Caches survive between builds; the binaries are copied out of the cache mount.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked \
      -p kforge-gateway -p kforge-orchestrator -p kforge-reward -p kforge \
    && mkdir -p /out \
    && cp target/release/kforge-gateway target/release/kforge-orchestrator target/release/kforge-reward \
          target/release/kforge /out/

FROM ${RUNTIME_IMAGE}
COPY --from=build /out/ /usr/local/bin/
USER 65532:65532
EXPOSE 50053 50054 50055
ENTRYPOINT ["/usr/local/bin/kforge"]
