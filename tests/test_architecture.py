"""ARCHITECTURE.md names every package, and converted-model file names are spelled in one module only."""

import re

from conftest import ROOT

from sa3mlx.runtime import layout

FILE_NAMES = [
    value
    for name, value in vars(layout).items()
    if name.endswith("_FILE") and isinstance(value, str) and value not in (layout.DVC_FILE, layout.PARAMS_FILE)
]


def test_architecture_names_every_package():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    packages = sorted(p.name for p in (ROOT / "sa3mlx").iterdir() if (p / "__init__.py").is_file())
    assert [p for p in packages if f"`{p}`" not in text] == []
    assert "`cli`" in text


def test_converted_model_file_names_live_in_the_layout_module_only():
    spelled = {}
    for path in sorted([*(ROOT / "sa3mlx").rglob("*.py"), *(ROOT / "stages").glob("*.py")]):
        text = path.read_text()
        for name in FILE_NAMES:
            if re.search(rf"[\"']{re.escape(name)}[\"']", text):
                spelled.setdefault(name, []).append(path.relative_to(ROOT).as_posix())
    assert {n: f for n, f in spelled.items() if f != ["sa3mlx/runtime/layout.py"]} == {}
