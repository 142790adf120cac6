"""Data-parallel training on `mx.distributed`: one run over several processes (ranks), started by
`mlx.launch`, with mlx-lm's semantics.

    settings = DistributedSettings.from_params(params["train"]["distributed"])
    sys.exit(relaunch(settings, [sys.executable, "stages/train.py"]))   # the stage, when ranks > 1
    world = World.current(settings)      # inside each rank: rank, size, group (size 1 when not launched)

- `batch_size` is the global batch. Every rank walks the same sampler (same seed, same order) and
  replays the host random draws of the whole batch, then takes its blocks of the batch's
  ranks x grad_accum micro-batches (`TrainingSession.micro_batches`, `share`): together the ranks
  compute exactly the samples, noise and timesteps of the 1-rank run.
- The loss and gradients are averaged across ranks once per optimizer step, after gradient
  accumulation and before clipping (`StepCore.reduce` = `World.average`): each rank's sums in one
  `all_sum` of one flat buffer (inside the compiled step without accumulation), then one division
  by ranks x grad_accum. So W ranks compute bit for bit what 1 rank with grad_accum W does when the
  ring's sum of W values is the 1-rank running sum (W = 2: a + b; tested).
- Decisions that depend on one process (SAVE_NOW / signals, the time budget's clock, the WSD
  plan) are agreed once per step with one small `all_sum`; rank 0's clock counts.
- Rank 0 alone writes outputs; the others keep a scratch run folder outside the workspace (removed
  at exit) and print nothing to stdout. The start state (fresh, resumed or `init_from`) is rank 0's,
  sent to every rank, so only rank 0's host needs `runs/<name>/`.
- At each checkpoint every rank's adapter + optimizer + data-position digest is gathered; a
  mismatch stops all ranks with `EXIT_MISMATCH`. A lost peer (the ring reports a closed socket)
  stops with `EXIT_PEER_LOST`; a stall longer than `timeout` (a hung collective) with
  `EXIT_TIMEOUT`, from a watchdog thread.
- A resume state records its world size; resuming at another size continues from the same data
  position and global batch (only the reduction order differs: not bit-exact) and says so.
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from sa3mlx.train import progress as P
from sa3mlx.train.loop import LoopSettings, TrainingLoop
from sa3mlx.train.resume import ResumeState, load_resume, resume_files, save_resume
from sa3mlx.train.runs import RunPaths
from sa3mlx.train.step import keep_local

BACKENDS = ("ring", "mpi", "nccl", "jaccl", "jaccl-ring")
RANKS_ENV = "SA3MLX_RANKS"  # set by `relaunch` for every rank: the world size it expects
EXIT_MISMATCH, EXIT_PEER_LOST, EXIT_TIMEOUT = 5, 6, 7
EXIT_RE = re.compile(r"Node with rank (\d+) (?:exited with code (-?\d+)|was killed)")
SETTING_KEYS = ("ranks", "backend", "hostfile", "timeout", "port")


class RankMismatch(RuntimeError):
    pass


@dataclass(frozen=True)
class DistributedSettings:
    ranks: int = 1
    backend: str = "ring"
    hostfile: str | None = None  # mlx.launch's JSON hostfile (several hosts); None: `ranks` local processes
    timeout: float = 600.0  # seconds without progress (a step, a save, a demo render) before a rank gives up
    port: int | None = None  # ring: first port; None: a free local port (local) or mlx.launch's 32323

    @classmethod
    def from_params(cls, params: dict | None) -> DistributedSettings:
        params = dict(params or {})
        unknown = sorted(set(params) - set(SETTING_KEYS))
        if unknown:
            raise ValueError(f"train.distributed: unknown keys {unknown}; known: {list(SETTING_KEYS)}")
        settings = cls(**{k: v for k, v in params.items() if v is not None or k in ("hostfile", "port")})
        if not isinstance(settings.ranks, int) or settings.ranks < 1:
            raise ValueError(f"train.distributed.ranks must be a whole number >= 1, got {settings.ranks!r}")
        if settings.backend not in BACKENDS:
            raise ValueError(f"train.distributed.backend {settings.backend!r}: one of {list(BACKENDS)}")
        if not settings.timeout or settings.timeout <= 0:
            raise ValueError(f"train.distributed.timeout must be > 0 seconds, got {settings.timeout!r}")
        return settings

    def check_batch(self, batch_size: int, grad_accum: int, last_batch: int | None = None) -> None:
        """The global batch (and a short last batch of an epoch) must split into equal rank shares."""
        parts = self.ranks * max(int(grad_accum), 1)
        if self.ranks == 1:
            return
        if batch_size % parts:
            raise ValueError(
                f"train.batch_size {batch_size} does not split over {self.ranks} ranks x grad_accum {grad_accum}: "
                f"use a multiple of {parts} (batch_size is the global batch, as in mlx-lm)"
            )
        if last_batch and last_batch % parts:
            raise ValueError(
                f"each epoch ends with a short batch of {last_batch}, which does not split over {self.ranks} ranks "
                f"x grad_accum {grad_accum}: set train.drop_last: true or use a batch_size that divides the data"
            )


# ---- launching --------------------------------------------------------------------------------------


def launched() -> bool:
    """True inside a rank started by `relaunch`."""
    return RANKS_ENV in os.environ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hostfile_ranks(path: str | Path) -> int:
    """How many ranks an mlx.launch hostfile starts (one per host entry)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"train.distributed.hostfile {path}: unreadable ({e})") from None
    hosts = data.get("hosts") if isinstance(data, dict) else data
    if not isinstance(hosts, list) or not hosts:
        raise ValueError(f"train.distributed.hostfile {path}: no host list (mlx.launch's JSON format)")
    return len(hosts)


def launch_command(settings: DistributedSettings, command: list[str]) -> list[str]:
    """`mlx.launch` running `command` (an interpreter and its arguments) on every rank."""
    python, *script = command
    launcher = [python, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"]
    args = ["--backend", settings.backend, "--python", python, "--env", f"{RANKS_ENV}={settings.ranks}"]
    if settings.hostfile:
        if hostfile_ranks(settings.hostfile) != settings.ranks:
            raise ValueError(
                f"train.distributed.hostfile {settings.hostfile} lists {hostfile_ranks(settings.hostfile)} hosts "
                f"but train.distributed.ranks is {settings.ranks}: make them agree"
            )
        args += ["--hostfile", str(settings.hostfile), "--cwd", os.getcwd()]
    else:
        args += ["--hosts", "127.0.0.1", "-n", str(settings.ranks)]
    port = settings.port if settings.port is not None else (None if settings.hostfile else free_port())
    if port is not None:
        args += ["--starting-port", str(port)]
    return [*launcher, *args, "--", *script]


def relaunch(settings: DistributedSettings, command: list[str], err=None) -> int:
    """Run `command` on every rank through mlx.launch; rank 0's stdout passes through. Returns the
    run's exit code (`run_exit_code` of mlx.launch's per-rank reports on stderr: mlx.launch itself
    exits 0 whatever its ranks did)."""
    err = err or sys.stderr
    cmd = launch_command(settings, command)
    print(f"train: {settings.ranks} ranks via mlx.launch ({settings.backend})", flush=True)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every rank: they save and stop
    reports: list[tuple[int, int | None]] = []
    try:
        with subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace") as p:
            for line in p.stderr:
                err.write(line)
                err.flush()
                match = EXIT_RE.search(line)
                if match:
                    reports.append((int(match.group(1)), None if match.group(2) is None else int(match.group(2))))
    finally:
        signal.signal(signal.SIGINT, previous)
    return p.returncode or run_exit_code(reports)


def run_exit_code(reports: list[tuple[int, int | None]]) -> int:
    """The run's exit code from mlx.launch's (rank, exit code) reports in the order it made them
    (None: "was killed", by mlx.launch's SIGTERM; a negative code: ended by that signal, counted as
    128 + signal). Once one rank fails, mlx.launch sends SIGTERM to the ranks still running, so a
    SIGTERM exit or a kill reported after a failure is its consequence, not a cause. Of the causes,
    rank 0's code counts if it failed, else the first one's."""
    causes: dict[int, int] = {}
    for rank, code in reports:
        status = 128 + signal.SIGTERM if code is None else (128 - code if code < 0 else code)
        if status and not (causes and status == 128 + signal.SIGTERM):
            causes.setdefault(rank, status)
    return causes.get(0) or next(iter(causes.values()), 0)


# ---- the world --------------------------------------------------------------------------------------


class World:
    """This process's place in the run: rank, size and the `mx.distributed` group."""

    def __init__(self, rank: int = 0, size: int = 1, group=None, timeout: float = 600.0):
        self.rank, self.size, self.group = rank, size, group
        self.watchdog = Watchdog(timeout, f"rank {rank}")

    @classmethod
    def current(cls, settings: DistributedSettings) -> World:
        """One process unless started by `relaunch`; then the group of `settings.ranks`."""
        if not launched():
            return cls(timeout=settings.timeout)
        expected = int(os.environ[RANKS_ENV])
        group = mx.distributed.init(strict=True, backend=settings.backend)
        if group.size() != expected:
            raise RuntimeError(f"mx.distributed started {group.size()} ranks, expected {expected}")
        return cls(group.rank(), group.size(), group, settings.timeout)

    @property
    def writer(self) -> bool:
        return self.rank == 0

    def average(self, loss: mx.array, grads: dict, count: int) -> tuple[mx.array, dict]:
        """The mean loss and gradients over every rank's `count` micro-batches, from each rank's sums:
        one all_sum of one flat buffer (one round of messages per step, and no reliance on several
        collectives of one compiled graph being scheduled in the same order on every rank), then one
        division by ranks x count, as a 1-rank run with that many micro-batches divides its sum."""
        if self.size == 1:
            return keep_local(loss, grads, count)
        keys = list(grads)
        parts = [loss.astype(mx.float32).reshape(1)] + [grads[k].reshape(-1) for k in keys]
        total = mx.distributed.all_sum(mx.concatenate(parts), group=self.group) / (self.size * count)
        ends = np.cumsum([p.size for p in parts]).tolist()
        pieces = [total[start:end] for start, end in zip([0, *ends[:-1]], ends)]
        averaged = {k: piece.reshape(grads[k].shape).astype(grads[k].dtype) for k, piece in zip(keys, pieces[1:])}
        return pieces[0].reshape(loss.shape).astype(loss.dtype), averaged

    def sum(self, values) -> np.ndarray:
        """An elementwise float32 sum of small host vectors across the ranks."""
        array = np.asarray(values, np.float32)
        if self.size == 1:
            return array
        total = mx.distributed.all_sum(mx.array(array), group=self.group)
        return np.array(self._wait(total, "an all_sum of the step's flags"))

    def from_writer(self, values) -> np.ndarray:
        """Rank 0's float32 vector on every rank."""
        values = np.asarray(values, np.float32)
        return self.sum(values if self.writer else np.zeros_like(values))

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's bytes on every rank (an all_sum where the others add zeros)."""
        if self.size == 1:
            return data or b""
        length = int(self.from_writer([len(data) if self.writer else 0])[0])
        buffer = np.frombuffer(data, np.uint8) if self.writer else np.zeros(length, np.uint8)
        total = mx.distributed.all_sum(mx.array(buffer), group=self.group)
        return np.array(self._wait(total, "sending the start state")).tobytes()

    def check_same(self, digest: bytes, what: str) -> None:
        """Every rank's digest must equal rank 0's; raises RankMismatch on every rank otherwise."""
        if self.size == 1:
            return
        words = np.frombuffer(digest[:16], np.int32)
        gathered = np.array(self._wait(mx.distributed.all_gather(mx.array(words), group=self.group), what))
        rows = gathered.reshape(self.size, -1)
        differ = [r for r in range(1, self.size) if not np.array_equal(rows[r], rows[0])]
        if differ:
            raise RankMismatch(
                f"train: ranks disagree at {what}: the adapter/optimizer/data state of rank(s) {differ} differs from "
                "rank 0's; the run stops. Every rank must run the same code and MLX build on the same data: check "
                "the hosts, then `dvc repro train` resumes from the last checkpoint"
            )

    def _wait(self, array: mx.array, what: str) -> mx.array:
        with self.watchdog.guard(what):
            mx.eval(array)
        return array


class Watchdog:
    """Ends the process (`EXIT_TIMEOUT`) when a guarded phase lasts more than `timeout` seconds: a
    collective that never returns (e.g. a ring deadlock, a frozen host) must not hang the run."""

    def __init__(self, timeout: float, label: str):
        self.timeout, self.label = float(timeout), label
        self._deadline: float | None = None
        self._what = ""
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def arm(self, what: str) -> None:
        with self._lock:
            self._deadline, self._what = time.monotonic() + self.timeout, what
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="sa3mlx-watchdog", daemon=True)
            self._thread.start()

    def disarm(self) -> None:
        with self._lock:
            self._deadline = None

    @contextlib.contextmanager
    def guard(self, what: str):
        self.arm(what)
        try:
            yield
        finally:
            self.disarm()

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            with self._lock:
                late = self._deadline is not None and time.monotonic() > self._deadline
                what = self._what
            if late:
                print(
                    f"train: {self.label}: no progress for {self.timeout:g} s in {what} (a lost or hung peer); "
                    f"stopping (exit {EXIT_TIMEOUT}). `dvc repro train` resumes from the last checkpoint; raise "
                    "train.distributed.timeout if a step, save or demo render legitimately takes longer",
                    file=sys.stderr,
                    flush=True,
                )
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)  # where it hung
                os._exit(EXIT_TIMEOUT)


# ---- the loop ---------------------------------------------------------------------------------------


def state_digest(loop: TrainingLoop) -> bytes:
    """sha256 of what every rank must hold identically: adapters, optimizer state, counters, data position."""
    h = hashlib.sha256()
    state = loop.resume_state(loop.epoch)
    for key in sorted(state.adapter):
        h.update(key.encode() + np.ascontiguousarray(state.adapter[key]).tobytes())
    _digest_tree(h, state.session)
    h.update(json.dumps([state.step, state.sampler], sort_keys=True).encode())
    return h.digest()


def _digest_tree(h, node) -> None:
    if isinstance(node, dict):
        for key in sorted(node):
            h.update(str(key).encode())
            _digest_tree(h, node[key])
    elif isinstance(node, (list, tuple)):
        for value in node:
            _digest_tree(h, value)
    elif isinstance(node, (np.ndarray, mx.array)):
        h.update(np.ascontiguousarray(np.array(node)).tobytes())
    else:
        h.update(repr(node).encode())


class AgreedRequests:
    """The save/stop requests of all ranks for this step, as the loop reads SaveRequests."""

    def __init__(self, save: bool, stop: bool):
        self._save, self.stopping = save, stop

    def take_save(self) -> bool:
        save, self._save = self._save, False
        return save


class DataParallelLoop(TrainingLoop):
    """The training loop on one rank: agreed decisions, rank-0-only writes, checked consistency."""

    def __init__(self, world: World, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.world = world
        self._step_seconds = 0.0
        # the time budget counts rank 0's clock, agreed after each step; a WSD plan uses rank 0's timing
        self._budget_add, freeze = self.budget.add, getattr(self.budget, "freeze", None)
        self.budget.add = self._hold_seconds
        if freeze is not None:
            self.budget.freeze = lambda seconds, steps_done: freeze(float(world.from_writer([seconds])[0]), steps_done)

    def run(self):
        try:
            with self.world.watchdog.guard("the first step (compile)"):
                return super().run()
        except RankMismatch:
            raise
        except RuntimeError as e:  # the ring reports a closed socket as "connection to a peer was lost"
            raise PeerLost(f"train: rank {self.world.rank}: {e}; the run stops") from e

    def _hold_seconds(self, seconds: float) -> None:
        self._step_seconds = seconds  # counted in _after_step, once the ranks agree on rank 0's

    def _after_step(self, finite, result, seconds, epoch, requests):
        local = [float(requests.take_save()), float(requests.stopping), self._step_seconds]
        save, stop, rank0_seconds = self.world.sum(local if self.world.writer else [*local[:2], 0.0])
        if stop and requests.stop_signal is None:
            requests.stop_signal = signal.SIGTERM  # another rank was stopped
        self._budget_add(float(rank0_seconds))
        self.world.watchdog.arm(f"step {self.global_step + 1}")
        return super()._after_step(finite, result, seconds, epoch, AgreedRequests(bool(save), bool(stop)))

    def save_checkpoint(self, epoch: int, final: bool = False) -> Path:
        if self._saved_step == self.global_step and self.last_checkpoint is not None and not final:
            return self.last_checkpoint
        self.world.check_same(state_digest(self), f"the checkpoint of step {self.global_step}")
        self.world.watchdog.arm(f"the save of step {self.global_step}")
        if self.world.writer:
            return super().save_checkpoint(epoch, final)
        self.last_checkpoint = self.run_paths.checkpoint_path(self.global_step, epoch)
        self._saved_step = self.global_step
        return self.last_checkpoint

    def resume_state(self, epoch: int) -> ResumeState:
        state = super().resume_state(epoch)
        state.loop["world_size"] = self.world.size
        return state


class PeerLost(RuntimeError):
    pass


# ---- a rank's run -----------------------------------------------------------------------------------


def make_loop(world: World, session, loader, *args, **kwargs) -> TrainingLoop:
    """The loop of this process: the plain one alone, else the data-parallel one with the session's
    share of each batch and its gradient average set."""
    if world.size == 1:
        return TrainingLoop(session, loader, *args, **kwargs)
    sampler, cfg = loader.sampler, session.cfg
    short = 0 if sampler.drop_last else sampler.samples_per_epoch % sampler.batch_size
    DistributedSettings(ranks=world.size).check_batch(sampler.batch_size, cfg.grad_accum, short)
    session.share = (world.rank, world.size)
    session.core.reduce = world.average
    return DataParallelLoop(world, session, loader, *args, **kwargs)


def sync_start(world: World, loop: TrainingLoop, saved_world: int | None = None, say=print) -> None:
    """Every rank starts from rank 0's state (fresh, resumed or `init_from`), checked; a state
    saved at another world size is continued, and said to be so."""
    if saved_world is not None and saved_world != world.size:
        say(
            f"resume: the state was saved by {saved_world} rank(s), this run has {world.size}: same data position "
            "and global batch, other reduction order, so the continuation is not bit-exact with an uninterrupted "
            f"{saved_world}-rank run"
        )
    if world.size == 1:
        return
    with tempfile.TemporaryDirectory(prefix=f"sa3mlx-rank{world.rank}-") as tmp:
        anchor = Path(tmp) / "start.safetensors"
        if world.writer:
            state = loop.resume_state(loop.epoch)
            state.loop["start"] = {"saved_step": loop._saved_step, "resumed_from": loop.resumed_from}
            save_resume(anchor, state)
        files = resume_files(anchor)
        blobs = [world.broadcast_bytes(path.read_bytes() if world.writer else None) for path in files]
        if not world.writer:
            for path, blob in zip(files, blobs):
                path.write_bytes(blob)
            state = load_resume(files[1])
            loop.restore(state)
            start = state.loop["start"]
            loop._saved_step, loop.resumed_from, loop.last_checkpoint = start["saved_step"], start["resumed_from"], None
    world.check_same(state_digest(loop), "the start")


def run_follower(job, world: World) -> int:
    """A rank other than 0: the same run on rank 0's start state, writing nothing into the workspace."""
    session, loader = job.build()
    with tempfile.TemporaryDirectory(prefix=f"sa3mlx-rank{world.rank}-") as scratch, open(os.devnull, "w") as out:
        run = RunPaths.create(scratch, job.name, "00000000")
        loop = make_loop(world, session, loader, run, LoopSettings.from_config(job.cfg), console=P.Console(out))
        sync_start(world, loop)
        loop.run()
    # rank 0 reports the run's status (interrupted 130, non-finite 3): a follower exiting non-zero
    # first would make mlx.launch terminate rank 0 while it still saves
    return 0


def run_rank(job, world: World, console) -> int:
    """This rank's part of the stage run; a mismatch or a lost peer ends it with a message."""
    try:
        return job.train(console, world) if world.writer else run_follower(job, world)
    except RankMismatch as e:
        print(e, file=sys.stderr, flush=True)
        return EXIT_MISMATCH
    except PeerLost as e:
        print(f"{e}. `dvc repro train` resumes from the last checkpoint", file=sys.stderr, flush=True)
        return EXIT_PEER_LOST
