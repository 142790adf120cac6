"""The resume state saved next to each checkpoint, the resume fingerprint, and bare-adapter offsets.

Next to `<label>-step=<S>-epoch=<E>.safetensors` (fp16, underfit's format, untouched) lie
`resume-<8-hex>.npz` (every array: the fp32 adapter tensors and the session's optimizer moments)
and `resume-<8-hex>.json` (step, epoch, sampler position, schedule / time-budget / guard
counters, the fingerprint, the npz's sha256). Neither name ends in `.safetensors` or holds
`step=`, so the dashboard's recursive checkpoint discovery never takes them for adapters. The
json is written last and is the commit mark: a state counts only when its json exists and the
npz it names has the recorded hash.

The fingerprint is a hash of everything a run's result depends on except its length
(`TrainConfig.fingerprint_dict()`, the model, the content of the input folders): a stage run
resumes only when it matches, else starts over (the stale-resume trap of a `persist` output).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from sa3mlx.runtime.errors import ArtifactError, UserError, display_path
from sa3mlx.runtime.io import atomic_path, save_json, sha256_file
from sa3mlx.runtime.layout import LORA_DIR
from sa3mlx.train.runs import checkpoint_epoch, checkpoint_step, clear_run, list_checkpoints

STATE_VERSION = 1
RESUME_PREFIX = "resume-"
ARRAY_TAG = "__array__"
KEEP_DIR = LORA_DIR  # where the refusal of a damaged state suggests moving its checkpoint


# ---- the state --------------------------------------------------------------------------------


@dataclass
class ResumeState:
    step: int  # global steps completed
    epoch: int  # the epoch written into the checkpoint's name and metadata
    fingerprint: str
    sampler: dict  # EpochSampler.state_dict()
    session: dict  # TrainingSession.state_dict(): optimizer moments, lr schedule, step counter
    adapter: dict[str, np.ndarray]  # checkpoint-name tensors in fp32 (the .safetensors holds fp16)
    loop: dict = field(default_factory=dict)  # elapsed seconds, guard counters, ...
    fingerprint_inputs: dict = field(default_factory=dict)  # what the fingerprint hashed (diagnostics)
    checkpoint: str = ""  # the adapter file this state belongs to


def resume_stem(checkpoint: str | Path) -> Path:
    """`<dir>/resume-<8-hex>`: the hex is of the checkpoint's file name, so each has its own."""
    checkpoint = Path(checkpoint)
    digest = hashlib.sha256(checkpoint.name.encode()).hexdigest()[:8]
    return checkpoint.parent / f"{RESUME_PREFIX}{digest}"


def resume_files(checkpoint: str | Path) -> list[Path]:
    stem = resume_stem(checkpoint)
    return [stem.with_suffix(".npz"), stem.with_suffix(".json")]


def save_resume(checkpoint: str | Path, state: ResumeState) -> Path:
    """Write the state next to its (already written) checkpoint: the npz, then the json."""
    npz_path, json_path = resume_files(checkpoint)
    session_tree, arrays = split_arrays(state.session, "session")
    arrays.update({f"adapter/{k}": np.asarray(v, np.float32) for k, v in state.adapter.items()})
    with atomic_path(npz_path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, **{k: arrays[k] for k in sorted(arrays)})
    record = asdict(state)
    record.update(
        version=STATE_VERSION,
        checkpoint=Path(checkpoint).name,
        session=session_tree,
        adapter=sorted(state.adapter),
        arrays=npz_path.name,
        arrays_sha256=sha256_file(npz_path),
    )
    save_json(json_path, record)
    return json_path


class ResumeError(UserError, ValueError):
    pass


class DamagedResumeError(ResumeError):
    """A resume state whose json (the commit mark) exists but cannot be used: damage, not a killed save."""


def load_resume(json_path: str | Path) -> ResumeState:
    json_path = Path(json_path)
    try:
        record = json.loads(json_path.read_text())
    except (OSError, ValueError) as e:
        raise DamagedResumeError(f"{json_path}: unreadable resume state ({e})") from None
    if not isinstance(record, dict):
        raise DamagedResumeError(f"{json_path}: unreadable resume state (not a JSON object)")
    if record.get("version") != STATE_VERSION:
        raise ResumeError(f"{json_path}: resume state version {record.get('version')}, expected {STATE_VERSION}")
    try:
        return _state_from_record(json_path, record)
    except DamagedResumeError:
        raise
    except (OSError, ValueError, KeyError, TypeError, EOFError, AttributeError) as e:
        raise DamagedResumeError(f"{json_path}: damaged resume state ({type(e).__name__}: {e})") from None


def _state_from_record(json_path: Path, record: dict) -> ResumeState:
    npz_path = json_path.parent / record["arrays"]
    if not npz_path.is_file() or sha256_file(npz_path) != record["arrays_sha256"]:
        raise DamagedResumeError(f"{json_path}: its arrays ({npz_path.name}) are missing or do not match their hash")
    with np.load(npz_path, allow_pickle=False) as f:
        arrays = {k: f[k] for k in f.files}
    adapter = {k: arrays[f"adapter/{k}"] for k in record["adapter"]}
    return ResumeState(
        step=int(record["step"]),
        epoch=int(record["epoch"]),
        fingerprint=record["fingerprint"],
        sampler=record["sampler"],
        session=join_arrays(record["session"], arrays),
        adapter=adapter,
        loop=record.get("loop", {}),
        fingerprint_inputs=record.get("fingerprint_inputs", {}),
        checkpoint=record["checkpoint"],
    )


def refuse_damaged(checkpoint: Path, error: DamagedResumeError) -> ArtifactError:
    """The one line for a damaged state: the checkpoint stays, and how to go on from it."""
    json_path = resume_files(checkpoint)[1]
    problem = str(error).removeprefix(f"{json_path}: ")
    return ArtifactError(
        json_path,
        f"{problem}; nothing was removed: its checkpoint {display_path(checkpoint)} is kept",
        f"to continue from it, move it out of the run (`mv {display_path(checkpoint)} {KEEP_DIR}/`) and set "
        f"`train.init_from: {KEEP_DIR}/{checkpoint.name}` (a fresh run counting from its step); or delete "
        f"{json_path.name} to resume from the state before it",
    )


def split_arrays(tree, prefix: str):
    """(JSON-able tree with `{"__array__": key}` placeholders, {key: array}) of a nested state."""
    arrays: dict[str, np.ndarray] = {}

    def walk(node, path: str):
        if isinstance(node, dict):
            return {str(k): walk(v, f"{path}/{k}") for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(node)]
        if isinstance(node, (np.ndarray, np.generic)) or type(node).__module__.startswith("mlx"):
            arrays[path] = np.array(node)
            return {ARRAY_TAG: path}
        return node

    return walk(tree, prefix), arrays


def join_arrays(tree, arrays: dict[str, np.ndarray]):
    if isinstance(tree, dict):
        if set(tree) == {ARRAY_TAG}:
            return arrays[tree[ARRAY_TAG]]
        return {k: join_arrays(v, arrays) for k, v in tree.items()}
    if isinstance(tree, list):
        return [join_arrays(v, arrays) for v in tree]
    return tree


# ---- which state to resume from ---------------------------------------------------------------


@dataclass
class ResumeChoice:
    state: ResumeState | None  # None: start over
    checkpoint: Path | None = None
    reason: str = ""  # why it starts over (empty for a fresh run dir or a resume)
    orphans: list[Path] = field(default_factory=list)  # newer checkpoints without a state


def find_resume(root: str | Path, fingerprint: str) -> ResumeChoice:
    """The newest checkpoint of the run whose resume state is intact, if its fingerprint matches.

    Checkpoints newer than it without a (complete) state are orphans of a killed save: the
    caller removes them, as their steps are trained again.
    """
    checkpoints = list_checkpoints(root)
    if not checkpoints:
        return ResumeChoice(None)
    orphans = []
    for checkpoint in reversed(checkpoints):
        json_path = resume_files(checkpoint)[1]
        if not json_path.is_file():
            orphans.append(checkpoint)
            continue
        try:
            state = load_resume(json_path)
        except DamagedResumeError as e:
            raise refuse_damaged(checkpoint, e) from None
        except ResumeError:  # an older state version: like a killed save, its steps are trained again
            orphans.append(checkpoint)
            continue
        if state.fingerprint != fingerprint:
            return ResumeChoice(None, checkpoint, "the inputs or settings changed since the run's last checkpoint")
        return ResumeChoice(state, checkpoint, orphans=orphans)
    return ResumeChoice(None, checkpoints[-1], "the run's checkpoints have no resume state")


# ---- the fingerprint --------------------------------------------------------------------------


def tree_digest(path: str | Path | None) -> str:
    """sha256 over (relative path, content sha256) of every file under `path` (or of the file),
    Python bytecode caches left out; "absent" when there is nothing there."""
    if path is None or not Path(path).exists():
        return "absent"
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    digest = hashlib.sha256()
    files = (p for p in path.rglob("*") if p.is_file() and not _is_bytecode(p.relative_to(path)))
    for file in sorted(files):
        digest.update(f"{file.relative_to(path).as_posix()}\0{sha256_file(file)}\n".encode())
    return digest.hexdigest()


def _is_bytecode(relative: Path) -> bool:
    """Python's caches change with file times, not content: never part of a digest."""
    return "__pycache__" in relative.parts or relative.suffix == ".pyc"


def fingerprint_inputs(config: dict, inputs: dict[str, str | Path | None]) -> dict:
    """What the fingerprint hashes: the settings and the digest of each input path."""
    return {"config": config, "inputs": {name: tree_digest(path) for name, path in sorted(inputs.items())}}


def fingerprint(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two fingerprint payloads (for the message)."""
    keys = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += changed_keys(a, b, f"{prefix}{key}.")
        elif a != b:
            keys.append(f"{prefix}{key}")
    return keys


# ---- resuming from a bare adapter (no resume state) -------------------------------------------


def bare_offsets(
    path: str | Path,
    metadata: dict,
    step_offset: int | None = None,
    epoch_offset: int | None = None,
    steps_per_epoch: int | None = None,
) -> tuple[int, int]:
    """underfit's offset ladder: explicit offsets (even 0) > the file's `lora_config` step/epoch >
    `step=`/`epoch=` in its name > (epoch only) step // steps_per_epoch. Like underfit, a
    metadata value of 0 falls through to the name."""
    step = step_offset
    if step is None:
        step = int(metadata.get("step") or 0) or checkpoint_step(path) or 0
    epoch = epoch_offset
    if epoch is None:
        epoch = int(metadata.get("epoch") or 0) or checkpoint_epoch(path) or 0
        if not epoch and step and steps_per_epoch:
            epoch = step // steps_per_epoch
    return int(step), int(epoch)


def prepare_run(
    root: str | Path, fingerprint_value: str, payload: dict | None = None
) -> tuple[ResumeChoice, list[str]]:
    """Decide how a stage run starts: resume the run's newest intact state when its fingerprint
    matches; otherwise clear the stale run (its checkpoints came from other inputs or settings).
    Orphan checkpoints newer than the resumed state are deleted. Returns the choice and the
    console lines that explain it."""
    choice = find_resume(root, fingerprint_value)
    if choice.state is not None:
        for orphan in choice.orphans:
            for path in [orphan, *resume_files(orphan)]:
                path.unlink(missing_ok=True)
        lines = [
            f"resume: continuing from {choice.checkpoint.name} (step {choice.state.step}; fingerprint "
            f"{fingerprint_value[:12]} matches)"
        ]
        return choice, lines
    if choice.checkpoint is None:
        return choice, []
    detail = ""
    if payload is not None and choice.reason.startswith("the inputs"):
        old = load_resume(resume_files(choice.checkpoint)[1]).fingerprint_inputs
        keys = changed_keys(old, payload) if old else []
        detail = f" ({', '.join(keys[:8])}{' …' if len(keys) > 8 else ''})" if keys else ""
    removed = clear_run(root)
    return choice, [
        f"resume: starting over: {choice.reason}{detail}; removed the stale run's "
        f"{removed} checkpoint{'s' if removed != 1 else ''} in {root}"
    ]
