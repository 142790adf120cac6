"""Prompt templates: tags / paths / fixed by weight, trigger, display names, legacy prompt, seeding."""

import random

import pytest

from sa3mlx.data import prompts as P

META = {
    "title": "Night Drive",
    "artist": "Kay",
    "genre": "synthwave, retro",
    "bpm": "110",
    "relpath": "albums/kay/night_drive.npy",
    "seconds_total": 180.0,
    "padding_mask": [1, 1],
}


def _many(template, meta=META, n=400, seed=0):
    rng = random.Random(seed)
    return [P.build_prompt(meta, template, rng) for _ in range(n)]


def test_legacy_prompt_without_config():
    meta = {"title": "Night Drive", "artist": "Kay", "bpm": "110", "relpath": "x.npy"}
    parts = {"Title: Night Drive", "Artist: Kay", "BPM: 110"}
    prompts = [p.split(", ") for p in _many(None, meta)]
    assert all(set(p) <= parts and len(set(p)) == len(p) for p in prompts)
    # half shuffle-all (all parts), half a random-size subset (1..3 parts, P(3) = 1/3)
    full = sum(len(p) == 3 for p in prompts) / len(prompts)
    assert 0.58 < full < 0.76 and min(len(p) for p in prompts) == 1
    assert len({tuple(p) for p in prompts if len(p) == 3}) == 6  # every order occurs
    assert P.build_prompt({"text": "a caption"}, None, random.Random(0)) == "a caption"
    assert P.build_prompt({"prompt": "rain on tin"}, None, random.Random(0)) == "Prompt: rain on tin"
    assert P.build_prompt({}, None, random.Random(0)) == ""


def test_display_names_hide_names_and_split_commas():
    t = P.PromptTemplate(shuffle=False, split_commas=True)
    assert _many(t, n=1)[0] == "Title: Night Drive, Artist: Kay, Genre: synthwave, Genre: retro, BPM: 110"
    t = P.PromptTemplate(shuffle=False, hide_tag_names=True, hide_commas=True, tag_keys=("genre", "title"))
    assert _many(t, n=1)[0] == "synthwave, retro Night Drive"
    assert P.PromptTemplate(shuffle=False, tag_keys=("date",)).tag_keys == ("date",)
    assert _many(P.PromptTemplate(shuffle=False, tag_keys=("date",)), {"date": "1999"}, n=1) == ["Year: 1999"]


def test_sources_are_picked_by_weight():
    t = P.PromptTemplate(
        use_tags=True,
        use_paths=True,
        use_fixed=True,
        fixed_text="FIXED",
        weight_tags=1,
        weight_paths=1,
        weight_fixed=2,
        shuffle=False,
    )
    prompts = _many(t, n=2000)
    fixed = prompts.count("FIXED") / len(prompts)
    paths = prompts.count("albums/kay/night_drive.npy") / len(prompts)
    assert 0.45 < fixed < 0.55 and 0.2 < paths < 0.3
    zero = P.PromptTemplate(
        use_tags=False, use_paths=True, use_fixed=True, fixed_text="F", weight_paths=0, weight_fixed=0
    )
    assert set(_many(zero, n=200)) == {"F", "albums/kay/night_drive.npy"}  # all weights 0: uniform
    none = P.PromptTemplate(use_tags=False)
    assert _many(none, {"text": "t"}, n=1) == ["t"]


@pytest.mark.parametrize(
    "opts, want",
    [
        ({}, "albums/kay/night_drive.npy"),
        ({"hideExt": True}, "albums/kay/night_drive"),
        ({"hideDirs": True}, "albums/night_drive.npy"),
        ({"hide_dirs": True, "hide_topmost_dir": True, "hide_ext": True}, "night_drive"),
        ({"hideTopmostDir": True}, "kay/night_drive.npy"),
    ],
)
def test_path_prompts(opts, want):
    t = P.PromptTemplate.from_dict({"use_tags": False, "use_paths": True, "path_opts": opts})
    assert _many(t, n=1)[0] == want


def test_trigger_probability_and_separator():
    t = P.PromptTemplate.from_dict({"trigger": "zxq", "trigger_pct": 80, "shuffle": False, "tag_keys": ["title"]})
    assert t.trigger_probability == 0.8
    prompts = _many(t, n=2000)
    assert set(prompts) == {"zxq, Title: Night Drive", "Title: Night Drive"}
    assert 0.77 < sum(p.startswith("zxq") for p in prompts) / len(prompts) < 0.83
    fixed = P.PromptTemplate(
        use_tags=False, use_fixed=True, fixed_text="a loop", trigger="zxq", trigger_probability=1.0
    )
    assert _many(fixed, n=1) == ["zxq a loop"]
    empty = P.PromptTemplate(use_tags=False, use_fixed=True, trigger="zxq", trigger_probability=1.0)
    assert _many(empty, n=1) == ["zxq"]
    assert not any("zxq" in p for p in _many(P.PromptTemplate(trigger="zxq", trigger_probability=0.0), n=50))


def test_dashboard_config_and_unknown_keys():
    t = P.PromptTemplate.from_dict(
        {
            "use_fixed": True,
            "use_tags": False,
            "fixed_text": "",
            "balance": {"tags": 0, "paths": 0, "fixed": 100},
            "shuffle": True,
        }
    )
    assert t.weight_fixed == 100 and t.weight_tags == 0
    with pytest.raises(ValueError, match="unknown prompt template"):
        P.PromptTemplate.from_dict({"triger": "x"})
    with pytest.raises(ValueError):
        P.PromptTemplate(trigger_probability=80)


def test_seeded_state_round_trip_and_preview():
    t = P.PromptTemplate(trigger="zxq")
    rng = random.Random(5)
    P.build_prompt(META, t, rng)
    state = P.rng_state(rng)
    import json

    resumed = P.rng_from_state(json.loads(json.dumps(state)))
    assert [P.build_prompt(META, t, rng) for _ in range(20)] == [P.build_prompt(META, t, resumed) for _ in range(20)]
    preview = P.preview([META, {"title": "Other"}], t, n=10, seed=3)
    assert len(preview) == 10 and preview == P.preview([META, {"title": "Other"}], t, n=10, seed=3)
    assert any("Other" in p for p in preview) and P.preview([], t) == []
