"""The bulk parser: the common event lines of a trace file, parsed with numpy in one pass.

Every kind declared with a ``spec`` in ``schema.KINDS`` is read here when its line has exactly
that shape (compact JSON, integers and short escape-free strings); anything else, damaged or
unusual, is left to the careful json path in ``reader.py``. A test holds it to json line by line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ddpdoctor.trace import schema
from ddpdoctor.trace.columns import Fields, Packed, Strings

_I64 = 2**63
_MAX_DIGITS = 16  # two 8-byte chunks; longer integers (never written) go through json
_MAX_STRING = 64  # longer strings too
_PAD = _MAX_STRING + 32  # room to read a whole token, or 16 bytes, past any line's end

FastKind = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, Fields]


def parse_fast(data: bytes) -> tuple[dict[str, FastKind], list[tuple[int, bytes]]]:
    """Bulk-parse the lines of the kinds with a ``spec`` that have exactly their shape
    (compact JSON, integers and escape-free strings); every other line is returned, with its
    index, for the careful path. Per kind: (line indices, ts, dur, step, Fields).

    Each line is classified once by its first 16 bytes (two little-endian words), and commas
    are counted once per file; the tokens between them are then parsed column by column."""
    a = np.frombuffer(data, dtype=np.uint8)
    nl = np.flatnonzero(a == 10)
    starts = np.concatenate(([0], nl + 1))
    ends = np.concatenate((nl, [len(a)]))
    if ends[-1] == starts[-1]:  # the file ends with a newline: no last line
        starts, ends = starts[:-1], ends[:-1]
    done = np.zeros(len(starts), dtype=bool)
    out: dict[str, FastKind] = {}
    if len(starts):
        file = _File.of(a, starts, ends)
        for kind in schema.KINDS.values():
            if kind.spec is None:
                continue
            found = file.parse_kind(kind.name, "iii" + kind.spec)
            if found is None:
                continue
            lines, cols = found
            done[lines] = True
            fields = Fields([c if isinstance(c, Strings) else Packed.of(c) for c in cols[3:]], len(lines))
            out[kind.name] = (lines, cols[0], cols[1], cols[2], fields)
    slow = [(int(i), data[starts[i] : ends[i]]) for i in np.flatnonzero(~done)]
    return out, [(i, raw) for i, raw in slow if raw.strip()]


@dataclass
class _File:
    """One trace file's bytes and line/comma positions, as the bulk parser needs them."""

    a: np.ndarray  # the bytes, padded with zeros
    words: np.ndarray  # words[i]: bytes i..i+7 as a little-endian uint64
    starts: np.ndarray
    ends: np.ndarray
    head: np.ndarray  # per line: its first 8 bytes as a word
    commas: np.ndarray
    first_comma: np.ndarray  # per line: index in ``commas`` of its first comma
    n_commas: np.ndarray  # per line
    quotes: np.ndarray
    backslashes: np.ndarray

    @classmethod
    def of(cls, a: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> _File:
        padded = np.concatenate((a, np.zeros(_PAD, np.uint8)))
        # Every byte offset's next 8 bytes as one little-endian word (a view, nothing copied).
        words = np.lib.stride_tricks.as_strided(padded, (len(padded) - 7, 8), (1, 1)).view("<u8")[:, 0]
        commas = np.flatnonzero(a == 44)
        first_comma = np.searchsorted(commas, starts)
        n_commas = np.diff(np.append(first_comma, len(commas)))
        quotes, backslashes = np.flatnonzero(a == 34), np.flatnonzero(a == 92)
        head = words[starts]
        return cls(padded, words, starts, ends, head, commas, first_comma, n_commas, quotes, backslashes)

    def parse_kind(self, kind: str, spec: str) -> tuple[np.ndarray, list[Any]] | None:
        """The lines that are exactly ``["kind",tok,...]`` with tokens as ``spec`` says, parsed:
        (line indices, [int64 array per "i" token, Strings per "s" token])."""
        prefix = f'["{kind}",'.encode()
        (_, word0, mask0), *more = _prefix_words(prefix)
        cand = np.flatnonzero((self.head & mask0) == word0)
        if not len(cand):
            return None
        starts, ends = self.starts[cand], self.ends[cand]
        ok = ends - starts > len(prefix) + 1
        for off, word, mask in more:
            ok &= (self.words[starts + off] & mask) == word
        ok &= (
            (self.a[ends - 1] == 93)  # "]"
            & (self.n_commas[cand] == len(spec))  # the prefix's comma and one between tokens
        )
        n_str = spec.count("s")
        if n_str:  # quotes and backslashes only matter inside strings (an int rejects them)
            ok &= _count(self.quotes, starts, ends) == 2 + 2 * n_str
            if len(self.backslashes):
                ok &= _count(self.backslashes, starts, ends) == 0
        cand, starts, ends = cand[ok], starts[ok], ends[ok]
        if not len(cand):
            return None
        first = self.first_comma[cand]  # the prefix's comma; then one after each token
        lo = self.commas[first] + 1
        good = np.ones(len(cand), dtype=bool)
        parsed: list[Any] = []
        for j, t in enumerate(spec):
            hi = self.commas[first + j + 1] if j + 1 < len(spec) else ends - 1
            values, valid = _ints(self.a, self.words, lo, hi) if t == "i" else _strings(self.a, lo, hi)
            parsed.append(values)
            good &= valid
            lo = hi + 1
        if not good.any():
            return None
        cols: list[Any] = []
        for p in parsed:
            if isinstance(p, tuple):
                codes, table = p
                cols.append(_strings_column(codes[good], table))
            else:
                cols.append(p[good])
        return cand[good], cols


def _prefix_words(prefix: bytes) -> list[tuple[int, np.uint64, np.uint64]]:
    """A line prefix of any length as (byte offset, word, mask of the prefix's bytes in it), one
    per 8 bytes: a line starts with the prefix when every word at its offset matches."""
    out = []
    for off in range(0, len(prefix), 8):
        chunk = prefix[off : off + 8]
        mask = (1 << (8 * len(chunk))) - 1
        out.append((off, np.uint64(int.from_bytes(chunk, "little")), np.uint64(mask)))
    return out


def _count(pos: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """How many of the sorted positions ``pos`` lie in each [lo, hi)."""
    return np.searchsorted(pos, hi) - np.searchsorted(pos, lo)


def _strings_column(codes: np.ndarray, table: list[str]) -> Strings:
    if len(table) == 1:
        return Strings(np.zeros(len(codes), np.uint8), table)
    used, codes = np.unique(codes, return_inverse=True)  # drop values only bad lines had
    kept = [table[i] for i in used.tolist()]
    return Strings(codes.reshape(-1).astype(np.uint8 if len(kept) <= 256 else np.uint32), kept)


_ZEROS = np.uint64(0x3030303030303030)  # eight ASCII "0"
_HIGH_NIBBLES = np.uint64(0xF0F0F0F0F0F0F0F0)
_SIXES = np.uint64(0x0606060606060606)
# _BELOW[n]: the low 8 - n bytes of a word, which lie before a token of n digits ending at its top.
_BELOW = np.array([(1 << (8 * (8 - n))) - 1 for n in range(9)], dtype=np.uint64)


def _ints(a: np.ndarray, words: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Integer tokens a[lo:hi] -> (int64 values, which were well-formed JSON integers).

    Eight digits at a time: the 8 bytes ending at a token's end are one little-endian word,
    bytes before the token's start are replaced by "0", and three multiply-shift steps turn
    the eight ASCII digits into their value (SWAR). A token of 9-16 digits takes two words."""
    first = a[lo]
    neg = first == 45  # "-"
    signed = bool(neg.any())
    if signed:
        lo = lo + neg
        first = a[lo]
    length = hi - lo  # >= 0
    valid = ((length - 1).view(np.uint64) < _MAX_DIGITS) & ((first != 48) | (length == 1))  # no leading 0
    length = np.minimum(length, _MAX_DIGITS)
    low_len = np.minimum(length, 8)
    values, ok = _eight_digits(words[hi - 8], low_len)
    valid &= ok
    if int(length.max(initial=0)) > 8:
        high_len = length - low_len
        high, ok = _eight_digits(words[np.maximum(hi - 16, 0)], high_len)
        valid &= ok | (high_len == 0)
        values += high * 100_000_000  # 0 where there is no high part
    values = values.view(np.int64)  # below 10**16: the same bits
    return (np.where(neg, -values, values) if signed else values), valid


def _eight_digits(word: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(value of the top ``n`` bytes of each word as decimal digits, whether they all are)."""
    below = _BELOW[n]
    word = (word & ~below) | (_ZEROS & below)
    ok = ((word & _HIGH_NIBBLES) == _ZEROS) & (((word + _SIXES) & _HIGH_NIBBLES) == _ZEROS)
    d = word - _ZEROS
    d = ((d * np.uint64(10)) + (d >> np.uint64(8))) & np.uint64(0x00FF00FF00FF00FF)
    d = ((d * np.uint64(100)) + (d >> np.uint64(16))) & np.uint64(0x0000FFFF0000FFFF)
    d = (d * np.uint64(10000)) + (d >> np.uint64(32))
    return d & np.uint64(0xFFFFFFFF), ok


def _strings(
    a: np.ndarray, lo: np.ndarray, hi: np.ndarray
) -> tuple[tuple[np.ndarray, list[str]], np.ndarray]:
    """String tokens a[lo:hi] (with their quotes) -> ((codes, distinct values), well-formed)."""
    length = hi - lo - 2
    valid = (length >= 0) & (length <= _MAX_STRING) & (a[lo] == 34) & (a[np.maximum(hi - 1, lo)] == 34)
    length = np.where(valid, length, 0)
    width = int(length.max()) if len(length) else 0
    pos = np.arange(width)
    chars = np.where(pos < length[:, None], a[lo[:, None] + 1 + pos], 0).astype(np.uint8)
    key = np.concatenate((length[:, None].astype(np.uint8), chars), axis=1)
    if (key == key[0]).all():  # the usual case: one class name, one op
        rows, codes = key[:1], np.zeros(len(key), dtype=np.int64)
    else:
        rows, codes = np.unique(key, axis=0, return_inverse=True)
    table = [bytes(row[1 : 1 + row[0]]).decode("utf-8", "replace") for row in rows]
    return (codes.reshape(-1), table), valid
