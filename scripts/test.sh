#!/usr/bin/env bash
# The whole kforge test suite, from a fresh clone: set-up, formatting, lints, the chart, then every test.
set -euo pipefail
cd "$(dirname "$0")/.."

# Disk, at each stage: the build, the venv and the tests' work directories take tens of GB together
# (docs/DEPENDENCIES.md, "Build profile and disk").
disk() { printf '    disk: %s free; target %s, .venv %s\n' "$(df -h --output=avail . | tail -n1 | tr -d ' ')" \
  "$(du -sh target 2>/dev/null | cut -f1)" "$(du -sh .venv 2>/dev/null | cut -f1)"; }
disk

scripts/setup.sh --test
disk
# Set-up installed every tool the tests use, so a test that finds one missing fails instead of skipping.
export KFORGE_CI=1
# One build from clean: incremental compilation's caches would roughly double the workspace crates' share of
# target/ and speed nothing up.
export CARGO_INCREMENTAL=0

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

disk
echo "==> tests"
status=0
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --locked --no-fail-fast || status=$?
else
  cargo test --workspace --locked --no-fail-fast || status=$?
fi
disk
[[ $status -eq 0 ]] || exit "$status"

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

# The evaluator's harness (the Python beside candidates): ruff as above, pyright with the .venv's torch, and its
# tests (crates/execution/harness/pyproject.toml). pyright is told not to ask PyPI for a newer version.
echo "==> harness: ruff, pyright, pytest (crates/execution/harness)"
(
  cd crates/execution/harness
  ../../../.venv/bin/ruff check .
  ../../../.venv/bin/ruff format --check .
  PYRIGHT_PYTHON_IGNORE_WARNINGS=1 ../../../.venv/bin/pyright --pythonpath ../../../.venv/bin/python
  ../../../.venv/bin/pytest
)

# bench/'s Python (the GPU passes' scripts, the probes, the helpers): ruff and pyright as above, with
# bench/pyproject.toml. They run on GPU machines only, so nothing runs them here; bench/results/ is left as recorded.
echo "==> bench Python: ruff, pyright (bench)"
(
  cd bench
  ../.venv/bin/ruff check .
  ../.venv/bin/ruff format --check .
  PYRIGHT_PYTHON_IGNORE_WARNINGS=1 ../.venv/bin/pyright --pythonpath ../.venv/bin/python
)
disk
