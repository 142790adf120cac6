"""Output names: each input keeps its relative path with the output extension.

Collisions are resolved deterministically, independent of which inputs later turn out to
be broken or duplicates:
- inputs whose paths differ only by extension (or by letter case, which collides on macOS
  and Windows), e.g. `a.wav` and `a.flac`, all get their source extension appended to the
  stem: `a-wav`, `a-flac`;
- `report` at the root becomes `report-<ext>` (the census is `report.json`);
- anything still taken gets `-2`, `-3`, … in sorted order of the inputs.
"""

from __future__ import annotations

from collections import Counter
from pathlib import PurePosixPath

RESERVED_STEMS = ("report",)


def output_stems(relpaths: list[str]) -> dict[str, str]:
    """{input relpath: output relpath without extension}."""
    bases = {rel: str(PurePosixPath(rel).with_suffix("")) for rel in relpaths}
    counts = Counter(base.casefold() for base in bases.values())
    taken = {name.casefold() for name in RESERVED_STEMS}
    stems = {}
    for rel in sorted(relpaths):
        base = bases[rel]
        if counts[base.casefold()] > 1 or base.casefold() in taken:
            base = f"{base}-{PurePosixPath(rel).suffix[1:].lower()}"
        name, n = base, 2
        while name.casefold() in taken:
            name, n = f"{base}-{n}", n + 1
        taken.add(name.casefold())
        stems[rel] = name
    return stems
