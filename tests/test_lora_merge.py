"""`sa3mlx lora merge`: merged DiT == live adapters (torch semantics), the MLX rule, PEFT input, -xs bases."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from conftest import FIXTURES
from safetensors.numpy import save_file

from sa3mlx.cli import main as cli_main
from sa3mlx.convert.checkpoint import read_npz, read_safetensors
from sa3mlx.convert.dit import dit_to_mlx, split_sa3_state
from sa3mlx.lora.bases import compute_svd_file
from sa3mlx.lora.checkpoint import save_lora
from sa3mlx.lora.config import LoRAConfig
from sa3mlx.lora.inject import apply_checkpoint, inject_adapters, load_lora_state, lora_state
from sa3mlx.lora.merge import MLX_MERGE_RULE, merge_files, parse_lora_arg
from sa3mlx.models.conditioning import load_dit
from sa3mlx.parity.compare import psnr_db
from sa3mlx.runtime.io import save_npz

DORA_FILE = FIXTURES / "lora" / "dit_dora_rows.safetensors"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """../dit_small as an fp32 dit.npz with its model_config.json."""
    folder = tmp_path_factory.mktemp("dit_small")
    state, _ = read_safetensors(FIXTURES / "dit_small" / "model.safetensors")
    dit, cond, _ = split_sa3_state(state)
    save_npz(folder / "dit.npz", dit_to_mlx(dit, cond))
    shutil.copyfile(FIXTURES / "dit_small" / "model_config.json", folder / "model_config.json")
    return folder / "dit.npz"


def _velocity(dit, cond):
    inputs = np.load(FIXTURES / "dit_small" / "inputs.npz")
    seconds = cond.seconds_embedding(inputs["seconds_total"])
    context = mx.concatenate([mx.array(inputs["cross_attn_cond"][:, :-1]), seconds], axis=1)
    v = dit(mx.array(inputs["x"]), mx.array(inputs["t"]), context, seconds[:, 0], mx.array(inputs["local_add_cond"]))
    return np.array(v)


def _merged(base, tmp_path, loras, name, **kwargs):
    out = merge_files(base, loras, tmp_path / f"{name}.npz", say=lambda line: None, **kwargs)
    return out, read_npz(out)


def _random_adapter(base, path, adapter_type, seed, rank=4):
    dit, cond = load_dit(base)
    cfg = LoRAConfig(adapter_type=adapter_type, rank=rank, alpha=2 * rank)
    layers = inject_adapters(dit, cond, cfg, key=mx.random.key(seed), announce=False)
    rng = np.random.default_rng(seed)
    load_lora_state(
        layers,
        {
            k: np.array(v) * (1 + 0.1 * rng.standard_normal(v.shape))
            if ".magnitude" in k
            else 0.05 * rng.standard_normal(v.shape)
            for k, v in lora_state(layers).items()
        },
    )
    return save_lora(path, layers, cfg, step=1, epoch=1)


def test_parse_lora_arg():
    assert parse_lora_arg("a/b.safetensors:0.5") == (parse_lora_arg("a/b.safetensors")[0], 0.5)
    assert parse_lora_arg("a/b.safetensors")[1] == 1.0
    assert parse_lora_arg("C:/x/peft")[1] == 1.0


@pytest.mark.parametrize("strength", [1.0, 0.5])
def test_merged_dit_equals_live_adapters(base, tmp_path, strength):
    live = _velocity(*_live(base, strength))
    out, merged = _merged(base, tmp_path, [f"{DORA_FILE}:{strength}"], "merged")
    original = read_npz(base)
    assert set(merged) == set(original) and all(merged[k].dtype == original[k].dtype for k in original)
    replayed = _velocity(*load_dit(out))
    db = psnr_db(live, replayed)
    print(f"merged vs live at strength {strength}: PSNR {db:.1f} dB")
    assert db > 120


def _live(base, strength):
    dit, cond = load_dit(base)
    apply_checkpoint(dit, cond, DORA_FILE, strength, announce=False)
    return dit, cond


def test_mlx_rule_equals_torch_at_one_and_differs_for_dora_at_half(base, tmp_path):
    torch_1 = _merged(base, tmp_path, [f"{DORA_FILE}:1"], "t1")[1]
    mlx_1 = _merged(base, tmp_path, [f"{DORA_FILE}:1"], "m1", rule=MLX_MERGE_RULE)[1]
    assert all(np.array_equal(torch_1[k], mlx_1[k]) for k in torch_1)
    torch_half = _merged(base, tmp_path, [f"{DORA_FILE}:0.5"], "t05")[1]
    mlx_half = _merged(base, tmp_path, [f"{DORA_FILE}:0.5"], "m05", rule=MLX_MERGE_RULE)[1]
    key = "transformer.layers.0.self_attn.to_qkv.weight"
    original = read_npz(base)[key]
    # the MLX rule is the halfway blend; torch's keeps the full magnitudes
    np.testing.assert_allclose(mlx_half[key], (original + torch_1[key]) / 2, atol=1e-6)
    assert np.abs(torch_half[key] - mlx_half[key]).max() > 1e-3
    torch_0 = _merged(base, tmp_path, [f"{DORA_FILE}:0"], "t0")[1]
    assert all(np.array_equal(torch_0[k], v) for k, v in read_npz(base).items())


def test_plain_lora_rules_agree_and_adapters_add(base, tmp_path):
    a = _random_adapter(base, tmp_path / "a.safetensors", "lora", seed=1)
    b = _random_adapter(base, tmp_path / "b.safetensors", "dora-cols", seed=2)
    torch_half = _merged(base, tmp_path, [f"{a}:0.5"], "ta")[1]
    mlx_half = _merged(base, tmp_path, [f"{a}:0.5"], "ma", rule=MLX_MERGE_RULE)[1]
    assert all(np.allclose(torch_half[k], mlx_half[k], atol=1e-6) for k in torch_half)
    only_b = _merged(base, tmp_path, [str(b)], "b")[1]
    both = _merged(base, tmp_path, [f"{a}:0.5", str(b)], "ab")[1]
    original = read_npz(base)
    for key in original:
        expected = original[key] + (torch_half[key] - original[key]) + (only_b[key] - original[key])
        np.testing.assert_allclose(both[key], expected, atol=1e-5)


def test_peft_adapter_merges_like_the_same_sa3_adapter(base, tmp_path):
    sa3 = _random_adapter(base, tmp_path / "lora.safetensors", "lora", seed=4)
    tensors, _ = read_safetensors(sa3)
    peft = tmp_path / "peft"
    peft.mkdir()
    renamed = {}
    for key, value in tensors.items():
        layer, _, param = key.partition(".parametrizations.weight.0.")
        module = ("conditioner." + layer) if layer.startswith("conditioners.") else "model." + layer
        renamed[f"base_model.model.{module}.{param}.weight"] = value
    save_file(renamed, str(peft / "adapter_model.safetensors"))
    (peft / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["to_qkv", "to_out"]})
    )
    expected = _merged(base, tmp_path, [f"{sa3}:0.7"], "sa3")[1]
    via_folder = _merged(base, tmp_path, [f"{peft}:0.7"], "peft")[1]
    via_file = _merged(base, tmp_path, [f"{peft / 'adapter_model.safetensors'}:0.7"], "peft2")[1]
    assert all(
        np.array_equal(expected[k], via_folder[k]) and np.array_equal(expected[k], via_file[k]) for k in expected
    )


def test_xs_merge_uses_svd_stage_bases_or_recomputes(base, tmp_path):
    svd_dir = tmp_path / "svd"
    compute_svd_file(base.parent, svd_dir, max_rank=8)
    xs = _random_adapter(base, tmp_path / "xs.safetensors", "dora-rows-xs", seed=6)
    said = []
    out = merge_files(base, [f"{xs}:0.5"], tmp_path / "re.npz", say=said.append)
    assert any("recomputed the SVD bases" in line for line in said)
    said.clear()
    with_bases = merge_files(base, [f"{xs}:0.5"], tmp_path / "sv.npz", svd_dir=svd_dir, say=said.append)
    assert not any("recomputed" in line for line in said)
    a, b = read_npz(out), read_npz(with_bases)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    dit, cond = load_dit(base)
    apply_checkpoint(dit, cond, xs, 0.5, announce=False)
    assert psnr_db(_velocity(dit, cond), _velocity(*load_dit(with_bases))) > 120


def test_cli_merge_and_its_errors(base, tmp_path, capsys):
    out = tmp_path / "cli" / "dit.npz"
    assert cli_main(["lora", "merge", "--base", str(base), "--lora", f"{DORA_FILE}:0.5", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "torch (live parametrisation)" in said and (out.parent / "model_config.json").is_file()
    assert f"{out.parent / 'model_config.json'}: the base's model_config.json, written beside" in said
    other = tmp_path / "other" / "model_config.json"
    other.parent.mkdir()
    other.write_text('{"not": "the base"}')
    argv = ["lora", "merge", "--base", str(base), "--lora", f"{DORA_FILE}:0.5", "--out", str(other.parent / "m.npz")]
    assert cli_main(argv) == 2
    assert "exists and is not the base's model_config.json" in capsys.readouterr().err
    assert other.read_text() == '{"not": "the base"}' and not (other.parent / "m.npz").exists()
    assert (
        cli_main(
            ["lora", "merge", "--base", str(base), "--lora", str(tmp_path / "x.ckpt"), "--out", str(tmp_path / "y.npz")]
        )
        == 2
    )
    assert "pickles" in capsys.readouterr().err
    wrong = read_npz(base)
    wrong["transformer.layers.0.self_attn.to_qkv.weight"] = wrong["transformer.layers.0.self_attn.to_qkv.weight"][:8]
    save_npz(tmp_path / "wrong.npz", wrong)
    assert (
        cli_main(
            [
                "lora",
                "merge",
                "--base",
                str(tmp_path / "wrong.npz"),
                "--lora",
                str(DORA_FILE),
                "--out",
                str(tmp_path / "z.npz"),
            ]
        )
        == 2
    )
    assert "trained for a different base?" in capsys.readouterr().err


def test_merge_reports_the_layer_count_and_refuses_a_partial_merge(base, tmp_path, capsys):
    from dataclasses import replace

    from sa3mlx.lora.checkpoint import read_lora
    from sa3mlx.lora.layers import LoRAShapeError
    from sa3mlx.lora.merge import MergeInput, merge_arrays

    adapter = read_lora(DORA_FILE)
    out = tmp_path / "count" / "dit.npz"
    assert cli_main(["lora", "merge", "--base", str(base), "--lora", str(DORA_FILE), "--out", str(out)]) == 0
    count = len(adapter.layers)
    assert f"{DORA_FILE}: merged {count} of {count} adapted layers" in capsys.readouterr().out
    arrays = read_npz(base)
    with pytest.raises(LoRAShapeError, match="merged 0 of 0 adapted layers"):
        merge_arrays(arrays, [MergeInput(replace(adapter, layers={}))], say=lambda line: None)
