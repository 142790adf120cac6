"""The census of a normalised dataset: `report.json` and its readable summary."""

from __future__ import annotations

from collections import Counter

from sa3mlx.audio import reasons

DURATION_BINS = (
    (10, "<10s"),
    (30, "10-30s"),
    (60, "30-60s"),
    (300, "1-5min"),
    (600, "5-10min"),
    (float("inf"), ">=10min"),
)


def duration_bin(seconds: float) -> str:
    return next(label for edge, label in DURATION_BINS if seconds < edge)


def build_report(
    settings: dict,
    inputs: int,
    decoded: list[dict],
    quarantined: list[dict],
    duplicates: list[dict],
    ignored: list[dict],
) -> dict:
    """`decoded`: one record per decoded input (kept or duplicate), in input order.

    Formats, rates, channels and the duration histogram describe every decoded input
    (the source files); totals describe the kept outputs.
    """
    kept = [r for r in decoded if "duplicate_of" not in r]
    seconds = sum(r["seconds"] for r in kept)
    bins = Counter(duration_bin(r["source_seconds"]) for r in decoded)
    return {
        "settings": settings,
        "counts": {
            "audio_files": inputs,
            "decoded": len(decoded),
            "kept": len(kept),
            "duplicates": len(duplicates),
            "quarantined": len(quarantined),
            "silent": sum(r["silent"] for r in kept),
            "capped": sum(r["capped"] for r in kept),
            "ignored": len(ignored),
        },
        "formats": _counts(r["format"] for r in decoded),
        "encodings": _counts(f"{r['format']} {r['subtype']}" for r in decoded),
        "sample_rates": _counts((r["sample_rate"] for r in decoded), numeric=True),
        "channels": _counts((r["channels"] for r in decoded), numeric=True),
        "durations": {label: bins[label] for _, label in DURATION_BINS if bins[label]},
        "seconds_total": round(seconds, 3),
        "hours_total": round(seconds / 3600, 4),
        "duplicates": duplicates,
        "silent": [r["output"] for r in kept if r["silent"]],
        "capped": [r["output"] for r in kept if r["capped"]],
        "quarantined": sorted(quarantined, key=lambda q: q["path"]),
        "reasons": _counts(q["reason"] for q in quarantined),
        "ignored": ignored,
        "files": kept,
    }


def summary(report: dict, raw: str, out: str) -> str:
    """A few aligned lines for stdout (and the README example)."""
    c, s = report["counts"], report["settings"]
    kinds = {"wav": "float32 WAV", "flac": "24-bit FLAC"}
    lines = [
        f"normalize: {c['audio_files']} audio files in {raw} -> {c['kept']} kept in {out} "
        f"({s['sample_rate']} Hz stereo {kinds.get(s['format'], s['format'])})"
    ]

    def row(name: str, text: str) -> None:
        lines.append(f"  {name:<13}{text}")

    def joined(counts: dict, unit: str = "") -> str:
        return ", ".join(f"{k}{unit} {v}" for k, v in counts.items()) or "-"

    row("formats", joined(report["formats"]))
    row("sample rates", joined(report["sample_rates"], " Hz"))
    row("channels", ", ".join(f"{_channel_word(k)} {v}" for k, v in report["channels"].items()) or "-")
    row("durations", joined(report["durations"]))
    row(
        "kept",
        f"{c['kept']} files, {report['seconds_total']:.1f} s ({report['hours_total']:.3f} h); "
        f"{c['silent']} silent, {c['capped']} capped at {s['max_seconds']:g} s",
    )
    for d in report["duplicates"]:
        row("duplicate", f"{d['removed']} = {d['kept']} (removed, same PCM)")
    for name in report["silent"]:
        row("silent", f"{name} (kept)")
    row("quarantined", str(c["quarantined"]))
    for q in report["quarantined"]:
        lines.append(f"    {q['path']}: {q['reason']} - {q['detail']}")
    if report["reasons"].get(reasons.NON_UTF8_NAME):
        lines.append("  note: paths that are not valid UTF-8 make DVC fail before any stage runs; rename them")
    if c["ignored"]:
        row("ignored", f"{c['ignored']} non-audio files (listed in report.json)")
    return "\n".join(lines)


def _counts(values, numeric: bool = False) -> dict[str, int]:
    """Counts keyed by str(value), in sorted (numeric when asked) order."""
    return {str(k): v for k, v in sorted(Counter(values).items(), key=lambda kv: kv[0] if numeric else str(kv[0]))}


def _channel_word(count: str) -> str:
    return {"1": "mono", "2": "stereo"}.get(count, f"{count}-channel")
