"""The strict JSON reader of OpenAI request bodies.

`loads` reads the body more strictly than `json.loads`, which accepts NaN, Infinity, 1e999
(as inf), duplicate keys (the last wins) and lone surrogates ("\\ud800", which no tokenizer
can encode), and which crashes on deep nesting (RecursionError) and on integers of more than
4,300 digits (ValueError). Each of these is a `BadRequest` naming where in the body it is.
Its checks stay at C speed on long token-id lists, the one large thing a body holds.
"""

from __future__ import annotations

import json
import math
import re
from typing import NoReturn

MAX_DEPTH = 32  # objects and arrays inside one another; OpenAI bodies need about 5
MAX_INT_DIGITS = 32  # int64 needs 19; longer literals are refused before int() parses them


class BadRequest(ValueError):
    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


# -- the body --------------------------------------------------------------------------------

_SURROGATE = re.compile(r"[\ud800-\udfff]")
_LONG_INT = re.compile(f"[0-9]{{{MAX_INT_DIGITS + 1}}}")
_NUMBERS = frozenset({int, float, bool})


class _Refused:
    """What a decoder hook puts in place of a value it refuses: hooks cannot see where they
    are, so `loads` finds these afterwards and names the field."""

    def __init__(self, why: str, key: str | None = None) -> None:
        self.why = why
        self.key = key  # set for a duplicate key: the field is that key of the object


def _object(pairs: list[tuple[str, object]]) -> dict | _Refused:
    out = dict(pairs)
    if len(out) < len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                return _Refused("the key appears twice in one object", key=k)
            seen.add(k)
    return out


def _int_literal(s: str) -> int | _Refused:
    digits = len(s) - s.startswith("-")
    if digits > MAX_INT_DIGITS:
        return _Refused(f"an integer of {digits} digits is too long (at most {MAX_INT_DIGITS})")
    return int(s)


def _constant(name: str) -> _Refused:
    return _Refused(f"{name} is not a JSON number")


def loads(raw: bytes) -> object:
    """A request body -> its JSON value, or BadRequest (see the module docstring)."""
    if not raw or raw.isspace():
        raise BadRequest(None, "body: empty; expected a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(None, f"body: byte {e.start} is not UTF-8, which JSON must be") from None
    hooks: dict = {"object_pairs_hook": _object, "parse_constant": _constant}
    if _LONG_INT.search(text):  # maybe inside a string; a Python call per integer only then
        hooks["parse_int"] = _int_literal
    try:
        value = json.loads(text, **hooks)
    except json.JSONDecodeError as e:
        raise BadRequest(None, f"body: not valid JSON ({e})") from None
    except RecursionError:
        raise BadRequest(None, f"body: nested more than {MAX_DEPTH} deep") from None
    _check_values(value)
    return value


def _check_values(root: object) -> None:
    """Refuse what the hooks marked, numbers beyond a double (1e999 decodes as inf), lone
    surrogates and nesting deeper than MAX_DEPTH."""
    stack: list[tuple[object, tuple[str | int, ...]]] = [(root, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, _Refused):
            _refuse(path if value.key is None else (*path, value.key), value.why)
        if isinstance(value, float) and not math.isfinite(value):
            _refuse(path, "the number is out of range for a double")
        if isinstance(value, str):
            _check_text(value, path)
        if not isinstance(value, (dict, list)):
            continue
        if len(path) >= MAX_DEPTH:
            _refuse(path, f"nested more than {MAX_DEPTH} deep")
        if isinstance(value, list) and _plain_list(value):
            continue
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if isinstance(k, str):
                _check_text(k, (*path, k))
            if not (v is None or isinstance(v, int)):  # integers were checked by the decoder
                stack.append((v, (*path, k)))


def _plain_list(items: list) -> bool:
    """Whether a list holds only finite numbers or only valid text (checked in C)."""
    kinds = set(map(type, items))
    if kinds <= _NUMBERS:
        return all(map(math.isfinite, items))
    if kinds == {str}:
        text = "".join(items)
        return text.isascii() or not _SURROGATE.search(text)
    return False


def _check_text(s: str, path: tuple[str | int, ...]) -> None:
    if not s.isascii() and (m := _SURROGATE.search(s)):
        _refuse(path, f"a lone surrogate U+{ord(m.group()):04X} is not valid Unicode text")


def _plain(key: object) -> bool:
    return isinstance(key, str) and key.isascii() and key.isidentifier() and len(key) <= 64


def _refuse(path: tuple[str | int, ...], why: str) -> NoReturn:
    where = ""
    for k in path:
        if isinstance(k, int):
            where += f"[{k}]"
        else:
            where += (f".{k}" if where else k) if _plain(k) else f"[{show(k)}]"
    param = path[0] if path and _plain(path[0]) else None
    raise BadRequest(param, f"{where or 'body'}: {why}")


def show(v: object) -> str:
    """A value for an error message: short, ASCII, and never raising (str() of an int of
    more than 4,300 digits does)."""
    if isinstance(v, str):
        return ascii(v[:32]) + ("..." if len(v) > 32 else "")
    if isinstance(v, int) and not isinstance(v, bool) and not -(10**32) < v < 10**32:
        return f"an integer of {v.bit_length()} bits"
    if isinstance(v, (int, float)) or v is None:
        return repr(v)
    return type(v).__name__
