"""One Prometheus text page from several replicas' pages: every sample gets a ``replica``
label, and each metric family appears once (its ``# HELP``/``# TYPE`` lines, then the samples
of every replica), as the text format requires."""
from __future__ import annotations

import re
from typing import Iterable

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?(\s+.*)$")


def _label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def merge_metrics(pages: Iterable[tuple[str, str]]) -> str:
    """``pages``: ``(replica id, Prometheus text)`` pairs."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in pages:
        family = ""
        label = f'replica="{_label_value(replica)}"'
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    headers.setdefault(family, [])
                    samples.setdefault(family, [])
                    if line not in headers[family]:
                        headers[family].append(line)
                continue
            match = _SAMPLE.match(line)
            if match is None:
                continue
            name, _, labels, rest = match.groups()
            merged = f"{label},{labels}" if labels else label
            samples.setdefault(family, []).append(f"{name}{{{merged}}}{rest}")
            headers.setdefault(family, [])
    out: list[str] = []
    for family, lines in headers.items():
        out.extend(lines)
        out.extend(samples.get(family, []))
    return "\n".join(out) + "\n"
