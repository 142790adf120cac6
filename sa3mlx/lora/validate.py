"""underfit's upload contract for adapter files (`sa3mlx lora validate FILE`).

Reads the safetensors header only (never the tensors), in underfit's order of checks, and
returns a JSON-able report: `ok`, `path`, and either `rank`, `alpha`, `adapter_type`,
`fingerprint`, `config`, `layers` (valid file) or `reason` + `error` (one code per failure).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from sa3mlx.convert.checkpoint import CheckpointError, read_safetensors_header
from sa3mlx.lora.checkpoint import METADATA_KEY
from sa3mlx.lora.types import ADAPTER_TYPES, ALIASES, LEGACY_DORA

# underfit's key test (U and V count here even though checkpoints never hold them)
ADAPTER_KEY_RE = re.compile(
    r"\.parametrizations\.weight\.\d+\.(lora_A|lora_B|magnitude|magnitude_r|magnitude_c|M_xs|U|V)$"
)
REASONS = {
    "not_found": "file not found",
    "not_safetensors": "not a .safetensors file (.ckpt/.pt/.bin files are pickles and are refused)",
    "unreadable": "not a readable safetensors file",
    "no_adapter_keys": "no LoRA keys found ('<layer>.parametrizations.weight.<i>.lora_A' etc.): "
    "this might be a base-model checkpoint or a VAE",
    "no_lora_config": "no 'lora_config' entry in the safetensors metadata",
    "config_not_json": "the 'lora_config' metadata is not valid JSON",
    "config_not_object": "the 'lora_config' metadata is JSON but not an object",
    "missing_rank": "the 'lora_config' metadata has no 'rank'",
    "missing_adapter_type": "the 'lora_config' metadata has no 'adapter_type'",
}


def fingerprint(keys) -> str | None:
    """underfit's type hint from key suffixes (first match wins; only a hint)."""
    params = {k.rsplit(".", 1)[-1] for k in keys}
    magnitudes = {"magnitude", "magnitude_r", "magnitude_c"} & params
    if "M_xs" in params and not magnitudes:
        return "lora-xs"
    if {"magnitude_r", "magnitude_c"} <= params:
        return "bora"
    if "magnitude" in params:
        return "dora-rows"
    if {"lora_A", "lora_B"} <= params:
        return "lora"
    return None


def validate(path: str | Path) -> dict:
    """The report for one file; `ok` False carries a `reason` code from REASONS and an `error`."""
    path = Path(path)
    report: dict = {"ok": False, "path": str(path), "partial": {}}

    def fail(reason: str, detail: str = "") -> dict:
        report.update(reason=reason, error=REASONS[reason] + (f": {detail}" if detail else ""))
        return report

    if not path.is_file():
        return fail("not_found", str(path))
    if path.suffix.lower() != ".safetensors":
        return fail("not_safetensors", path.suffix or "(no suffix)")
    try:
        entries, metadata, _ = read_safetensors_header(path)
    except (OSError, CheckpointError) as e:
        return fail("unreadable", str(e))
    adapter_keys = [k for k in entries if ADAPTER_KEY_RE.search(k)]
    report["partial"] = {
        "num_keys": len(entries),
        "sample_keys": list(entries)[:8],
        "metadata_keys": list(metadata),
        "inferred_adapter_type": fingerprint(adapter_keys),
    }
    if not adapter_keys:
        return fail("no_adapter_keys")
    if METADATA_KEY not in metadata:
        return fail("no_lora_config", f"inferred type {report['partial']['inferred_adapter_type']}")
    try:
        config = json.loads(metadata[METADATA_KEY])
    except json.JSONDecodeError as e:
        return fail("config_not_json", str(e))
    if not isinstance(config, dict):
        return fail("config_not_object", f"got {type(config).__name__}")
    for field, reason in (("rank", "missing_rank"), ("adapter_type", "missing_adapter_type")):
        if field not in config:
            return fail(reason)
    return _accept(report, config, entries, adapter_keys)


def _accept(report: dict, config: dict, entries: dict, adapter_keys: list[str]) -> dict:
    """Back-fill only absent alpha/include/exclude (as underfit: lists), list the A/B layers."""
    config = {**config}
    config.setdefault("alpha", config["rank"])
    config.setdefault("include", [])
    config.setdefault("exclude", [])
    rank = config["rank"]
    if not isinstance(rank, (int, float)) or rank <= 0:
        cores = [k for k in sorted(adapter_keys) if k.endswith(("lora_A", "M_xs"))]
        rank = entries[cores[0]]["shape"][0] if cores else rank
    layers = []
    for key in sorted(adapter_keys):
        if key.endswith(".lora_A"):
            name = key[: -len(".lora_A")]
            b = entries.get(name + ".lora_B")
            if b is not None:
                layers.append(
                    {
                        "name": name.rsplit(".parametrizations.", 1)[0],
                        "fan_in": entries[key]["shape"][1],
                        "fan_out": b["shape"][0],
                    }
                )
    known = config["adapter_type"] in ADAPTER_TYPES + (LEGACY_DORA,) + tuple(ALIASES)
    report.update(
        ok=True,
        config=config,
        rank=rank,
        alpha=config["alpha"],
        adapter_type=config["adapter_type"],
        fingerprint=report["partial"]["inferred_adapter_type"],
        num_layers=len({k.rsplit(".parametrizations.", 1)[0] for k in adapter_keys}),
        layers=layers,
    )
    notes = []
    if report["fingerprint"] and report["fingerprint"] != config["adapter_type"]:
        notes.append(
            f"key fingerprint says {report['fingerprint']}, metadata says {config['adapter_type']} "
            "(metadata wins; the fingerprint cannot tell dora-cols or -xs variants apart)"
        )
    if not known:
        notes.append(f"adapter_type '{config['adapter_type']}' is not one the SA3 loaders know")
    if notes:
        report["notes"] = notes
    return report


def main(argv: list[str] | None = None) -> int:
    """`sa3mlx lora validate FILE`: the JSON report on stdout; exit 0 if valid, else 1 with the reason."""
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) != 1:
        print("usage: sa3mlx lora validate FILE", file=sys.stderr)
        return 2
    report = validate(args[0])
    print(json.dumps(report, indent=2))
    if not report["ok"]:
        print(f"invalid adapter file {args[0]}: {report['error']}", file=sys.stderr)
        return 1
    return 0
