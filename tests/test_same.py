"""SAME codec: fixture parity, length rules, patch transform, chunking, loading."""

import json
import math

import mlx.core as mx
import numpy as np
import pytest
from conftest import FIXTURES, ROOT

from sa3mlx.convert.checkpoint import read_safetensors
from sa3mlx.convert.model import convert_source
from sa3mlx.convert.same import same_to_mlx
from sa3mlx.models.config import AutoencoderConfig
from sa3mlx.models.patching import patchify, unpatchify
from sa3mlx.models.same import load_same_decoder, load_same_encoder, same_decoder_from_arrays, same_encoder_from_arrays
from sa3mlx.models.same_chunked import decode_chunked_torch, decode_long, encode_chunked_torch, encode_long
from sa3mlx.models.same_layers import band_attention
from sa3mlx.parity.compare import psnr_db
from sa3mlx.parity.registry import THRESHOLDS_DB
from sa3mlx.parity.run import check

SAME = FIXTURES / "same"
CODECS = ("same_s", "same_l")


@pytest.fixture(scope="module")
def codecs():
    """name -> (encoder, decoder) built from the fixture's torch weights."""
    out = {}
    for name in CODECS:
        cfg = AutoencoderConfig.from_standalone(json.loads((SAME / f"{name}_config.json").read_text()))
        enc, dec = same_to_mlx(read_safetensors(SAME / f"{name}.safetensors")[0])
        out[name] = (same_encoder_from_arrays(enc, cfg), same_decoder_from_arrays(dec, cfg))
    return out


def audio(samples: int, batch: int = 1, seed: int = 0) -> np.ndarray:
    return (0.3 * np.random.default_rng(seed).standard_normal((batch, 2, samples))).astype(np.float32)


def test_parity_same():
    report = check("same", SAME)
    print("\n".join(report.lines()))
    assert report.ok and not report.missing
    assert len(report.rows) == 10
    for _, row in report.rows:
        assert row.psnr_db >= THRESHOLDS_DB["same"] >= 60.0, row.key


def test_patch_transform_is_channel_major_and_exactly_invertible():
    x = mx.array(audio(3 * 256, batch=2))
    patches = patchify(x, 256)
    assert patches.shape == (2, 3, 512)
    p, a = np.array(patches), np.array(x)
    assert p[1, 2, 256 + 7] == a[1, 1, 2 * 256 + 7] and p[0, 1, 5] == a[0, 0, 256 + 5]
    assert np.array_equal(np.array(unpatchify(patches, 2)), a)
    short = mx.array(audio(700))
    back = np.array(unpatchify(patchify(short, 256), 2))
    assert back.shape == (1, 2, 768)
    assert np.array_equal(back[..., :700], np.array(short)) and not back[..., 700:].any()


def expected_latents(name: str, samples: int) -> int:
    """Documented unchunked counts: SAME-S pads to 32 patches (2 latents), SAME-L to 16 (1)."""
    patches = math.ceil(samples / 256)
    return math.ceil(patches / 32) * 2 if name == "same_s" else math.ceil(patches / 16)


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("samples", [1, 255, 4095, 4096, 4097, 8192, 8193, 42194, 70001])
def test_encode_lengths_and_masks(codecs, name, samples):
    enc, _ = codecs[name]
    x = audio(samples)
    assert enc(mx.array(x)).shape == (1, 16, expected_latents(name, samples))
    latents, mask = encode_long(enc, x, chunk=4, overlap=2)
    assert latents.shape == (1, 16, expected_latents(name, samples))
    assert mask.shape == (1, latents.shape[-1]) and mask.dtype == bool
    assert mask.sum() == math.ceil(samples / 4096) and mask[0, : math.ceil(samples / 4096)].all()
    torch_chunked = encode_chunked_torch(enc, x, 4, 2)
    if samples >= 4 * 4096:  # the official chunked path: floor(samples / 4096) latents
        assert torch_chunked.shape[-1] == samples // 4096
    else:
        assert torch_chunked.shape == latents.shape


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("count", [1, 2, 3, 7, 8, 13])
def test_decode_lengths(codecs, name, count):
    _, dec = codecs[name]
    z = np.random.default_rng(count).standard_normal((1, 16, count)).astype(np.float32)
    padded = count + count % 2 if name == "same_s" else count  # SAME-S pads to an even count
    assert dec(mx.array(z)).shape == (1, 2, padded * 4096)
    assert decode_long(dec, z, chunk=4, overlap=2).shape == (1, 2, count * 4096)
    assert decode_chunked_torch(dec, z, 4, 2).shape[-1] == (count if count >= 4 else padded) * 4096


def test_encode_mask_per_item(codecs):
    enc, _ = codecs["same_l"]
    _, mask = encode_long(enc, audio(20000, batch=2), chunk=4, overlap=2, valid_samples=[20000, 4097])
    assert mask.sum(axis=1).tolist() == [5, 2]


@pytest.mark.parametrize("name", CODECS)
def test_production_chunking_matches_unchunked(codecs, name):
    enc, dec = codecs[name]
    x = audio(23 * 4096 + 1000, seed=3)
    whole = np.array(enc(mx.array(x)))
    chunked, _ = encode_long(enc, x, chunk=8, overlap=4)
    assert chunked.shape == whole.shape
    assert psnr_db(whole, np.array(chunked)) > 60.0
    decoded_whole = np.array(dec(mx.array(whole)))
    decoded = np.array(decode_long(dec, whole, chunk=8, overlap=4))
    assert decoded.shape == decoded_whole.shape
    assert psnr_db(decoded_whole, decoded) > 60.0


def test_chunk_grid_is_checked(codecs):
    enc, dec = codecs["same_s"]
    with pytest.raises(ValueError, match="modulo"):
        encode_long(enc, audio(100000), chunk=5, overlap=2)
    with pytest.raises(ValueError, match="overlap"):
        decode_long(dec, np.zeros((1, 16, 20), np.float32), chunk=4, overlap=4)


@pytest.mark.parametrize("length,block", [(5, 64), (150, 64), (150, 17), (200, 32)])
def test_band_attention_is_exact(length, block):
    rng = np.random.default_rng(length)
    q, k, v = (mx.array(rng.standard_normal((2, 3, length, 8)).astype(np.float32)) for _ in range(3))
    i = np.arange(length)
    keep = mx.array((i[None, :] - i[:, None] >= -17) & (i[None, :] - i[:, None] <= 12))
    dense = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.35, mask=keep)
    band = band_attention(q, k, v, 17, 12, 0.35, block=block)
    np.testing.assert_allclose(np.array(band), np.array(dense), atol=2e-6)


def test_noise_is_off_by_default_and_available(codecs):
    cfg = codecs["same_s"][1].cfg
    arrays = same_to_mlx(read_safetensors(SAME / "same_s.safetensors")[0])[1]
    z = mx.array(np.random.default_rng(1).standard_normal((1, 16, 4)).astype(np.float32))
    quiet = codecs["same_s"][1]
    assert np.array_equal(np.array(quiet(z)), np.array(quiet(z)))
    noisy = same_decoder_from_arrays(arrays, cfg, mask_noise=0.01, noise_regularize=True)
    assert not np.array_equal(np.array(noisy(z)), np.array(quiet(z)))


@pytest.fixture(scope="module")
def tiny_converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-base")
    convert_source(ROOT / "models" / "tiny-base", out)
    return out


def test_tiny_model_codec_loads_strictly_and_round_trips(tiny_converted):
    enc = load_same_encoder(tiny_converted / "same_encoder.npz")
    dec = load_same_decoder(tiny_converted / "same_decoder.npz")
    latents, mask = encode_long(enc, audio(50000), chunk=4, overlap=2)
    assert latents.shape == (1, 16, 14) and mask.sum() == 13
    decoded = decode_long(dec, latents, chunk=4, overlap=2)
    assert decoded.shape == (1, 2, 14 * 4096)
    assert np.isfinite(np.array(latents)).all() and np.isfinite(np.array(decoded)).all()


def test_loading_is_strict(tiny_converted, tmp_path):
    arrays = dict(np.load(tiny_converted / "same_encoder.npz"))
    cfg = load_same_encoder(tiny_converted / "same_encoder.npz").cfg
    with pytest.raises(ValueError, match="missing"):
        same_encoder_from_arrays({k: v for k, v in arrays.items() if k != "layers.2.bias"}, cfg)
    with pytest.raises(ValueError, match="unexpected.*extra"):
        same_encoder_from_arrays({**arrays, "extra": np.zeros(1, np.float32)}, cfg)
