"""Build llama.cpp's ``llama-server`` (CPU only) for the peer comparison of issue 15
(``benchmarks/llamacpp_compare.py``).

The llama.cpp sources come from the ``llama-cpp-python`` sdist on PyPI (it vendors llama.cpp under
``vendor/llama.cpp``), fetched with ``pip download --no-binary :all: --no-deps``, so the build needs
only a package index, cmake and a C++17 compiler (ninja when present). Only the ``llama-server``
target is built, statically linked, without curl/OpenSSL or the web UI, with ``-DGGML_NATIVE=ON``
(tuned to this CPU: the binary is not portable). It lands in
``$LASER_CACHE_DIR/llama.cpp/<version>/llama-server`` (``~/.cache/laser`` without the variable);
when that file exists the build is skipped. About 10-20 minutes on 2 cores.

    python benchmarks/build_llama_server.py                      # prints the binary's path
    python benchmarks/build_llama_server.py --version 0.3.16 --jobs 4 --force

Raises (exits with) ``subprocess.CalledProcessError`` when pip, cmake or the compiler fails, and
FileNotFoundError when the sdist lacks ``vendor/llama.cpp`` or the build produced no binary.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.16"  # llama-cpp-python sdist whose vendored llama.cpp is built


def binary_path(version: str = LLAMA_CPP_PYTHON_VERSION, cache_root: Path | None = None) -> Path:
    """Where the ``llama-server`` built from llama-cpp-python ``version`` lives:
    ``<cache_root>/llama.cpp/<version>/llama-server`` (cache_root defaults to Laser's user cache,
    ``$LASER_CACHE_DIR`` or ``~/.cache/laser``)."""
    if cache_root is None:
        from laser.model.loader import cache_dir

        cache_root = cache_dir()
    return Path(cache_root) / "llama.cpp" / version / "llama-server"


def pip_download_cmd(version: str, dest: Path, python: str = sys.executable) -> list[str]:
    """The ``pip download`` command fetching the llama-cpp-python ``version`` sdist into ``dest``."""
    return [python, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
            f"llama-cpp-python=={version}", "-d", str(dest)]


def cmake_configure_cmd(src: Path, build: Path, generator: str | None = None) -> list[str]:
    """The cmake configure command for a CPU-only, static, native ``llama-server`` build of the
    llama.cpp tree ``src`` into ``build``. Options a given llama.cpp revision does not know (e.g.
    ``LLAMA_CURL`` after it was replaced by ``LLAMA_OPENSSL``) are ignored by cmake with a warning."""
    cmd = ["cmake", "-S", str(src), "-B", str(build)]
    if generator:
        cmd += ["-G", generator]
    return cmd + [
        "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
        "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",  # no HTTPS downloads: the model is a local file
        "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF",  # CPU only
        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",  # newer trees: no npm, no UI download
    ]


def cmake_build_cmd(build: Path, jobs: int) -> list[str]:
    """The cmake command building only the ``llama-server`` target in ``build`` with ``jobs`` jobs."""
    return ["cmake", "--build", str(build), "--config", "Release", "--target", "llama-server", "-j", str(jobs)]


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def build(version: str, out: Path, jobs: int, workdir: Path) -> Path:
    """Download the sdist into ``workdir``, build ``llama-server`` there and copy it to ``out``."""
    _run(pip_download_cmd(version, workdir))
    sdists = sorted(workdir.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        raise FileNotFoundError(f"pip download left no llama_cpp_python-*.tar.gz in {workdir}")
    with tarfile.open(sdists[0]) as tf:
        tf.extractall(workdir, filter="data")
    srcs = sorted(workdir.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if not srcs or not (srcs[0] / "CMakeLists.txt").is_file():
        raise FileNotFoundError(f"{sdists[0].name} has no vendor/llama.cpp/CMakeLists.txt")
    build_dir = workdir / "build"
    _run(cmake_configure_cmd(srcs[0], build_dir, "Ninja" if shutil.which("ninja") else None))
    _run(cmake_build_cmd(build_dir, jobs))
    built = next((p for p in build_dir.rglob("llama-server") if p.is_file()), None)
    if built is None:
        raise FileNotFoundError(f"the build produced no llama-server under {build_dir}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.copy2(built, tmp)
    tmp.replace(out)  # atomic: a half-copied binary is never taken for a finished build
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default=LLAMA_CPP_PYTHON_VERSION,
                    help="llama-cpp-python sdist version whose vendored llama.cpp is built (default %(default)s)")
    ap.add_argument("--cache-dir", type=Path, default=None,
                    help="cache root (default $LASER_CACHE_DIR, else ~/.cache/laser); the binary goes to "
                         "<cache-dir>/llama.cpp/<version>/llama-server")
    ap.add_argument("--jobs", "-j", type=int, default=2, help="parallel compile jobs (default %(default)s)")
    ap.add_argument("--force", action="store_true", help="rebuild even when the binary exists")
    ap.add_argument("--keep-build", type=Path, default=None,
                    help="build in this directory and keep it (default: a temporary directory, removed)")
    args = ap.parse_args(argv)

    out = binary_path(args.version, args.cache_dir)
    if out.is_file() and not args.force:
        print(f"llama-server already built: {out}")
        return 0
    t0 = time.monotonic()
    if args.keep_build is not None:
        args.keep_build.mkdir(parents=True, exist_ok=True)
        build(args.version, out, args.jobs, args.keep_build)
    else:
        with tempfile.TemporaryDirectory(prefix="llama-server-build-") as d:
            build(args.version, out, args.jobs, Path(d))
    print(f"built llama-server (llama-cpp-python {args.version}) in {time.monotonic() - t0:.0f} s: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
