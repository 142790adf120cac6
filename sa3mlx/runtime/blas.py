"""Route MLX's CPU matmul and LAPACK calls to OpenBLAS on Linux.

The stock `mlx-cpu` wheel links a bundled *reference* BLAS (~10x slower than
OpenBLAS for fp32 GEMM). libmlx binds `cblas_sgemm` and its LAPACK symbols when
`mlx.core` is first imported, and the dynamic linker searches libraries loaded
with RTLD_GLOBAL before libmlx's own dependencies. So loading an OpenBLAS that
exports those names, before mlx is imported, is enough. `import sa3mlx` does it.

Candidates, first that loads wins:
1. `SA3MLX_BLAS=/path/to/lib.so` (or `SA3MLX_BLAS=off` to keep the reference BLAS);
2. the system OpenBLAS (`libopenblas.so.0`, e.g. Debian's libopenblas0-pthread);
3. a tiny trampoline library, built once with the C compiler into the user cache,
   that forwards the unprefixed names to the `scipy_`-prefixed OpenBLAS of the
   `scipy-openblas32` wheel (a runtime dependency on Linux).
Otherwise one warning line is printed and MLX keeps the reference BLAS.

OpenBLAS's worker threads busy-wait (sched_yield) for 2^OPENBLAS_THREAD_TIMEOUT cycles after
each call before they sleep; its default, 2^28 (~0.1 s), keeps them on the cores through every
op between two matmuls, where MLX's own work and the native kernels' threads need them. Unless
the user set it, it is set to THREAD_TIMEOUT before OpenBLAS loads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Every BLAS/LAPACK symbol libmlx (0.30+) imports from its bundled libblas/liblapack.
MLX_BLAS_SYMBOLS = (
    "cblas_sgemm cblas_dgemm cblas_cgemm "
    "sgetrf_ sgetri_ sgeqrf_ sorgqr_ spotrf_ strtri_ sgesdd_ sgeev_ ssyevd_ "
    "dgetrf_ dgetri_ dgeqrf_ dorgqr_ dpotrf_ dtrtri_ dgesdd_ dgeev_ dsyevd_ "
    "cgesdd_ cgeev_ cheevd_"
).split()

# 2^16 cycles (~20 us): measured on a 2-core x86 machine, six interleaved process pairs of the eager
# small-music DiT forward+backward took 3.67 s (median) at 16 against 3.90 s at the default 28; the
# tiny default trained at 9.8 steps/s at 4 (threads woken for every small matmul), 11.6-12.1 at 16 and 28
THREAD_TIMEOUT_ENV, THREAD_TIMEOUT = "OPENBLAS_THREAD_TIMEOUT", "16"

_state: dict = {"done": False, "library": None, "source": None}


def status() -> dict:
    """Which BLAS MLX was pointed at: {'library': path or None, 'source': str or None}."""
    return {"library": _state["library"], "source": _state["source"]}


def ensure_fast_blas() -> dict:
    """Load an optimized BLAS globally before mlx is imported (Linux only, idempotent)."""
    if _state["done"]:
        return status()
    _state["done"] = True
    if not sys.platform.startswith("linux"):
        _state["source"] = "platform"  # macOS: MLX uses Accelerate / Metal
        return status()
    choice = os.environ.get("SA3MLX_BLAS", "").strip()
    if choice.lower() in ("off", "0", "none", "reference"):
        return status()
    os.environ.setdefault(THREAD_TIMEOUT_ENV, THREAD_TIMEOUT)  # read by OpenBLAS when it loads
    if "mlx.core" in sys.modules and "openblas" not in os.environ.get("LD_PRELOAD", ""):
        _warn("mlx was imported before sa3mlx, so it is bound to the reference BLAS; import sa3mlx first")
        return status()
    for source, finder in (
        ("env", lambda: choice or None),
        ("system", _system_openblas),
        ("scipy-openblas32", _trampoline),
    ):
        path = _try(finder)
        if path and _load_global(path):
            _state.update(library=str(path), source=source)
            return status()
    _warn(
        "no optimized BLAS found; MLX CPU matmul runs on the reference BLAS (~10x slower). "
        "Install OpenBLAS (apt-get install libopenblas0-pthread) or a C compiler."
    )
    return status()


def _warn(message: str) -> None:
    print(f"sa3mlx: warning: {message}", file=sys.stderr)


def _try(finder):
    try:
        return finder()
    except Exception:  # a broken candidate must not stop the next one
        return None


def _load_global(path) -> bool:
    try:
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        return True
    except OSError:
        return False


def _system_openblas() -> str | None:
    name = ctypes.util.find_library("openblas")
    if name:
        return name
    for candidate in ("/usr/lib64/libopenblas.so.0", "/usr/local/lib/libopenblas.so.0"):
        if os.path.exists(candidate):
            return candidate
    return None


def trampoline_source(symbols, prefix: str, machine: str) -> str:
    """C source of a library whose exported `sym` jumps to `prefix + sym` (any signature)."""
    jump = {"x86_64": "jmp {target}@PLT", "aarch64": "b {target}"}[machine]
    body = []
    for sym in symbols:
        body.append(f'".globl {sym}\\n.type {sym},@function\\n{sym}:\\n  {jump.format(target=prefix + sym)}\\n"')
    return "__asm__(\n" + "\n".join(body) + "\n);\n"


def _trampoline() -> Path | None:
    import scipy_openblas32

    machine = platform.machine()
    if machine not in ("x86_64", "aarch64"):
        return None
    lib_dir = Path(scipy_openblas32.get_lib_dir())
    lib_name = scipy_openblas32.get_library()
    lib_file = lib_dir / f"lib{lib_name}.so"
    exported = ctypes.CDLL(str(lib_file), mode=ctypes.RTLD_GLOBAL)
    symbols = [s for s in MLX_BLAS_SYMBOLS if hasattr(exported, "scipy_" + s)]
    source = trampoline_source(symbols, "scipy_", machine)
    key = hashlib.sha256(f"{source}{lib_file}{lib_file.stat().st_size}".encode()).hexdigest()[:16]
    target = _cache_dir() / f"libsa3mlx_blas-{key}.so"
    if not target.exists():
        _compile(source, target, lib_dir, lib_name)
    return target


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(root) / "sa3mlx" / "blas"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _compile(source: str, target: Path, lib_dir: Path, lib_name: str) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "trampoline.c"
        src.write_text(source)
        out = Path(tmp) / target.name
        subprocess.run(
            [
                compiler,
                "-shared",
                "-fPIC",
                "-o",
                str(out),
                str(src),
                f"-L{lib_dir}",
                f"-l{lib_name}",
                f"-Wl,-rpath,{lib_dir}",
            ],
            check=True,
            capture_output=True,
        )
        os.replace(out, target)  # atomic: concurrent processes never load a half-written file
