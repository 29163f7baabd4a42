"""Builds (once) and loads the CUDA C++ extension of the ``cuda`` backend.

The extension is compiled with ``torch.utils.cpp_extension.load`` into a persistent cache
directory keyed on a hash of the sources, the flags and the torch / CUDA versions:

    $KDA_CACHE_DIR/cuda_ext/<hash>/   (KDA_CACHE_DIR defaults to ~/.cache/kda:
                                      kda.backend.cache_dir)

A later process finds the built module there and imports it directly, without ninja or nvcc.

Ahead-of-time build (e.g. in a container image, or before timing anything)::

    python3 -m kda.backends.cuda.build          # builds if needed, prints the module path

Compiling needs nvcc (CUDA 12.4 or newer, for sm_90a) and ninja; running needs an sm_90 GPU.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import pathlib
import sys
import threading
from types import ModuleType
from typing import List, Optional

from kda.backend import cache_dir as kda_cache_dir

HERE = pathlib.Path(__file__).resolve().parent
SOURCES = ("binding.cpp", "kda_decode.cu")
HEADERS = ("kda_decode.h",)

#: nvcc flags. No --use_fast_math: the kernel picks fast intrinsics explicitly where a bf16
#: rounding follows (SiLU, sigmoids) and keeps accurate expf on the decay path, whose result
#: must match the reference bit for bit where it is exactly 1 (see kda_decode.cu).
CUDA_FLAGS = [
    "-O3",
    "-gencode=arch=compute_90a,code=sm_90a",
    "-lineinfo",
    "-std=c++17",
]
CXX_FLAGS = ["-O3", "-std=c++17"]


_lock = threading.Lock()
_module: Optional[ModuleType] = None


def _fingerprint() -> str:
    import torch

    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((HERE / name).read_bytes())
    h.update(repr((CUDA_FLAGS, CXX_FLAGS, torch.__version__, torch.version.cuda,
                   sys.version_info[:2])).encode())
    return h.hexdigest()[:16]


def cache_dir() -> pathlib.Path:
    """The directory this version of the sources builds into."""
    return kda_cache_dir("cuda_ext") / _fingerprint()


def module_name() -> str:
    """The extension's Python module name, keyed by the sources' fingerprint."""
    return f"kda_cuda_{_fingerprint()}"


def _built_library(build_dir: pathlib.Path, name: str) -> Optional[pathlib.Path]:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES + [".so"]:
        p = build_dir / f"{name}{suffix}"
        if p.exists():
            return p
    return None


def _import_library(path: pathlib.Path, name: str) -> ModuleType:
    import torch  # noqa: F401  (the extension links against torch's libraries)

    spec = importlib.util.spec_from_file_location(name, str(path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load(verbose: bool = False) -> ModuleType:
    """The extension module, compiled on first use; later calls return the same module.

    Raises:
      RuntimeError: the library is not built yet and torch is not a CUDA build (the
        extension compiles against torch's CUDA libraries), or the compilation failed.
    """
    global _module
    with _lock:
        if _module is not None:
            return _module
        name, build_dir = module_name(), cache_dir()
        build_dir.mkdir(parents=True, exist_ok=True)
        # One builder per cache directory across processes (server workers, test shards
        # starting together): the others wait here, then load what it built. Without it a
        # process could see the library while another process's link was rewriting it
        # (seen on the H200: "cannot open shared object file").
        with open(build_dir / ".kda-build.lock", "w") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                _module = _load_locked(name, build_dir, verbose)
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)
        return _module


def _load_locked(name: str, build_dir: pathlib.Path, verbose: bool) -> ModuleType:
    lib = _built_library(build_dir, name)
    if lib is None:
        import torch
        from torch.utils import cpp_extension

        if torch.version.cuda is None:
            raise RuntimeError(f"the cuda backend needs a CUDA build of torch to compile; this "
                               f"one is {torch.__version__} (CPU only)")

        return cpp_extension.load(
            name=name,
            sources=[str(HERE / s) for s in SOURCES],
            extra_cflags=CXX_FLAGS,
            extra_cuda_cflags=CUDA_FLAGS,
            extra_include_paths=[str(HERE)],
            build_directory=str(build_dir),
            verbose=verbose,
        )
    return _import_library(lib, name)


def main(argv: Optional[List[str]] = None) -> int:
    """``python3 -m kda.backends.cuda.build [--verbose]``: build (or load) the extension ahead of
    time and print where it lives; exit status 0 on success."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    try:
        mod = load(verbose=args.verbose)
    except RuntimeError as e:
        print(f"cannot build the cuda extension: {e}", file=sys.stderr)
        return 1
    print(f"{mod.__name__}: {mod.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
