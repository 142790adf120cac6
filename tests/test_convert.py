import json
import shutil
import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES
from safetensors.numpy import save_file

from sa3mlx.convert import dit as dit_keys
from sa3mlx.convert.checkpoint import CheckpointError, read_safetensors
from sa3mlx.convert.model import ConvertOptions, convert_source
from sa3mlx.convert.same import fuse_weight_norm, torch_same_shapes
from sa3mlx.models.config import AutoencoderConfig, ModelConfig
from sa3mlx.runtime.io import sha256_file

FP32 = ConvertOptions(dit_dtype="float32", t5gemma_dtype="float32")


def npz(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def write_bf16_safetensors(path, tensors):
    """safetensors with every float tensor stored as bfloat16 (round to nearest even)."""
    header, chunks, offset = {}, [], 0
    for name, value in tensors.items():
        bits = np.ascontiguousarray(value, dtype=np.float32).view(np.uint32)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        data = rounded.tobytes()
        header[name] = {"dtype": "BF16", "shape": list(value.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"".join(chunks))


def sa3_folder(tmp_path, fixture="dit_small", state=None):
    """A copy of a DiT fixture folder (t5gemma sibling included), optionally with other weights."""
    root = tmp_path / "src"
    shutil.copytree(FIXTURES / fixture, root / fixture)
    shutil.copytree(FIXTURES / "t5gemma", root / "t5gemma")
    if state is not None:
        save_file(state, str(root / fixture / "model.safetensors"))
    return root / fixture


@pytest.mark.parametrize("fixture", ["dit_small", "dit_medium"])
def test_dit_fixture_converts_to_63_documented_keys(tmp_path, fixture):
    manifest = convert_source(FIXTURES / fixture, tmp_path / "out")
    arrays = npz(tmp_path / "out" / "dit.npz")
    config = ModelConfig.load(FIXTURES / fixture / "model_config.json")
    assert len(arrays) == 18 + 21 * config.dit.depth + 3 == 63
    assert {k: a.shape for k, a in arrays.items()} == dit_keys.mlx_dit_shapes(config.dit, 768)
    assert not any(k.endswith(".gamma") or k.startswith("model.") for k in arrays)
    for name in (
        "cond.padding_embedding",
        "cond.seconds_total_weight",
        "cond.seconds_total_bias",
        "transformer.layers.1.to_local_embed.seq.2.weight",
        "transformer.layers.0.pre_norm.weight",
        "transformer.rotary_pos_emb.inv_freq",
    ):
        assert name in arrays
    assert arrays["preprocess_conv.weight"].shape == (16, 1, 16)
    assert arrays["transformer.rotary_pos_emb.inv_freq"].dtype == np.float32
    assert arrays["transformer.project_in.weight"].dtype == np.float16  # default storage dtype
    assert manifest["files"]["dit.npz"]["keys"] == 63


def test_dit_values_follow_the_key_map(tmp_path):
    convert_source(FIXTURES / "dit_small", tmp_path / "out", FP32)
    arrays = npz(tmp_path / "out" / "dit.npz")
    source, _ = read_safetensors(FIXTURES / "dit_small" / "model.safetensors")
    for key, value in source.items():
        if key.startswith(dit_keys.DIT_PREFIX):
            torch_key = key[len(dit_keys.DIT_PREFIX) :]
            mapped = arrays[dit_keys.dit_key_to_mlx(torch_key)]
            assert dit_keys.dit_key_to_torch(dit_keys.dit_key_to_mlx(torch_key)) == torch_key
            expect = value.transpose(0, 2, 1) if torch_key in dit_keys.CONV_KEYS else value
            np.testing.assert_array_equal(mapped, expect)
        elif key in dit_keys.COND_KEYS:
            np.testing.assert_array_equal(arrays[dit_keys.COND_KEYS[key]], value)


def test_bf16_copy_converts_to_the_same_values(tmp_path):
    source, _ = read_safetensors(FIXTURES / "dit_small" / "model.safetensors")
    folder = sa3_folder(tmp_path, state=None)
    write_bf16_safetensors(folder / "model.safetensors", source)
    bf16_state, _ = read_safetensors(folder / "model.safetensors")
    convert_source(folder, tmp_path / "bf16", FP32)
    save_file(bf16_state, str(folder / "model.safetensors"))  # the same values stored as fp32
    convert_source(folder, tmp_path / "fp32", FP32)
    for name in ("dit.npz", "same_encoder.npz", "same_decoder.npz"):
        a, b = npz(tmp_path / "bf16" / name), npz(tmp_path / "fp32" / name)
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    # and bf16 really is the source rounded to 8 mantissa bits
    key = "model.model.transformer.project_in.weight"
    np.testing.assert_allclose(bf16_state[key], source[key], rtol=2**-8)


def test_broken_checkpoint_names_every_bad_key(tmp_path):
    state, _ = read_safetensors(FIXTURES / "dit_small" / "model.safetensors")
    removed = "model.model.transformer.layers.1.ff_norm.gamma"
    renamed = "model.model.transformer.layers.0.self_attn.to_out.weight"
    misshaped = "model.model.transformer.layers.0.cross_attn.to_q.weight"
    del state[removed]
    state[renamed.replace("to_out", "to_output")] = state.pop(renamed)
    state[misshaped] = state[misshaped][:64]
    folder = sa3_folder(tmp_path, state=state)
    with pytest.raises(CheckpointError) as err:
        convert_source(folder, tmp_path / "out")
    message = str(err.value)
    assert str(folder / "model.safetensors") in message
    for key in (removed, renamed, misshaped):
        assert key[len("model.model.") :] in message
    assert "transformer.layers.0.self_attn.to_output.weight" in message
    assert "got [64, 128], expected [128, 128]" in message
    assert not (tmp_path / "out" / "dit.npz").exists()


def test_config_that_does_not_match_the_weights_is_explained(tmp_path):
    folder = sa3_folder(tmp_path)
    config = json.loads((folder / "model_config.json").read_text())
    config["model"]["diffusion"]["config"]["depth"] = 3
    (folder / "model_config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError, match=r"model_config.json does not match the weights \(depth: config 3, weights 2\)"
    ):
        convert_source(folder, tmp_path / "out")


def test_pickle_checkpoints_are_refused_by_default(tmp_path):
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match="refusing to read a pickle checkpoint.*allow_pickle"):
        convert_source(ckpt, tmp_path / "out")


def test_official_mlx_npz_passes_through_validation(tmp_path):
    convert_source(FIXTURES / "dit_medium", tmp_path / "first", FP32)
    official = tmp_path / "dit_medium-base_f16.npz"
    shutil.copyfile(tmp_path / "first" / "dit.npz", official)
    with pytest.raises(CheckpointError, match="no model_config.json lies beside it.*--dit-only"):
        convert_source(official, tmp_path / "refused", FP32)
    assert not (tmp_path / "refused").exists()
    manifest = convert_source(official, tmp_path / "again", replace(FP32, dit_only=True))
    assert manifest["variant"] == "dit only (no model_config.json)" and manifest["inferred_dit"]["depth"] == 2
    assert manifest["files"]["dit.npz"]["keys"] == 63
    a, b = npz(tmp_path / "first" / "dit.npz"), npz(tmp_path / "again" / "dit.npz")
    assert all(np.array_equal(a[k], b[k]) for k in a) and a.keys() == b.keys()
    broken = dict(a)
    broken.pop("transformer.layers.0.to_scale_shift_gate")
    np.savez(tmp_path / "broken.npz", **broken)
    with pytest.raises(CheckpointError, match="missing.*\n.*to_scale_shift_gate"):
        convert_source(tmp_path / "broken.npz", tmp_path / "bad", replace(FP32, dit_only=True))


def test_same_checkpoint_fuses_weight_norm(tmp_path):
    folder = tmp_path / "same-s"
    folder.mkdir()
    shutil.copyfile(FIXTURES / "same" / "same_s_config.json", folder / "model_config.json")
    shutil.copyfile(FIXTURES / "same" / "same_s.safetensors", folder / "model.safetensors")
    convert_source(folder, tmp_path / "out")
    source, _ = read_safetensors(folder / "model.safetensors")
    enc, dec = npz(tmp_path / "out" / "same_encoder.npz"), npz(tmp_path / "out" / "same_decoder.npz")
    g, v = source["decoder.layers.3.mapping.weight_g"], source["decoder.layers.3.mapping.weight_v"]
    w = dec["layers.3.mapping.weight"]
    assert w.shape == (512, 3, 32) and w.dtype == np.float32
    np.testing.assert_allclose(w.transpose(0, 2, 1), fuse_weight_norm(g, v), rtol=1e-6)
    norms = np.linalg.norm(w.reshape(512, -1), axis=1)
    np.testing.assert_allclose(norms, g.reshape(-1), rtol=1e-5)
    assert {"bottleneck.scaling_factor", "bottleneck.bias", "bottleneck.running_std"} <= enc.keys()
    assert "bottleneck.running_std" in dec and "bottleneck.bias" not in dec
    assert not any("weight_g" in k or "weight_v" in k for k in list(enc) + list(dec))
    assert (tmp_path / "out" / "model_config.json").is_file()


def test_same_shape_table_matches_both_fixture_codecs():
    for name in ("same_s", "same_l"):
        config = AutoencoderConfig.from_standalone(json.loads((FIXTURES / "same" / f"{name}_config.json").read_text()))
        state, _ = read_safetensors(FIXTURES / "same" / f"{name}.safetensors")
        assert {k: v.shape for k, v in state.items()} == torch_same_shapes(config)


def test_t5gemma_folder_keeps_encoder_only(tmp_path):
    folder = tmp_path / "t5"
    shutil.copytree(FIXTURES / "t5gemma", folder)
    state, _ = read_safetensors(folder / "model.safetensors")
    state = {"model." + k: v for k, v in state.items()}  # optional `model.` prefix
    state["model.decoder.layers.0.self_attn.q_proj.weight"] = np.zeros((4, 4), np.float32)
    state["lm_head.weight"] = np.zeros((4, 4), np.float32)
    save_file(state, str(folder / "model.safetensors"))
    manifest = convert_source(folder, tmp_path / "out")
    arrays = npz(tmp_path / "out" / "t5gemma.npz")
    assert len(arrays) == 24 and manifest["files"]["t5gemma.npz"]["dtypes"] == ["float16"]
    assert "embed_tokens.weight" in arrays and "layers.1.mlp.down_proj.weight" in arrays
    assert (tmp_path / "out" / "t5gemma" / "tokenizer.json").is_file()


def test_conversion_is_deterministic(tmp_path):
    for out in ("a", "b"):
        convert_source(FIXTURES / "dit_small", tmp_path / out)
    for name in ("dit.npz", "same_encoder.npz", "same_decoder.npz", "t5gemma.npz", "manifest.json"):
        assert sha256_file(tmp_path / "a" / name) == sha256_file(tmp_path / "b" / name)


def test_truncated_safetensors_is_reported(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes((FIXTURES / "dit_small" / "model.safetensors").read_bytes()[:5000])
    with pytest.raises(CheckpointError, match=str(path)):
        read_safetensors(path)


def test_a_lone_checkpoint_file_converts_completely_or_is_refused(tmp_path):
    tiny = Path(__file__).resolve().parents[1] / "models" / "tiny-base"
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copyfile(tiny / "model.safetensors", lone / "my-finetune.safetensors")
    with pytest.raises(CheckpointError, match=r"SAME codec \(pretransform\.\*\) tensors.*model_config.json"):
        convert_source(lone / "my-finetune.safetensors", tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    shutil.copyfile(tiny / "model_config.json", lone / "model_config.json")
    shutil.copytree(tiny / "t5gemma-b-b-ul2", lone / "t5gemma-b-b-ul2")
    single = convert_source(lone / "my-finetune.safetensors", tmp_path / "single")
    folder = convert_source(tiny, tmp_path / "folder")
    assert (
        sorted(single["files"])
        == sorted(folder["files"])
        == sorted(["dit.npz", "same_encoder.npz", "same_decoder.npz", "t5gemma.npz"])
    )
    assert all(single["files"][f]["sha256"] == folder["files"][f]["sha256"] for f in folder["files"])
    assert (tmp_path / "single" / "model_config.json").read_bytes() == (tiny / "model_config.json").read_bytes()
