#!/usr/bin/env bash
# The whole kforge test suite, from a fresh clone: set-up, formatting, lints, the chart, then every test.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh --test
# Set-up installed every tool the tests use, so a test that finds one missing fails instead of skipping.
export KFORGE_CI=1

echo "==> cargo fmt --check"
cargo fmt --all -- --check

echo "==> clippy (warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings

echo "==> helm chart: lint, render, validate every manifest (Kubernetes 1.36, strict)"
.tools/bin/helm lint --strict helm/kforge
rendered=$(mktemp)
trap 'rm -f "$rendered"' EXIT
.tools/bin/helm template kforge helm/kforge > "$rendered"
.venv/bin/kubernetes-validate --strict --quiet -k 1.36.0 "$rendered"

echo "==> tests"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --locked --no-fail-fast
else
  cargo test --workspace --locked --no-fail-fast
fi
