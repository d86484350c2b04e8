"""Streaming text past a marker: how much of a text may go out now, when its end could
still become the start of a marker ("<tool_call>", "</think>")."""

from __future__ import annotations


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best
