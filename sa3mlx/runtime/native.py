"""The native CPU kernels (`cpu_kernels.cpp`): built once per machine, cached, loaded on demand.

An MLX C++ extension (nanobind, AVX2/FMA) with softmax, sigmoid, SwiGLU, RMSNorm and RoPE and their
backward passes, and the AdamW step over all adapter tensors, as MLX primitives. It is built with the
system's g++ (the compiler MLX's CPU `mx.compile` already needs) against the installed MLX and nanobind, into
`$XDG_CACHE_HOME/sa3mlx/native/<key>/` (key: the source, the exp constants, the MLX, nanobind and
Python versions and the compiler), atomically, under a file lock. `./dev` builds it at set-up
(`python -m sa3mlx.runtime.native`); a process that finds none builds it at its first use.

`load()` is the module, or None when it cannot be had (no g++, no nanobind, a failed build or
self-check): one warning line on stderr, once per machine (a marker file in the cache keeps the
reason; `python -m sa3mlx.runtime.native` retries); then `runtime/kernels.py` falls back to its
MLX-compiled kernels. Only x86-64 CPUs with AVX2 and FMA take it (elsewhere MLX's own kernels are vectorised, or
the fallback runs, silently). SA3MLX_NATIVE_KERNELS=0 turns it off.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

SWITCH = "SA3MLX_NATIVE_KERNELS"
SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
MODULE = "_sa3mlx_cpu"  # NB_MODULE name in the source
NB_DOMAIN = "mlx"  # MLX's Python module is built in this nanobind domain: arrays pass only within it
# -ffp-contract=off: a product and a sum stay two roundings, as written (and as MLX evaluates them); FMAs are
# the explicit _mm256_fmadd_ps calls only
FLAGS = (
    "-O3",
    "-std=c++20",
    "-mavx2",
    "-mfma",
    "-ffp-contract=off",
    "-shared",
    "-fPIC",
    "-fvisibility=hidden",
    "-DNDEBUG",
)


def supported() -> bool:
    """x86-64 Linux with AVX2 and FMA, and not switched off."""
    return os.environ.get(SWITCH, "1").lower() not in ("0", "off", "false") and _cpu_has_avx2_fma()


@functools.cache
def _cpu_has_avx2_fma() -> bool:
    if platform.machine() not in ("x86_64", "AMD64") or sys.platform != "linux":
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


def load():
    """The extension module, or None: unsupported here, switched off, or not to be had (said once)."""
    return _load() if supported() else None


@functools.cache
def _load(retry: bool = False):
    """A build that failed for these inputs is not retried by every process: its marker file keeps the
    reason, the warning is printed once, and `python -m sa3mlx.runtime.native` (./dev) tries again."""
    marker = _failure_marker()
    if marker.exists() and not retry:
        return None
    try:
        module = _import(build())
        _self_check(module)
        marker.unlink(missing_ok=True)
        return module
    except Exception as error:  # noqa: BLE001 — any failure means the fallback, said once
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        warning = f"sa3mlx: warning: native CPU kernels unavailable ({reason}); using MLX-compiled kernels"
        print(warning, file=sys.stderr)
        marker.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=marker.parent, delete=False) as tmp:
            tmp.write(warning + "\n")
        os.replace(tmp.name, marker)
        return None


def _failure_marker() -> Path:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or "none"
    inputs = "\n".join([*_inputs(), compiler])
    return _cache_dir() / f"failed-{hashlib.sha256(inputs.encode()).hexdigest()[:16]}"


def build() -> Path:
    """Path of the built extension, building it first when the cache has none for this key."""
    target = _cache_dir() / _key() / f"{MODULE}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            result = subprocess.run(_command(out), capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"g++ failed: {result.stderr.strip()[-2000:]}")
            os.replace(out, target)  # atomic: a reader never loads a half-written file
    return target


def _constants() -> dict[str, float]:
    from sa3mlx.runtime import kernels  # its exp scheme is the one home of these numbers

    named = {
        "LOG2E": kernels.LOG2E,
        "LN2_HI": kernels.LN2_HI,
        "LN2_LO": kernels.LN2_LO,
        "EXP_LO": kernels.EXP_LO,
    }
    named.update({f"C{i}": c for i, c in enumerate(kernels.EXP_POLY)})
    return named


def _command(out: Path) -> list[str]:
    import mlx.core as mx

    try:
        import nanobind
    except ImportError:
        raise RuntimeError("nanobind is not installed (pip install nanobind)") from None

    mlx_root = Path(mx.__file__).parent
    mlx_lib = mlx_root / "lib"
    defines = [f"-DSA3_{name}={value!r}f" for name, value in _constants().items()]
    return [
        _compiler(),
        *FLAGS,
        f"-DNB_DOMAIN={NB_DOMAIN}",
        *defines,
        f"-I{mlx_root / 'include'}",
        f"-I{nanobind.include_dir()}",
        f"-I{Path(nanobind.source_dir()).parent / 'ext' / 'robin_map' / 'include'}",
        f"-I{sysconfig.get_paths()['include']}",
        str(SOURCE),
        str(Path(nanobind.source_dir()) / "nb_combined.cpp"),
        f"-L{mlx_lib}",
        "-lmlx",
        f"-Wl,-rpath,{mlx_lib}",
        "-o",
        str(out),
    ]


def _compiler() -> str:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise RuntimeError("no C++ compiler (g++) found")
    return compiler


def _inputs() -> list[str]:
    """What the build depends on, but the compiler."""
    return [
        hashlib.sha256(SOURCE.read_bytes()).hexdigest(),
        repr(sorted(_constants().items())),
        repr(FLAGS),
        NB_DOMAIN,
        importlib.metadata.version("mlx"),
        _nanobind_version(),
        sys.version,
    ]


def _key() -> str:
    compiler = subprocess.run([_compiler(), "--version"], capture_output=True, text=True).stdout
    return hashlib.sha256("\n".join([*_inputs(), compiler]).encode()).hexdigest()[:16]


def _nanobind_version() -> str:
    try:
        return importlib.metadata.version("nanobind")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "sa3mlx" / "native"


def _import(path: Path):
    spec = importlib.util.spec_from_file_location(MODULE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _self_check(module) -> None:
    """The module takes and returns MLX arrays (the nanobind ABI matches) and agrees with MLX."""
    import mlx.core as mx

    x = mx.linspace(-30.0, 30.0, 3 * 37).reshape(3, 37)
    worst = mx.max(mx.abs(module.softmax(x) - mx.softmax(x, axis=-1, precise=True))).item()
    if not worst < 1e-6:
        raise RuntimeError(f"self-check failed: softmax differs from MLX's by {worst:.3g}")


def main(argv: list[str] | None = None) -> int:
    """`python -m sa3mlx.runtime.native [--quiet]`: build (or find) the extension, retrying a failed
    build, and say where it is (--quiet: only a failure, as one warning line)."""
    quiet = "--quiet" in (sys.argv[1:] if argv is None else argv)
    if not supported():
        if not quiet:
            print("sa3mlx: native CPU kernels: not used on this machine (needs x86-64 Linux with AVX2 and FMA)")
        return 0
    if _load(retry=True) is None:
        return 1
    if not quiet:
        print(f"sa3mlx: native CPU kernels: {build()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
