# syntax=docker/dockerfile:1
# kforge's GPU services: kforge-evaluator and kforge-profiler, with the device probe their engine launches
# (kforge-device-probe, a binary of crates/execution), on a CUDA + PyTorch base.
# Build from the repository root:
#   docker build -f docker/gpu.Dockerfile --build-arg BASE_IMAGE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-devel \
#     -t kforge-gpu:0.1.0 .
# The base must be a *devel* image (nvcc and the CUDA headers build candidates' extensions) whose `python3` has
# PyTorch; the profiler also needs Nsight Compute's `ncu` on PATH (docs/DEPLOYMENT.md).

ARG BASE_IMAGE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-devel
# Debian 11's glibc (2.31) is older than any supported base's, so the binaries run on all of them.
ARG RUST_IMAGE=rust:1.90-bullseye

FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin kforge-evaluator --bin kforge-device-probe --bin kforge-profiler \
    && mkdir -p /out \
    && cp target/release/kforge-evaluator target/release/kforge-device-probe target/release/kforge-profiler /out/

FROM ${BASE_IMAGE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# A C++ compiler and ninja build the extensions; versions follow the base image's distribution.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ ninja-build \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' \
    && nvcc --version \
    && if ! command -v ncu >/dev/null; then echo "note: no ncu in this base; the profiler needs Nsight Compute"; fi
# The pods' user (uid 65532): torch and triton look their user up by uid.
RUN groupadd --gid 65532 kforge && useradd --uid 65532 --gid 65532 --home-dir /tmp --no-create-home kforge
COPY --from=build /out/ /usr/local/bin/
USER 65532:65532
ENV HOME=/tmp
EXPOSE 50051 50052
ENTRYPOINT ["/usr/local/bin/kforge-evaluator"]
