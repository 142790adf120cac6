"""`index.html` of a demo folder: one card per entry, the baseline (strength 0) beside every
adapter step, each with its mel spectrogram and an audio player; built from the files present,
so it also shows in-training folders that hold many steps. The spectrograms sit in their own
folder (`spectrograms/`, PNG only) so that `dvc plots show` can list them as images.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path

from sa3mlx.runtime.io import atomic_path
from sa3mlx.sample.demo_entries import DemoEntry, parse_stem

SPECTROGRAM_DIR = "spectrograms"
INDEX_FILE = "index.html"

STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; background: #f4f4f6; color: #1d1d24; }
h1 { font-size: 22px; margin: 0 0 4px; }
.sub { color: #666; margin: 0 0 20px; font-size: 14px; }
.card { background: #fff; border-radius: 10px; padding: 16px 18px; margin: 0 0 18px;
        box-shadow: 0 1px 3px rgba(0,0,0,.12); }
.card h2 { font-size: 17px; margin: 0 0 6px; }
.tag { display: inline-block; font-size: 12px; font-weight: 600; padding: 2px 8px; border-radius: 10px;
       margin-right: 6px; vertical-align: 2px; }
.tag.base { background: #dbe8ff; color: #1a4aa8; } .tag.arc { background: #ffe3cc; color: #a14b00; }
.meta { color: #555; font-size: 13px; margin: 0 0 12px; }
.row { display: grid; grid-template-columns: repeat(auto-fit, minmax(280px, 1fr)); gap: 14px; }
.cell { border: 1px solid #e3e3ea; border-radius: 8px; padding: 10px; background: #fafafc; }
.cell.baseline { border-color: #c9c9d4; background: #f1f1f5; }
.cell h3 { font-size: 14px; margin: 0 0 8px; }
.cell img { width: 100%; height: 140px; object-fit: fill; display: block; border-radius: 4px; background: #000; }
.cell audio { width: 100%; margin-top: 8px; }
.note { background: #fff4e5; border: 1px solid #f0c890; border-radius: 8px; padding: 10px; font-size: 13px; }
"""


def _read_sidecars(out_dir: Path) -> dict[int, dict]:
    """{entry index: {step or None: sidecar record}} of the complete demos in out_dir."""
    found: dict[int, dict] = {}
    for path in sorted(out_dir.glob("*.json")):
        parsed = parse_stem(path.stem)
        if parsed is None or not path.with_suffix(".mp3").is_file():
            continue
        index, step = parsed
        try:
            found.setdefault(index, {})[step] = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
    return found


def _describe(entry: DemoEntry | None, record: dict) -> tuple[str, str, str]:
    """(family tag, prompt, meta line) of an entry, from the entry or else its first sidecar."""
    arc = entry.arc if entry else bool(record.get("arc"))
    prompt = entry.prompt if entry else record.get("prompt", "")
    parts = []
    seconds = entry.seconds if entry else record.get("seconds_total")
    if seconds is not None:
        parts.append(f"{seconds:g} s")
    steps = entry.steps if entry else record.get("steps")
    parts.append(f"{steps} {'ping-pong' if arc else 'Euler'} steps" if steps else ("ping-pong" if arc else "Euler"))
    cfg = entry.cfg if entry else record.get("cfg")
    if cfg is not None:
        parts.append(f"cfg {cfg:g}" + (" APG" if not arc and cfg != 1 and (entry is None or entry.apg) else ""))
    seed = entry.seed if entry else record.get("seed")
    parts.append(f"seed {seed}")
    if entry and entry.negative_prompt:
        parts.append(f"negative “{entry.negative_prompt}”")
    interval = entry.lora_interval_max if entry else record.get("lora_interval_max", record.get("lora_skip"))
    if interval is not None and not arc:
        parts.append(f"adapter on for σ ≤ {interval:g}")
    return ("arc" if arc else "base"), prompt, " · ".join(parts)


def _strength_label(record: dict) -> str:
    if "adapters" in record:
        return ", ".join(f"{Path(a['path']).stem} × {a['strength']:g}" for a in record["adapters"])
    strength = record.get("arc_lora_strength", record.get("lora_strength", 1.0))
    return f"strength {strength:g}"


def _cell(stem: str, title: str, baseline: bool) -> str:
    name = html.escape(stem)
    return (
        f'<div class="cell{" baseline" if baseline else ""}"><h3>{html.escape(title)}</h3>'
        f'<img src="{SPECTROGRAM_DIR}/{name}.png" alt="mel spectrogram of {name}">'
        f'<audio controls preload="metadata" src="{name}.mp3"></audio></div>'
    )


def _card(index: int, entry: DemoEntry | None, demos: dict, note: str | None) -> str:
    first = next(iter(demos.values()), {})
    family, prompt, meta = _describe(entry, first)
    label = html.escape(prompt) if prompt else "<i>(no prompt: unconditional)</i>"
    cells = []
    if None in demos:
        cells.append(_cell(f"baseline_{index}", "baseline · strength 0", True))
    for step in sorted(s for s in demos if s is not None):
        title = f"step {step} · {_strength_label(demos[step])}"
        cells.append(_cell(f"demo_{index}_{step:08d}", title, step == 0 and None not in demos))
    body = f'<div class="row">{"".join(cells)}</div>' if cells else ""
    warning = f'<div class="note">{html.escape(note)}</div>' if note else ""
    return (
        f'<section class="card"><h2><span class="tag {family}">{family.upper()}</span>'
        f'#{index} {label}</h2><p class="meta">{html.escape(meta)}</p>{warning}{body}</section>'
    )


def render_index(
    out_dir: Path, entries: Sequence[DemoEntry] = (), notes: dict[int, str] | None = None, adapters: Sequence[str] = ()
) -> str:
    found, notes = _read_sidecars(out_dir), notes or {}
    names = f"Adapter: {', '.join(adapters)}. " if adapters else ""
    indices = sorted(set(found) | set(range(len(entries))) | set(notes))
    cards = [_card(i, entries[i] if i < len(entries) else None, found.get(i, {}), notes.get(i)) for i in indices]
    count = sum(len(v) for v in found.values())
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>sa3mlx demos</title><style>{STYLE}</style></head><body>"
        "<h1>Adapter demos</h1>"
        f'<p class="sub">{html.escape(names)}{len(indices)} prompts, {count} renders. Baseline = the '
        "same model, seed and settings with the adapter at strength 0. Spectrograms: time left to right, "
        "mel frequency bottom to top, 80 dB range.</p>" + "".join(cards) + "</body></html>\n"
    )


def write_index(
    out_dir: str | Path,
    entries: Sequence[DemoEntry] = (),
    notes: dict[int, str] | None = None,
    adapters: Sequence[str] = (),
) -> Path:
    """Write out_dir/index.html atomically from the demos present (`adapters`: names for the header)."""
    out_dir = Path(out_dir)
    path = out_dir / INDEX_FILE
    with atomic_path(path) as tmp:
        tmp.write_text(render_index(out_dir, entries, notes, adapters), encoding="utf-8")
    return path
