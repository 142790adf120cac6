import ctypes
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from sa3mlx.runtime import blas

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="BLAS set-up is Linux-only")


class DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def library_providing(symbol: str) -> str:
    """Path of the library the global scope resolves `symbol` to (what libmlx binds)."""
    libc = ctypes.CDLL(None)
    address = ctypes.cast(getattr(libc, symbol), ctypes.c_void_p)
    info = DlInfo()
    libc.dladdr(address, ctypes.byref(info))
    return info.dli_fname.decode()


@linux
def test_mlx_gemm_symbol_resolves_to_openblas():
    status = blas.status()
    assert status["library"], "no optimized BLAS was loaded"
    provider = library_providing("cblas_sgemm")
    assert "mlx_cpu.libs" not in provider and "libblas-" not in provider, provider


def test_matmul_and_svd_are_correct_through_the_optimized_blas():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((300, 200), np.float32), rng.standard_normal((200, 100), np.float32)
    got = np.array(mx.array(a) @ mx.array(b))
    np.testing.assert_allclose(got, a @ b, rtol=1e-4, atol=1e-4)
    u, s, vt = mx.linalg.svd(mx.array(a), stream=mx.cpu)
    np.testing.assert_allclose(np.array(s), np.linalg.svd(a, compute_uv=False), rtol=1e-4)
    recon = np.array(u[:, :200] * s) @ np.array(vt)
    np.testing.assert_allclose(recon, a, atol=1e-3)


def test_trampoline_source_jumps_to_prefixed_symbols():
    src = blas.trampoline_source(["cblas_sgemm", "sgesdd_"], "scipy_", "x86_64")
    assert "cblas_sgemm:\\n  jmp scipy_cblas_sgemm@PLT" in src
    assert ".globl sgesdd_" in src


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, timeout=120
    )


@linux
def test_importing_mlx_first_warns_in_one_line():
    result = run_python("import mlx.core; import sa3mlx", SA3MLX_BLAS="")
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("sa3mlx: warning:")]
    assert result.returncode == 0 and len(lines) == 1, result.stderr


@linux
def test_unavailable_blas_falls_back_with_one_warning(tmp_path):
    # an explicit bad path, no system library and no trampoline (e.g. no C compiler)
    code = (
        "import sa3mlx.runtime.blas as b\n"
        "b._trampoline = b._system_openblas = lambda: None; b._state.update(done=False, library=None)\n"
        "print(b.ensure_fast_blas())"
    )
    result = run_python(code, SA3MLX_BLAS=str(tmp_path / "missing.so"))
    warnings = [ln for ln in result.stderr.splitlines() if "warning" in ln]
    assert result.returncode == 0 and len(warnings) == 1, result.stderr
    assert "'library': None" in result.stdout


THREAD_TIMEOUT_PROBE = (
    "import ctypes, os, sa3mlx\n"
    "from sa3mlx.runtime import blas\n"
    "library = ctypes.CDLL(blas.status()['library'])\n"
    "read = getattr(library, 'openblas_thread_timeout', None)\n"  # the value OpenBLAS read (not every build exports it)
    "print(os.environ[blas.THREAD_TIMEOUT_ENV], read() if read else 'n/a')"
)


@linux
@pytest.mark.parametrize("user_value", [None, "20"])
def test_openblas_idle_threads_sleep_soon_unless_the_user_says_otherwise(user_value):
    env = {k: v for k, v in os.environ.items() if k != blas.THREAD_TIMEOUT_ENV}
    if user_value:
        env[blas.THREAD_TIMEOUT_ENV] = user_value
    result = subprocess.run([sys.executable, "-c", THREAD_TIMEOUT_PROBE], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    expected = user_value or blas.THREAD_TIMEOUT
    seen, read = result.stdout.split()
    assert seen == expected and read in (expected, "n/a"), result.stdout


@linux
def test_blas_can_be_switched_off():
    result = run_python("import sa3mlx.runtime.blas as b; print(b.ensure_fast_blas())", SA3MLX_BLAS="off")
    assert "'library': None" in result.stdout and result.stderr == ""


@pytest.mark.parametrize("folder", ["bench", "stages", "tools"])
def test_scripts_set_up_the_blas_before_they_import_mlx(folder):
    """A script run on its own must `import sa3mlx` before mlx, or MLX binds the reference BLAS (~5 GFLOP/s)."""
    import ast

    from conftest import ROOT

    late = []
    for path in sorted((ROOT / folder).glob("*.py")):
        order = []
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                order += [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                order.append(node.module.split(".")[0])
        if "mlx" in order and ("sa3mlx" not in order or order.index("mlx") < order.index("sa3mlx")):
            late.append(path.name)
    assert late == []
