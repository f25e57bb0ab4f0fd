"""The engine adapters' own settings (vLLM's ``kv_connector_extra_config``, SGLang's ``extra_config``, MindIE's
``mindie_cache``), parsed strictly: the one parser every adapter uses.

Rules (docs/engines/*.md say the same):

- An on/off setting is JSON ``true``/``false``, the integers ``1``/``0``, or one of the words kvpool's own
  settings take (``true``/``false``, ``1``/``0``, ``yes``/``no``, ``on``/``off``, any case: see
  :func:`kvpool.config.parse_flag`). Where the engine itself reads the same field by Python truth value
  (SGLang's ``interface_v1``: the string ``"false"`` turns it on there), words are refused rather than read
  the other way round (``words=False``).
- A number is a JSON integer in its range: never a bool, a float or a string of digits.
- A path is a string.
- A choice is one of its words, as written (a string; case matters, as in the engine's own JSON).
- Anything else is one ValueError naming the field, what it takes, and the value: ``"false"`` never means true,
  and ``null``, ``2`` or ``"maybe"`` never mean anything. Each adapter raises it where its engine expects
  config errors (see its module).
"""

from __future__ import annotations

from kvpool.config import parse_flag

FLAG_TEXT = "true or false (or 1/0, yes/no, on/off)"


def flag(value: object, field: str, *, words: bool = True, words_why: str = "") -> bool:
    """``value`` as an on/off setting (see the module docstring); ValueError naming ``field`` otherwise.

    ``words=False``: strings are refused, and ``words_why`` says why (the engine reads the field itself).
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        if not words:
            raise ValueError(f"{field} must be true or false (or 1/0) without quotes{words_why}, got {value!r}")
        try:
            return parse_flag(value)
        except ValueError:
            pass
    allowed = FLAG_TEXT if words else "true or false (or 1/0)"
    raise ValueError(f"{field} must be {allowed}, got {value!r}")


def integer(value: object, field: str, *, low: int, high: int | None = None) -> int:
    """``value`` as an integer in [``low``, ``high``]; ValueError naming ``field`` otherwise."""
    span = f"{low} or more" if high is None else f"{low} to {high}"
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        raise ValueError(f"{field} must be an integer, {span}, got {value!r}")
    return value


def path(value: object, field: str) -> str:
    """``value`` as a path (a string; ``""``: none given); ValueError naming ``field`` otherwise."""
    if not isinstance(value, str):
        raise ValueError(f"{field} must be a path (a string), got {value!r}")
    return value


def choice(value: object, field: str, choices: tuple[str, ...]) -> str:
    """``value`` as one of ``choices`` (a string, exactly); ValueError naming ``field`` and the choices otherwise."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{field} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")
    return value
