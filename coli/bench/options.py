"""The bench's comma-list options (--batch, --prefill, --verify): one parser, each option's words and range."""

from __future__ import annotations

from coli.errors import ColiError


def comma_parts(text) -> list[str]:
    """'1, 4,,8' -> ['1', '4', '8']."""
    return [t.strip() for t in str(text).split(",") if t.strip()]


def parse_int_list(parts: list[str], option: str, what: str, example: str, lo: int, hi: int, range_words: str,
                   start: set[int] | None = None) -> list[int]:
    """Whole numbers in lo..hi, sorted, each once (with `start`'s members added). A bad value is a one-line
    ColiError naming the option and the value: '{option} {p!r}: not a whole number (a comma list of {what}, e.g.
    {example})' or '{option} {n}: {range_words}'."""
    out = set(start or ())
    for p in parts:
        try:
            n = int(p)
        except ValueError:
            raise ColiError(f"{option} {p!r}: not a whole number (a comma list of {what}, e.g. {example})") from None
        if not lo <= n <= hi:
            raise ColiError(f"{option} {n}: {range_words}")
        out.add(n)
    return sorted(out)
