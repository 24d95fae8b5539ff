"""Configuration overrides merged into a base: the one rule every layered config here follows."""

from __future__ import annotations

from typing import Any


def merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` merged in: a dict into a dict key by key, anything else replacing."""
    out = dict(base)
    for key, value in overrides.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
