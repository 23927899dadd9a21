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

echo "==> helm chart: lint, render, validate every manifest (Kubernetes 1.36, strict), defaults and helm/kforge/ci/*"
rendered=$(mktemp)
trap 'rm -f "$rendered"' EXIT
for values in "" helm/kforge/ci/*.yaml; do
  echo "    values: ${values:-defaults}"
  .tools/bin/helm lint --strict helm/kforge ${values:+-f "$values"}
  .tools/bin/helm template kforge helm/kforge ${values:+-f "$values"} > "$rendered"
  # Custom resources (ServiceMonitor, ScaledObject) have no API schema here: a warning, not a failure.
  .venv/bin/kubernetes-validate --strict --quiet -k 1.36.0 "$rendered"
done
# The images' Dockerfiles.
.venv/bin/hadolint docker/*.Dockerfile

echo "==> tests"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --locked --no-fail-fast
else
  cargo test --workspace --locked --no-fail-fast
fi

echo "==> python client: install with dev tools, ruff, mypy --strict, pytest against target/debug/kforge"
cargo build -p kforge --bin kforge --locked
.venv/bin/pip install --quiet --disable-pip-version-check "./clients/python[dev]"
# The protocols' own clients, for the faces' tests: ors-sdk whole; openenv-core without its server's dependencies
# (gradio, ...), its client needing websockets and its package importing fastmcp.
.venv/bin/pip install --quiet --disable-pip-version-check ors-sdk==0.1.0 fastmcp==4.2.3 websockets==17.4
.venv/bin/pip install --quiet --disable-pip-version-check --no-deps openenv-core==0.3.0
(
  cd clients/python
  ../../.venv/bin/ruff check .
  ../../.venv/bin/ruff format --check .
  ../../.venv/bin/mypy
  KFORGE_BIN="$PWD/../../target/debug/kforge" ../../.venv/bin/pytest
)
