"""Run directories, checkpoint files and save requests, in underfit's layout.

    <save_dir>/<name>/                      the run (a DVC `persist` output)
        <8-hex>/checkpoints/<label>-step=<S>-epoch=<E>.safetensors    one session per process
        <8-hex>/checkpoints/resume-<8-hex>.npz|.json                   its resume state (resume.py)
        demos/loss_by_timestep.bin
        SAVE_NOW                            touch it: a checkpoint after the current step

Checkpoints are found recursively by the `step=<S>` in their names, as the dashboard finds
them. A save is requested by SIGUSR1 or the SAVE_NOW file; SIGINT / SIGTERM ask the loop to
save and stop after the current step (a second one exits at once).
"""

from __future__ import annotations

import re
import shutil
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

from sa3mlx.lora.checkpoint import checkpoint_file_name, run_label, session_dir
from sa3mlx.train.progress import SAVE_REQUESTED, emit

SAVE_NOW_FILE = "SAVE_NOW"
DEMOS_DIR = "demos"
STEP_RE = re.compile(r"step=(\d+)")
EPOCH_RE = re.compile(r"epoch=(\d+)")


@dataclass(frozen=True)
class RunPaths:
    save_dir: Path
    name: str
    session: str  # this process's 8-hex session folder

    @classmethod
    def create(cls, save_dir: str | Path, name: str, session: str | None = None) -> RunPaths:
        checkpoints = session_dir(save_dir, name, session)
        return cls(Path(save_dir), name, checkpoints.parent.name)

    @property
    def root(self) -> Path:
        return self.save_dir / self.name

    @property
    def checkpoints(self) -> Path:
        return session_dir(self.save_dir, self.name, self.session)

    @property
    def demos(self) -> Path:
        return self.root / DEMOS_DIR

    @property
    def save_now(self) -> Path:
        return self.root / SAVE_NOW_FILE

    @property
    def label(self) -> str:
        return run_label(self.name)

    def ensure_root(self) -> Path:
        """The run folder, with a `*` .gitignore: checkpoints are machine-local, never for git."""
        self.root.mkdir(parents=True, exist_ok=True)
        ignore = self.root / ".gitignore"
        if not ignore.exists():
            ignore.write_text("*\n")
        return self.root

    def checkpoint_path(self, step: int, epoch: int) -> Path:
        return self.checkpoints / checkpoint_file_name(self.label, step, epoch)


def checkpoint_step(path: str | Path) -> int | None:
    match = STEP_RE.search(Path(path).name)
    return int(match.group(1)) if match else None


def checkpoint_epoch(path: str | Path) -> int | None:
    match = EPOCH_RE.search(Path(path).name)
    return int(match.group(1)) if match else None


def list_checkpoints(root: str | Path) -> list[Path]:
    """Every `*step=<S>*.safetensors` under root (any session), oldest step first (mtime breaks ties)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.rglob("*.safetensors") if p.is_file() and checkpoint_step(p) is not None]
    return sorted(found, key=lambda p: (checkpoint_step(p), p.stat().st_mtime_ns, str(p)))


def prune_checkpoints(root: str | Path, keep_last: int | None, companions=lambda p: []) -> list[Path]:
    """Delete all but the newest `keep_last` checkpoints of the run (and each one's companion
    files, e.g. its resume state); returns the deleted checkpoints."""
    if keep_last is None:
        return []
    doomed = list_checkpoints(root)[:-keep_last] if keep_last > 0 else list_checkpoints(root)
    for path in doomed:
        for extra in [*companions(path), path]:
            Path(extra).unlink(missing_ok=True)
        _remove_empty_session(path.parent, Path(root))
    return doomed


def _remove_empty_session(checkpoints: Path, root: Path) -> None:
    for folder in (checkpoints, checkpoints.parent):
        if folder == root or root not in folder.parents:
            return
        try:
            folder.rmdir()  # only when empty
        except OSError:
            return


def clear_run(root: str | Path) -> int:
    """Remove a stale run (its sessions, demos, SAVE_NOW); returns how many checkpoints it held."""
    root = Path(root)
    count = len(list_checkpoints(root))
    if root.is_dir():
        for child in root.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    return count


@dataclass
class SaveRequests:
    """SIGUSR1 / SAVE_NOW (save after this step) and SIGINT / SIGTERM (save, then stop).

    Use as a context manager: the handlers are installed on entry (main thread only) and the
    previous ones restored on exit. A second SIGINT/SIGTERM while stopping raises
    KeyboardInterrupt (the user insists).
    """

    save_now_file: Path | None = None
    out: object = None
    save_requested: bool = False
    stop_signal: int | None = None
    _previous: dict = field(default_factory=dict)

    def __enter__(self) -> SaveRequests:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in (
                (signal.SIGINT, self._on_stop),
                (signal.SIGTERM, self._on_stop),
                (getattr(signal, "SIGUSR1", None), self._on_save),
            ):
                if sig is not None:
                    self._previous[sig] = signal.signal(sig, handler)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_save(self, signum, frame) -> None:
        self.save_requested = True
        emit(SAVE_REQUESTED, self.out)

    def _on_stop(self, signum, frame) -> None:
        if self.stop_signal is not None:
            raise KeyboardInterrupt
        self.stop_signal = signum
        name = signal.Signals(signum).name
        emit(f"\n[{name}] stopping: will save a checkpoint after the current step and exit", self.out)

    @property
    def stopping(self) -> bool:
        return self.stop_signal is not None

    def take_save(self) -> bool:
        """True once per request (signal or SAVE_NOW file, which is consumed)."""
        requested = self.save_requested
        self.save_requested = False
        if self.save_now_file is not None and self.save_now_file.exists():
            self.save_now_file.unlink(missing_ok=True)
            requested = True
        return requested
