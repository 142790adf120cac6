"""Tag precedence and cleaning: json > ../json > txt > ../txt > embedded; all values strings."""

import json

import numpy as np
import soundfile as sf
from mutagen.flac import FLAC

from sa3mlx.audio.tags import clean_tags, decode_text, find_tags


def tagged_flac(path, **tags):
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(path, np.zeros((4410, 2), np.float32), 44100, format="FLAC", subtype="PCM_16")
    audio = FLAC(path)
    for key, value in tags.items():
        audio[key] = value
    audio.save()


def test_sidecar_precedence_down_to_embedded(tmp_path):
    audio = tmp_path / "set" / "audio" / "song.flac"
    tagged_flac(audio, title="embedded title", organization="some label", comment="not kept")
    own_json = audio.with_suffix(".json")
    sibling_json = tmp_path / "set" / "json" / "song.json"
    own_txt = audio.with_suffix(".txt")
    sibling_txt = tmp_path / "set" / "txt" / "song.txt"
    for path, content in (
        (own_json, '{"prompt": "own json"}'),
        (sibling_json, '{"prompt": "sibling json"}'),
        (own_txt, "own txt\n"),
        (sibling_txt, "sibling txt"),
    ):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    seen = []
    for sidecar in (own_json, sibling_json, own_txt, sibling_txt):
        tags = find_tags(audio, tmp_path)
        seen.append((tags.source, tags.values))
        sidecar.unlink()
    tags = find_tags(audio, tmp_path)
    seen.append((tags.source, tags.values))
    assert seen == [
        ("set/audio/song.json", {"prompt": "own json"}),
        ("set/json/song.json", {"prompt": "sibling json"}),
        ("set/audio/song.txt", {"prompt": "own txt"}),
        ("set/txt/song.txt", {"prompt": "sibling txt"}),
        ("embedded", {"label": "some label", "title": "embedded title"}),
    ]


def test_empty_or_invalid_sidecars_fall_through_with_a_warning(tmp_path):
    audio = tmp_path / "a" / "clip.flac"
    tagged_flac(audio)
    audio.with_suffix(".json").write_text("{not json")
    audio.with_suffix(".txt").write_text("   \n")
    tags = find_tags(audio, tmp_path)
    assert (tags.source, tags.values) == ("none", {})
    assert any("invalid JSON" in w for w in tags.warnings)


def test_sibling_folders_stay_inside_the_root(tmp_path):
    root = tmp_path / "raw"
    audio = root / "top.flac"
    tagged_flac(audio)
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "top.json").write_text('{"prompt": "outside the dataset"}')
    assert find_tags(audio, root).source == "none"


def test_values_become_clean_strings():
    raw = {
        "bpm": 120,
        "tempo": 96.5,
        "loop": True,
        "tags": ["arp", " pluck ", None, ""],
        "empty": "",
        "none": None,
        "nested": {"b": 1, "a": "x"},
        "prompt": "  warm\x00 pads\r\nand keys  ",
        "cafe\u0301": "e\u0301",
    }
    assert clean_tags(raw) == {
        "bpm": "120",
        "tempo": "96.5",
        "loop": "true",
        "tags": "arp, pluck",
        "nested": '{"a": "x", "b": 1}',
        "prompt": "warm pads\nand keys",
        "café": "é",
    }


def test_non_utf8_text_is_decoded_robustly(tmp_path):
    assert decode_text("café".encode("cp1252")) == ("café", "not UTF-8; read as Windows-1252")
    assert decode_text(b"\xef\xbb\xbfbom") == ("bom", None)
    assert decode_text("über".encode("utf-16")) == ("über", None)
    assert decode_text(b"\x81\x8d") == ("\x81\x8d", "not UTF-8; read as Latin-1")
    audio = tmp_path / "x" / "clip.flac"
    tagged_flac(audio)
    audio.with_suffix(".txt").write_bytes("smooth café jazz".encode("cp1252"))
    tags = find_tags(audio, tmp_path)
    assert tags.values == {"prompt": "smooth café jazz"}
    assert tags.warnings == ["x/clip.txt: not UTF-8; read as Windows-1252"]
    audio.with_suffix(".txt").unlink()
    audio.with_suffix(".json").write_bytes(json.dumps({"title": "naïve"}, ensure_ascii=False).encode("cp1252"))
    assert find_tags(audio, tmp_path).values == {"title": "naïve"}


def test_demo_embedded_tags(tmp_path):
    from conftest import ROOT

    raw = ROOT / "data" / "raw"
    mp3 = find_tags(raw / "funk_groove.mp3", raw)  # ID3, label from TPUB
    assert mp3.source == "embedded"
    assert mp3.values == {
        "album": "synthetic music",
        "artist": "deep keys",
        "bpm": "118",
        "composer": "unknown",
        "date": "2024",
        "genre": "funk",
        "label": "demo",
        "title": "groovy funk house",
    }
    ogg = find_tags(raw / "ambient_sweep.ogg", raw)  # Vorbis comments; libsndfile's "encoder" is not a tag we keep
    assert "encoder" not in ogg.values and ogg.values["genre"] == "ambient"
    assert find_tags(raw / "exports" / "bass_line_copy.flac", raw).source == "none"
