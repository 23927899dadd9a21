"""How kforge builds load_inline extensions (the build recipe: the light header where it suffices), and the flags
load_inline gives a build, for precompiling torch's extension header and nvcc's host compile ahead of candidates."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from .process import json_dump, open_file

# How kforge builds load_inline extensions. A .cu source includes torch/types.h where it asked for
# torch/extension.h: nvcc parses every header three times (the host front end, the device front end, the host
# compiler), and torch/extension.h adds the C++ frontend and the Python bindings, which kernels and their launchers
# do not use. Device code is unchanged (the same SASS: bench/results/evaluator-throughput/). A source that needs
# the full header fails its light build with errors naming torch's API, and is built again as written. The choice
# is recorded per extension next to the builds, so the run stage loads exactly what the compile stage built.
FULL_HEADER = re.compile(r'^([ \t]*#[ \t]*include[ \t]*)[<"]torch/extension\.h[>"]', re.MULTILINE)


RECIPE_FILE = "kforge-build-recipe.json"


def lighten(cuda_sources: Any) -> Any:
    """The .cu sources with the light header, or None when none asks for the full one."""
    if cuda_sources is None:
        return None
    sources = [cuda_sources] if isinstance(cuda_sources, str) else list(cuda_sources)
    if not any(isinstance(s, str) and FULL_HEADER.search(s) for s in sources):
        return None
    light = [FULL_HEADER.sub(r"\1<torch/types.h>", s) if isinstance(s, str) else s for s in sources]
    return light[0] if isinstance(cuda_sources, str) else light


FULL_HEADER_NAMES = ("torch", "at::", "c10", "ATen", "pybind", "py::", '"py"')


def names_full_header(log: str) -> bool:
    """Whether a light build's errors name torch, ATen, c10 or the Python bindings: what the full header may
    declare. Other errors (a typo, an undeclared variable) would fail the build as written too."""
    return any(name in line for line in log.splitlines() if "error" in line for name in FULL_HEADER_NAMES)


def install_build_recipe(building: bool) -> None:
    """Routes load_inline through the recipe; `building` in the compile stage, which decides and records."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root or os.environ.get("KFORGE_BUILD_RECIPE") == "stock":
        return
    from torch.utils import cpp_extension

    stock = cpp_extension.load_inline
    path = os.path.join(root, RECIPE_FILE)

    def recorded() -> dict[str, str]:
        try:
            with open_file(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def record(name: str, recipe: str) -> None:
        recipes = recorded()
        recipes[name] = recipe
        with open_file(path, "w") as f:
            json_dump(recipes, f)

    def load_inline(name: str, cpp_sources: Any, cuda_sources: Any = None, *args: Any, **kwargs: Any) -> Any:
        light = lighten(cuda_sources)
        if light is None:
            return stock(name, cpp_sources, cuda_sources, *args, **kwargs)
        if not building:
            chosen = light if recorded().get(name) == "light" else cuda_sources
            return stock(name, cpp_sources, chosen, *args, **kwargs)
        try:
            module = stock(name, cpp_sources, light, *args, **kwargs)
        except Exception as error:
            if "cuda.cuda.o" not in str(error) or not names_full_header(str(error)):
                raise  # not a failure the light header explains: built as written, the source fails the same way
            # Built again as written, under the same name and version, so a later process finds it up to date.
            getattr(getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None), "entries", {}).pop(name, None)
            module = stock(name, cpp_sources, cuda_sources, *args, **kwargs)
            record(name, "as_written")
            return module
        record(name, "light")
        return module

    cpp_extension.load_inline = load_inline


class _NinjaFileWritten(Exception):
    pass


def load_inline_flags(
    extra_cflags: list[str], cuda: bool, extra_cuda_cflags: list[str] | None = None
) -> dict[str, str]:
    """The variables (`cflags`, `post_cflags`, and with `cuda` `cuda_cflags` and `cuda_post_cflags`) of the ninja
    file load_inline writes for a probe extension given `extra_cflags` (and `extra_cuda_cflags`); the extension is
    never built."""
    import tempfile

    from torch.utils import cpp_extension

    def written(*args: Any, **kwargs: Any) -> NoReturn:
        raise _NinjaFileWritten()

    run_ninja = cpp_extension._run_ninja_build
    cpp_extension._run_ninja_build = written
    try:
        with tempfile.TemporaryDirectory() as build:
            with contextlib.suppress(_NinjaFileWritten):
                cpp_extension.load_inline(
                    "kforge_flags_probe",
                    "// probe",
                    cuda_sources="// probe" if cuda else None,
                    extra_cflags=extra_cflags,
                    extra_cuda_cflags=extra_cuda_cflags,
                    build_directory=build,
                )
            with open_file(os.path.join(build, "build.ninja")) as f:
                ninja = f.read()
    finally:
        cpp_extension._run_ninja_build = run_ninja
    return dict(re.findall(r"^(\w+) = (.*)$", ninja, re.MULTILINE))


def bindings_flags(extra_cflags: list[str], cuda: bool) -> list[str]:
    """The flags load_inline compiles an extension's bindings (main.cpp) with, given `extra_cflags`; without the
    extension's name, which torch/extension.h never reads."""
    values = load_inline_flags(extra_cflags, cuda)
    flags = shlex.split(values.get("cflags", "")) + shlex.split(values.get("post_cflags", ""))
    return [flag for flag in flags if not flag.startswith("-DTORCH_EXTENSION_NAME=")]


def precompile_host_prefixes(out_dir: str, variants: Mapping[str, Sequence[str]]) -> dict[str, str | None]:
    """With kforge's nvcc, the start of nvcc's host compile precompiled per variant (kforge_nvcc.HostPch), into
    `out_dir`/nvcc-host, with the flags load_inline gives nvcc (the variant's flags as extra_cuda_cflags).
    Returns {variant: None when built, else why not}."""
    import kforge_nvcc

    if not os.environ.get("PYTORCH_NVCC"):
        return {}
    out = os.path.join(out_dir, "nvcc-host")
    os.makedirs(out, exist_ok=True)
    # The environment of the compiles that will use them: the bindings' directory on the include path.
    os.environ["CPATH"] = out_dir
    return kforge_nvcc.precompile_host_prefixes(
        kforge_nvcc.real_nvcc(), nvcc_flags_of(variants), out, kforge_nvcc.COMMON_HEADERS, kforge_nvcc.COMMON_OPERATORS
    )


def nvcc_flags_of(variants: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """{name: the flags load_inline gives nvcc for a .cu file (cuda_cflags, cuda_post_cflags) with the variant's
    flags as extra_cuda_cflags}, for `variants` ({name: extra flags})."""
    flags: dict[str, list[str]] = {}
    for name, extra in variants.items():
        values = load_inline_flags([], True, extra_cuda_cflags=list(extra))
        flags[name] = shlex.split(values.get("cuda_cflags", "")) + shlex.split(values.get("cuda_post_cflags", ""))
    return flags
