"""``type=`` callables for pagoda's command lines (serve, Ray, batch, several models).

Each one checks its bound when the flags are parsed, so a bad value is a usage error that
names the flag instead of a failure at start-up. Sizes take plain integers or ``512MiB`` /
``2GiB`` / ``1GB`` spellings.
"""

from __future__ import annotations

import argparse
import math

from pagoda.config import integer as _parse_size_text


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be non-negative, got {value}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number above zero (seconds, ratios)."""
    value = float(text)
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number at least zero (seconds, ratios)."""
    value = float(text)
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a non-negative finite number, got {text}")
    return value


def byte_size(text: str) -> int:
    """A positive number of bytes (``16GiB``, ``512MiB``, ``1000000``)."""
    value = _parse_size_text(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of bytes, got {text}")
    return value


def non_negative_byte_size(text: str) -> int:
    """A number of bytes, zero allowed (``0`` often means "off")."""
    value = _parse_size_text(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative number of bytes, got {text}")
    return value
