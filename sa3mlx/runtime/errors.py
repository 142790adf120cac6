"""Errors a user can act on, and the one wrapper every stage and the `sa3mlx` command run under.

    raise ParamError("train.lr", "expected a positive number", "abc")
    raise ArtifactError(path, "truncated (EOF reading the array header)")   # the fix is worked out
    with reading(path, "latents"):                                         # a reader's load call
        array = np.load(path)

`run_stage("train", main)` turns a `UserError` into one line on stderr,
`sa3mlx: train: <message>`, and exit status 2 (`SA3MLX_DEBUG=1` adds the traceback); anything
else is a bug: its traceback, then a line asking to report it, exit status 1.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
import zipfile
from collections.abc import Callable
from pathlib import Path

import yaml

from sa3mlx.runtime import layout

DEBUG_ENV = "SA3MLX_DEBUG"
USER_ERROR_STATUS = 2
BUG_STATUS = 1
# what the loaders of numpy, mlx, safetensors, soundfile and json raise on a damaged file
LOAD_ERRORS = (OSError, EOFError, ValueError, KeyError, TypeError, RuntimeError, zipfile.BadZipFile, UnicodeError)
# stage outputs by folder, for the fix of a damaged artifact no lock entry covers
WRITTEN_BY = (
    (layout.NORMALIZED_DIR, "normalize"),
    (layout.LATENTS_DIR, "encode"),
    (layout.SVD_DIR, "svd"),
    (layout.CONVERTED_DIR, "convert"),
    (layout.LORA_DIR, "train"),
    (layout.RUNS_DIR, "train"),
    (layout.DEMOS_DIR, "demo"),
)


class UserError(Exception):
    """A mistake of the user's (a param, a file) with its fix in the message: no traceback."""


class ParamError(UserError, ValueError):
    """A bad value in params.yaml; ValueError too, for callers that validate options directly."""

    def __init__(self, key: str, problem: str, value=None, *, show_value: bool = True):
        got = f", got {value!r}" if show_value else ""
        super().__init__(f"{layout.PARAMS_FILE}: {key}: {problem}{got}")
        self.key = key

    def __str__(self) -> str:  # KeyError (of MissingParamError) would quote the message
        return str(self.args[0])


class MissingParamError(ParamError, KeyError):
    """A declared key params.yaml lacks; a KeyError too, so `section.get(key, default)` falls back."""


class ArtifactError(UserError):
    """A missing or damaged file another stage wrote: names the file, what is wrong and the fix."""

    def __init__(self, path: str | os.PathLike, problem: str, fix: str | None = None):
        self.path = Path(path)
        super().__init__(f"{display_path(self.path)}: {problem}; {fix or restore_hint(self.path)}")


def one_line(text: str) -> str:
    return " ".join(str(text).split())


@contextlib.contextmanager
def reading(path: str | os.PathLike, what: str = "file", fix: str | None = None):
    """Turn a loader's failure inside the block into an ArtifactError naming `path`."""
    path = Path(path)
    if not path.exists():
        raise ArtifactError(path, f"missing ({what})", fix)
    try:
        yield path
    except (ArtifactError, ParamError):
        raise
    except LOAD_ERRORS as e:  # a checker's own UserError (e.g. a CheckpointError) gains the fix here
        raise ArtifactError(path, f"damaged {what} ({_reason(e, path)})", fix) from e


def _reason(error: BaseException, path: Path) -> str:
    """The loader's words, without the path it may already start with."""
    text = one_line(error.args[0] if isinstance(error, KeyError) and error.args else error) or type(error).__name__
    for prefix in (f"{path}: ", f"{path.resolve()}: "):
        text = text.removeprefix(prefix)
    return text


# ---- the fix -------------------------------------------------------------------------------------------
def project_root(path: Path) -> Path | None:
    """The nearest folder at or above `path` (or the working directory) holding dvc.yaml."""
    for folder in [path.resolve(), *path.resolve().parents]:
        if (folder / layout.DVC_FILE).is_file():
            return folder
    return None


def display_path(path: Path) -> str:
    """`path` relative to its project (or the working directory) when inside it."""
    root = project_root(path) or Path.cwd()
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)


def restore_hint(path: Path) -> str:
    """`dvc checkout <out>` when dvc.lock tracks an output holding `path`, else `dvc repro -f <stage>`."""
    root = project_root(path)
    if root is None:
        return "check the path, or restore the file from where it came from"
    relative = path.resolve().relative_to(root).as_posix()
    tracked = tracked_output(root, relative)
    if tracked:
        return f"restore it with `dvc checkout {tracked}` (or `dvc repro -f {tracked_stage(root, tracked)}`)"
    stage = next((name for folder, name in WRITTEN_BY if relative.startswith(folder + "/")), None)
    return (
        f"rebuild it with `dvc repro -f {stage}`"
        if stage
        else "restore it from where it came from (no stage writes it)"
    )


def _lock_stages(root: Path) -> dict:
    lock = root / "dvc.lock"
    try:
        return (yaml.safe_load(lock.read_text()) or {}).get("stages") or {} if lock.is_file() else {}
    except (OSError, yaml.YAMLError):
        return {}


def tracked_output(root: Path, relative: str) -> str | None:
    """The output of a stage in dvc.lock (or a `.dvc` file) that holds `relative`."""
    for stage in _lock_stages(root).values():
        for out in stage.get("outs") or []:
            out_path = str(out.get("path", ""))
            if relative == out_path or relative.startswith(out_path.rstrip("/") + "/"):
                return out_path
    parts = relative.split("/")
    for n in range(len(parts), 0, -1):
        if (root / ("/".join(parts[:n]) + ".dvc")).is_file():
            return "/".join(parts[:n])
    return None


def tracked_stage(root: Path, out_path: str) -> str:
    for name, stage in _lock_stages(root).items():
        if any(str(out.get("path")) == out_path for out in stage.get("outs") or []):
            return name
    return next((name for folder, name in WRITTEN_BY if out_path.startswith(folder)), "the stage")


# ---- the wrapper ---------------------------------------------------------------------------------------
def report_user_error(name: str, error: UserError) -> int:
    if os.environ.get(DEBUG_ENV):
        traceback.print_exception(error)
    print(f"sa3mlx: {name}: {one_line(error)}", file=sys.stderr, flush=True)
    return USER_ERROR_STATUS


def report_bug(name: str, error: BaseException) -> int:
    traceback.print_exception(error)
    print(
        f"sa3mlx: {name}: internal error ({type(error).__name__}): this is a bug in sa3mlx, not in your "
        "input; please report it with the traceback above",
        file=sys.stderr,
        flush=True,
    )
    return BUG_STATUS


def guarded(name: str, main: Callable[[], int | None]) -> int:
    """`main()`'s status, with user errors and bugs reported as the module docstring says."""
    try:
        return int(main() or 0)
    except UserError as e:
        return report_user_error(name, e)
    except (SystemExit, KeyboardInterrupt):
        raise
    except Exception as e:
        return report_bug(name, e)


def run_stage(name: str, main: Callable[[], int | None]) -> None:
    """The entry point of `stages/<name>.py`: exit with `guarded(name, main)`."""
    sys.exit(guarded(name, main))
