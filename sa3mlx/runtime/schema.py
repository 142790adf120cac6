"""What each params.yaml key may hold: one `Spec` per key, declared on the options dataclass field
that receives it (`field(..., metadata=spec(...))`) or derived from the field's type.

    @dataclass(frozen=True)
    class Options:
        max_seconds: float = field(default=600.0, metadata=spec(number(above=0)))
        format: str = field(default="wav", metadata=spec(choice(FORMATS)))

    options = options_from_params(Options, params["normalize"], "normalize")

A bad value is a `ParamError`: `params.yaml: normalize.format: expected one of flac, wav, got 'mp3'`.
Numbers that YAML 1.1 leaves as text (`5e-5`, `1E-4`, `1_000`, which `dvc exp run -S` writes) are
read as the numbers they are wherever the spec says number.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sa3mlx.runtime.errors import ParamError

SPEC_KEY = "spec"
_NUMBER_TEXT = re.compile(r"[-+]?(\d[\d_]*\.?[\d_]*|\.\d[\d_]*)([eE][-+]?\d+)?")


@dataclass(frozen=True)
class Spec:
    kind: str  # number | integer | flag | text | choice | mapping | list | texts | any
    low: float | None = None
    high: float | None = None
    above: bool = False  # low itself is refused ("positive")
    choices: tuple = ()
    optional: bool = False  # null allowed
    pattern: str | None = None  # text: a full match required

    def expected(self) -> str:
        text = {
            "number": f"a {self._range_words()}number{self._range()}",
            "integer": f"a whole number{self._range()}",
            "flag": "true or false",
            "text": "text" + (f" matching {self.pattern}" if self.pattern else ""),
            "choice": "one of " + ", ".join(str(c) for c in self.choices),
            "mapping": "a mapping (key: value)",
            "list": "a list",
            "texts": "a list of text",
            "any": "a value",
        }[self.kind]
        return "expected " + text + (" or null" if self.optional else "")

    def _range_words(self) -> str:
        return "positive " if self.above and self.low == 0 and self.high is None else ""

    def _range(self) -> str:
        if self._range_words() or (self.low is None and self.high is None):
            return ""
        if self.high is None:
            return f" {'>' if self.above else '>='} {self.low:g}"
        if self.low is None:
            return f" <= {self.high:g}"
        return f" in {'(' if self.above else '['}{self.low:g}, {self.high:g}]"

    def check(self, key: str, value):
        """`value` as the stage should use it; ParamError naming `key` when it does not fit."""
        if value is None:
            if self.optional or self.kind == "any":
                return None
            raise ParamError(key, self.expected(), value)
        checked = _CHECKS[self.kind](self, value)
        if checked is _BAD:
            raise ParamError(key, self.expected(), value)
        return checked


_BAD = object()


def _as_number(value):
    if isinstance(value, bool):
        return _BAD
    if isinstance(value, str) and _NUMBER_TEXT.fullmatch(value.strip()):
        value = float(value.strip())  # YAML 1.1 reads 5e-5 and 1_000 as text
    if not isinstance(value, (int, float)) or (isinstance(value, float) and not math.isfinite(value)):
        return _BAD
    return value


def _in_range(spec: Spec, value) -> bool:
    if spec.low is not None and (value < spec.low or (spec.above and value == spec.low)):
        return False
    return spec.high is None or value <= spec.high


def _check_number(spec: Spec, value):
    number = _as_number(value)
    if number is _BAD or not _in_range(spec, number):
        return _BAD
    return float(number) if isinstance(value, str) else number


def _check_integer(spec: Spec, value):
    number = _as_number(value)
    if number is _BAD or float(number) != int(number) or not _in_range(spec, number):
        return _BAD
    return int(number)


def _check_text(spec: Spec, value):
    if not isinstance(value, str) or (spec.pattern and not re.fullmatch(spec.pattern, value)):
        return _BAD
    return value


_CHECKS = {
    "number": _check_number,
    "integer": _check_integer,
    "flag": lambda spec, value: value if isinstance(value, bool) else _BAD,
    "text": _check_text,
    "choice": lambda spec, value: value if isinstance(value, typing.Hashable) and value in spec.choices else _BAD,
    "mapping": lambda spec, value: value if isinstance(value, Mapping) else _BAD,
    "list": lambda spec, value: list(value) if isinstance(value, (list, tuple)) else _BAD,
    "texts": lambda spec, value: (
        list(value) if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value) else _BAD
    ),
    "any": lambda spec, value: value,
}


# ---- declaring -----------------------------------------------------------------------------------------
def number(low: float | None = None, high: float | None = None, *, above: bool = False, optional=False) -> Spec:
    return Spec("number", low, high, above, optional=optional)


def positive(optional: bool = False) -> Spec:
    return Spec("number", 0, None, above=True, optional=optional)


def integer(low: int | None = None, high: int | None = None, *, optional: bool = False) -> Spec:
    return Spec("integer", low, high, optional=optional)


def flag() -> Spec:
    return Spec("flag")


def text(pattern: str | None = None, *, optional: bool = False) -> Spec:
    return Spec("text", optional=optional, pattern=pattern)


def choice(values: Iterable, *, optional: bool = False) -> Spec:
    """`values` in their order when a list or tuple, else sorted (a dict's keys, a set)."""
    ordered = tuple(values) if isinstance(values, (list, tuple)) else tuple(sorted(values))
    return Spec("choice", choices=ordered, optional=optional)


def mapping(optional: bool = False) -> Spec:
    return Spec("mapping", optional=optional)


def listing(optional: bool = False) -> Spec:
    return Spec("list", optional=optional)


def texts(optional: bool = False) -> Spec:
    return Spec("texts", optional=optional)


def spec(declared: Spec) -> dict:
    """The `metadata=` of a dataclass field."""
    return {SPEC_KEY: declared}


# keys no options class receives, checked when a stage reads them (sa3mlx.runtime.params)
MODEL_NAME = text(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # a folder under models/
SHARED_SPECS = {"model.base": MODEL_NAME, "model.arc": MODEL_NAME}


# ---- checking ------------------------------------------------------------------------------------------
_FROM_TYPE = {int: "integer", float: "number", bool: "flag", str: "text", dict: "mapping"}


def spec_from_type(hint) -> Spec:
    """A Spec from a field's type: int, float, bool, str, dict, each optionally `| None`."""
    args = typing.get_args(hint)
    optional = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    if optional:
        rest = [a for a in args if a is not type(None)]
        inner = spec_from_type(rest[0]) if len(rest) == 1 else Spec("any")
        return dataclasses.replace(inner, optional=type(None) in args)
    origin = typing.get_origin(hint) or hint
    if origin in (tuple, list):
        return Spec("list")
    return Spec(_FROM_TYPE.get(origin, "any"))


def field_specs(cls) -> dict[str, Spec]:
    """Every init field of a dataclass and its Spec (declared, else from its type)."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: f.metadata.get(SPEC_KEY) or spec_from_type(hints[f.name]) for f in dataclasses.fields(cls) if f.init
    }


def check_section(section: str, params: Mapping, specs: Mapping[str, Spec]) -> dict:
    """`params` checked key by key (unknown keys refused, known ones listed); returns the values."""
    unknown = sorted(str(key) for key in params if key not in specs)
    if unknown:
        raise ParamError(f"{section}.{unknown[0]}", f"unknown key; known: {', '.join(sorted(specs))}", show_value=False)
    return {key: specs[key].check(f"{section}.{key}", value) for key, value in params.items()}


def check_mapping(section: str, value) -> Mapping:
    if not isinstance(value, Mapping):
        raise ParamError(section, "expected a mapping (key: value)", value)
    return value


def options_from_params(cls, params: Mapping, section: str):
    """`cls(**params)` for an options dataclass, every value checked against its field's Spec."""
    return cls(**check_section(section, check_mapping(section, params), field_specs(cls)))
