import shutil

import numpy as np
import pytest
from conftest import ROOT

from sa3mlx.models.config import ModelConfig, T5GemmaConfig
from sa3mlx.models.prompt import PromptEncoder
from sa3mlx.models.prompt_cache import CachedPrompt, PromptCache, PromptKey
from sa3mlx.models.tokenizer import PromptTokenizer, TokenizerError
from sa3mlx.parity.t5gemma import encoder_from_hf_folder

TINY = ROOT / "models" / "tiny-base" / "t5gemma-b-b-ul2"
PAD = T5GemmaConfig.load(TINY).pad_token_id


def raw_ids(prompt: str) -> list[int]:
    """The tokenizer's own ids with nothing added (special tokens off, no padding)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TINY / "tokenizer.json")).encode(prompt, add_special_tokens=False).ids


def tokenizer(length: int) -> PromptTokenizer:
    return PromptTokenizer.from_folder(TINY, length, PAD)


def test_padding_to_max_length():
    tokens = tokenizer(12)(["warm piano chords", "dark techno loop"])
    assert tokens.input_ids.shape == (2, 12) and tokens.attention_mask.shape == (2, 12)
    assert tokens.input_ids[0].tolist() == raw_ids("warm piano chords") + [PAD] * 9
    assert tokens.attention_mask[0].tolist() == [True] * 3 + [False] * 9


def test_truncation_keeps_the_first_tokens():
    prompt = "a b c d e f g " * 4
    assert len(raw_ids(prompt)) == 28
    tokens = tokenizer(10)(prompt)
    assert tokens.input_ids[0].tolist() == raw_ids(prompt)[:10]
    assert tokens.attention_mask.all()


def test_empty_prompt_is_all_padding():
    tokens = tokenizer(8)([""])
    assert tokens.input_ids.tolist() == [[PAD] * 8] and not tokens.attention_mask.any()


def test_unicode_is_normalised_by_the_folder_tokenizer():
    # the tiny tokenizer's normaliser is NFKC + lowercase: full-width letters and case fold to `bass`
    tokens = tokenizer(6)(["ＢＡＳＳ café ☃"])
    assert tokens.input_ids[0].tolist() == raw_ids("bass café ☃") + [PAD] * 3
    vocab = {"bass": 34, "<unk>": 3}
    assert tokens.input_ids[0, :3].tolist() == [vocab["bass"], vocab["<unk>"], vocab["<unk>"]]


def test_no_special_tokens_added_by_this_tokenizer():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    bos, eos = tok.token_to_id("<bos>"), tok.token_to_id("<eos>")
    tokens = tokenizer(16)(["deep house groove", ""])
    assert bos not in tokens.input_ids and eos not in tokens.input_ids
    assert tokens.attention_mask.sum(axis=1).tolist() == [3, 0]


def real_text_folders():
    for folder in sorted((ROOT / "models").glob("*/t5gemma-b-b-ul2")):
        if (folder / "config.json").is_file() and T5GemmaConfig.load(folder).vocab_size == 256000:
            yield folder


@pytest.mark.parametrize(
    "folder",
    list(real_text_folders())
    or [pytest.param(None, marks=pytest.mark.skip(reason="no real google/t5gemma-b-b-ul2 folder under models/"))],
)
def test_real_tokenizer_adds_no_bos_or_eos(folder):
    tok = PromptTokenizer.from_folder(folder, 256, T5GemmaConfig.load(folder).pad_token_id)
    tokens = tok(["dark techno loop", ""])
    config = T5GemmaConfig.load(folder)
    assert not tokens.attention_mask[1].any()
    assert 2 not in tokens.input_ids[0] and 1 not in tokens.input_ids[0]  # Gemma <bos>=2, <eos>=1
    assert tokens.input_ids[0, 0] != config.pad_token_id


def test_sentencepiece_only_folder_needs_the_package(tmp_path):
    try:
        import sentencepiece  # noqa: F401

        pytest.skip("sentencepiece is installed")
    except ImportError:
        pass
    (tmp_path / "tokenizer.model").write_bytes(b"\0")
    with pytest.raises(TokenizerError, match="sentencepiece"):
        PromptTokenizer.from_folder(tmp_path, 8, 0)


def test_missing_tokenizer_files(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer"):
        PromptTokenizer.from_folder(tmp_path, 8, 0)


# --- the prompt-embedding cache -------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_encoder():
    return encoder_from_hf_folder(TINY)


class CountingEncoder(PromptEncoder):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.encoded_rows = 0

    def encode_tokens(self, input_ids, attention_mask):
        self.encoded_rows += len(input_ids)
        return super().encode_tokens(input_ids, attention_mask)


def prompt_encoder(model, cache, weights_id="w", length=16) -> CountingEncoder:
    return CountingEncoder(model, tokenizer(length), weights_id, cache)


def test_prompt_seen_twice_is_encoded_once(tiny_encoder):
    cache = PromptCache()
    encoder = prompt_encoder(tiny_encoder, cache)
    first, mask = encoder(["dark techno loop", "warm piano"])
    again, mask_again = encoder(["warm piano", "dark techno loop", "warm piano"])
    assert encoder.encoded_rows == 2
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.entries) == (2, 2, 2) and stats.hit_rate == 0.5
    np.testing.assert_array_equal(np.array(again[1]), np.array(first[0]))
    np.testing.assert_array_equal(np.array(mask_again[0]), np.array(mask[1]))
    uncached = prompt_encoder(tiny_encoder, None)
    # batch composition only changes BLAS rounding
    np.testing.assert_allclose(np.array(uncached(["warm piano"])[0][0]), np.array(first[1]), atol=1e-4)


def test_other_weights_or_max_length_miss(tiny_encoder):
    cache = PromptCache()
    prompt_encoder(tiny_encoder, cache, "w1", 16)(["deep bass"])
    prompt_encoder(tiny_encoder, cache, "w2", 16)(["deep bass"])
    shorter = prompt_encoder(tiny_encoder, cache, "w1", 8)
    hidden, _ = shorter(["deep bass"])
    assert hidden.shape == (1, 8, 768)
    assert (cache.hits, cache.misses, len(cache)) == (0, 3, 3)
    prompt_encoder(tiny_encoder, cache, "w1", 16)(["deep bass ", "Deep bass"])  # exact strings only
    assert (cache.hits, cache.misses) == (0, 5)


def entry(nbytes_hidden: int) -> CachedPrompt:
    return CachedPrompt(np.zeros(nbytes_hidden // 4, np.float32), np.zeros(0, bool))


def key(name: str) -> PromptKey:
    return PromptKey("w", 8, name)


def test_lru_eviction_by_entries():
    cache = PromptCache(max_entries=2, max_bytes=1 << 20)
    cache.put(key("a"), entry(16))
    cache.put(key("b"), entry(16))
    assert cache.get(key("a")) is not None  # a is now the most recently used
    cache.put(key("c"), entry(16))
    assert key("b") not in cache and key("a") in cache and key("c") in cache
    assert cache.stats().evictions == 1


def test_lru_eviction_by_bytes():
    cache = PromptCache(max_entries=100, max_bytes=100)
    for name in "abc":
        cache.put(key(name), entry(40))
    assert len(cache) == 2 and cache.nbytes == 80 and key("a") not in cache
    cache.put(key("big"), entry(400))  # larger than the whole budget: not kept, nothing evicted
    assert key("big") not in cache and len(cache) == 2
    cache.put(key("b"), entry(80))  # refreshing an entry re-counts its bytes
    assert cache.nbytes == 80 and list(cache._entries) == [key("b")]


def test_converted_folder_encoder_shares_cache_by_content(tmp_path):
    from sa3mlx.convert.model import convert_source

    convert_source(ROOT / "models" / "tiny-base", tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    cache = PromptCache()
    PromptEncoder.from_converted(tmp_path / "a", cache=cache)(["lofi beat"])
    hidden, _ = PromptEncoder.from_converted(tmp_path / "b", cache=cache)(["lofi beat"])
    assert cache.hits == 1  # same weights, same max_length: a hit across folders
    length = ModelConfig.load(tmp_path / "a" / "model_config.json").conditioner.prompt.max_length
    assert hidden.shape == (1, length, 768)
