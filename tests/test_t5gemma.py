import math
import shutil

import mlx.core as mx
import numpy as np
from conftest import FIXTURES, ROOT

from sa3mlx.convert.model import ConvertOptions, convert_source
from sa3mlx.models.config import ModelConfig, T5GemmaConfig
from sa3mlx.models.prompt import PromptEncoder
from sa3mlx.models.t5gemma import load_t5gemma, t5gemma_from_arrays
from sa3mlx.parity.compare import psnr_db
from sa3mlx.parity.fixture import Fixture
from sa3mlx.parity.registry import THRESHOLDS_DB
from sa3mlx.parity.run import check
from sa3mlx.parity.t5gemma import encoder_from_hf_folder, prompt_t5_last_hidden_state

FLOOR_DB = 75.0


def test_parity_every_key():
    report = check("t5gemma", FIXTURES / "t5gemma")
    print("\n".join(report.lines()))
    assert report.ok and not report.missing
    assert THRESHOLDS_DB["t5gemma"] >= FLOOR_DB
    for file, row in report.rows:
        assert row.psnr_db >= FLOOR_DB, (file, row)


def test_conditioner_prompt_hidden_state_with_empty_row():
    fixture = Fixture(FIXTURES / "conditioner")
    result = prompt_t5_last_hidden_state(fixture)
    reference = fixture.reference("expected.npz")["prompt_t5_last_hidden_state"]
    assert np.isfinite(result).all()
    mask = fixture.load("inputs.npz:prompt_attention_mask")
    assert not mask[2].any()  # the empty prompt: HF's dtype-min mask, reproduced row by row
    for b in range(len(reference)):
        assert psnr_db(reference[b], result[b]) >= FLOOR_DB


def small_config(**changes) -> T5GemmaConfig:
    base = dict(
        vocab_size=20,
        hidden_size=32,
        num_layers=1,
        num_heads=4,
        num_kv_heads=4,
        head_dim=8,
        intermediate_size=16,
        query_pre_attn_scalar=8.0,
        attn_logit_softcapping=50.0,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        layer_types=("full_attention",),
        sliding_window=4096,
        pad_token_id=0,
    )
    return T5GemmaConfig(**{**base, **changes})


def random_arrays(config: T5GemmaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    from sa3mlx.convert.t5gemma import t5gemma_shapes

    rng = np.random.default_rng(seed)
    return {
        k: (rng.standard_normal(s) / math.sqrt(s[-1])).astype(np.float32) for k, s in t5gemma_shapes(config).items()
    }


def test_gqa_equals_attention_with_repeated_kv_heads():
    gqa_cfg = small_config(num_kv_heads=2)
    arrays = random_arrays(gqa_cfg)
    full = dict(arrays)
    for name in ("k_proj", "v_proj"):
        w = arrays[f"layers.0.self_attn.{name}.weight"].reshape(2, 8, 32)
        full[f"layers.0.self_attn.{name}.weight"] = np.repeat(w, 2, axis=0).reshape(32, 32)
    ids = mx.array(np.array([[1, 5, 7, 9, 0, 0]], dtype=np.int32))
    mask = mx.array(np.array([[1, 1, 1, 1, 0, 0]], dtype=bool))
    a = t5gemma_from_arrays(arrays, gqa_cfg)(ids, mask)
    b = t5gemma_from_arrays(full, small_config())(ids, mask)
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)


def test_sliding_window_limits_what_one_layer_sees():
    cfg = small_config(layer_types=("sliding_attention",), sliding_window=2)
    model = t5gemma_from_arrays(random_arrays(cfg, seed=1), cfg)
    ids = np.array([[3, 4, 5, 6, 7, 8, 9, 10]], dtype=np.int32)
    changed = ids.copy()
    changed[0, 7] = 11
    a = np.array(model(mx.array(ids)))
    b = np.array(model(mx.array(changed)))
    moved = np.abs(a - b).max(axis=-1)[0]
    assert np.all(moved[:6] == 0) and np.all(moved[6:] > 0)  # |i - j| < window only


def test_padded_keys_are_ignored_but_padded_rows_computed():
    cfg = small_config()
    model = t5gemma_from_arrays(random_arrays(cfg, seed=2), cfg)
    mask = mx.array(np.array([[1, 1, 1, 0, 0]], dtype=bool))
    a = np.array(model(mx.array(np.array([[1, 2, 3, 0, 0]], np.int32)), mask))
    b = np.array(model(mx.array(np.array([[1, 2, 3, 7, 8]], np.int32)), mask))
    np.testing.assert_array_equal(a[:, :3], b[:, :3])
    assert np.abs(a[:, 3:] - b[:, 3:]).max() > 0


def test_fp16_storage_computes_in_fp32_on_cpu(tmp_path):
    folder = tmp_path / "t5gemma"
    shutil.copytree(FIXTURES / "t5gemma", folder)
    convert_source(folder, tmp_path / "out", ConvertOptions(t5gemma_dtype="float16"))
    config = T5GemmaConfig.load(folder)
    model = load_t5gemma(tmp_path / "out" / "t5gemma.npz", config)
    assert model.embed_tokens.weight.dtype == mx.float16  # the table stays in storage
    assert model.layers[0].self_attn.q_proj.weight.dtype == mx.float32
    inputs = Fixture(folder).load("inputs.npz")
    out = model(mx.array(inputs["input_ids"].astype(np.int32)), mx.array(inputs["attention_mask"].astype(bool)))
    assert out.dtype == mx.float32
    reference = np.array(
        encoder_from_hf_folder(folder)(
            mx.array(inputs["input_ids"].astype(np.int32)), mx.array(inputs["attention_mask"].astype(bool))
        )
    )
    assert psnr_db(reference, np.array(out)) > 65.0  # fp16 weights alone: ~70 dB here, not more loss


def test_tiny_embedded_model_end_to_end(tmp_path):
    convert_source(ROOT / "models" / "tiny-base", tmp_path)
    max_length = ModelConfig.load(ROOT / "models/tiny-base/model_config.json").conditioner.prompt.max_length
    encoder = PromptEncoder.from_converted(tmp_path)
    hidden, mask = encoder(["dark techno loop, 120 bpm", "", "warm piano chords"])
    assert encoder.max_length == max_length
    assert hidden.shape == (3, max_length, 768) and hidden.dtype == mx.float32
    assert mask.shape == (3, max_length) and mask.dtype == mx.bool_
    assert bool(mx.isfinite(hidden).all()) and not bool(mask[1].any())
    assert mask.sum(axis=1).tolist() == [8, 0, 3]  # digits split one by one
