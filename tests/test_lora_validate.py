import json
import struct

import numpy as np
import pytest
from conftest import FIXTURES
from safetensors.numpy import save_file

from sa3mlx.lora.validate import REASONS, main, validate

KEY = "model.transformer.layers.0.ff.ff.2.parametrizations.weight.0."
CHECKPOINTS = sorted(p for p in (FIXTURES / "lora").glob("*.safetensors") if p.name != "base_weights.safetensors")


def _adapter(path, metadata):
    save_file(
        {KEY + "lora_A": np.zeros((2, 8), np.float16), KEY + "lora_B": np.zeros((4, 2), np.float16)},
        path,
        metadata=metadata,
    )
    return path


def _corrupt(tmp_path):
    good = _adapter(tmp_path / "good.safetensors", {"lora_config": json.dumps({"rank": 2, "adapter_type": "lora"})})
    path = tmp_path / "truncated.safetensors"
    path.write_bytes(good.read_bytes()[:-10])
    return path


def _pickle(tmp_path):
    path = tmp_path / "adapter.ckpt"
    path.write_bytes(b"\x80\x04")
    return path


def _base_model(tmp_path):
    path = tmp_path / "base.safetensors"
    save_file({"model.transformer.project_in.weight": np.zeros((4, 3), np.float32)}, path)
    return path


CASES = {
    "not_found": lambda tmp: tmp / "missing.safetensors",
    "not_safetensors": _pickle,
    "unreadable": _corrupt,
    "no_adapter_keys": _base_model,
    "no_lora_config": lambda tmp: _adapter(tmp / "n.safetensors", {"other": "1"}),
    "config_not_json": lambda tmp: _adapter(tmp / "j.safetensors", {"lora_config": "{rank: 4"}),
    "config_not_object": lambda tmp: _adapter(tmp / "o.safetensors", {"lora_config": '[4, "lora"]'}),
    "missing_rank": lambda tmp: _adapter(tmp / "r.safetensors", {"lora_config": '{"adapter_type": "lora"}'}),
    "missing_adapter_type": lambda tmp: _adapter(tmp / "t.safetensors", {"lora_config": '{"rank": 2}'}),
}


def test_nine_distinct_reasons(tmp_path, capsys):
    messages = {}
    for reason, make in CASES.items():
        path = make(tmp_path)
        report = validate(path)
        assert not report["ok"] and report["reason"] == reason, (reason, report)
        json.dumps(report)
        messages[reason] = report["error"]
        assert main([str(path)]) == 1
        assert REASONS[reason] in capsys.readouterr().err
    with capsys.disabled():
        for reason, message in messages.items():
            print(f"\n{reason:<22} {message}", end="")
    assert len(set(messages.values())) == 9


def test_garbage_header_is_unreadable(tmp_path):
    path = tmp_path / "g.safetensors"
    path.write_bytes(struct.pack("<Q", 5) + b"{oops")
    assert validate(path)["reason"] == "unreadable"
    path.write_bytes(struct.pack("<Q", 10**9) + b"{}")
    assert validate(path)["reason"] == "unreadable"


@pytest.mark.parametrize("path", CHECKPOINTS, ids=lambda p: p.name)
def test_every_fixture_checkpoint_is_accepted(path, capsys):
    report = validate(path)
    assert report["ok"], report
    assert main([str(path)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["rank"] == 4 and printed["alpha"] == 8
    assert printed["adapter_type"] == json.loads(_metadata(path))["adapter_type"]


def _metadata(path):
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length])["__metadata__"]["lora_config"]


def test_report_contents_follow_underfit():
    report = validate(FIXTURES / "lora" / "dit_dora_rows.safetensors")
    assert report["fingerprint"] == "dora-rows" and report["config"]["base_model"] == "sa3-tiny-fixture"
    assert report["num_layers"] == 15 and len(report["layers"]) == 15
    seconds = next(layer for layer in report["layers"] if layer["name"].startswith("conditioners."))
    assert seconds == {"name": "conditioners.seconds_total.embedder.embedding.1", "fan_in": 256, "fan_out": 768}
    xs = validate(FIXTURES / "lora" / "layer_bora-xs.safetensors")
    assert xs["fingerprint"] == "bora" and xs["layers"] == [] and "notes" in xs
    assert validate(FIXTURES / "lora" / "layer_dora-cols.safetensors")["fingerprint"] == "dora-rows"


def test_only_absent_fields_are_back_filled(tmp_path):
    path = _adapter(
        tmp_path / "a.safetensors", {"lora_config": json.dumps({"rank": 2, "adapter_type": "lora", "include": None})}
    )
    config = validate(path)["config"]
    assert config["alpha"] == 2 and config["include"] is None and config["exclude"] == []


def test_cli_validate_exit_codes(tmp_path, capsys):
    from sa3mlx.cli import main

    assert main(["lora", "validate", str(FIXTURES / "lora" / "layer_lora.safetensors")]) == 0
    assert '"adapter_type": "lora"' in capsys.readouterr().out
    assert main(["lora", "validate", str(tmp_path / "missing.safetensors")]) == 1
    assert "file not found" in capsys.readouterr().err
