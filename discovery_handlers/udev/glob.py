"""udev's glob matching: glibc ``fnmatch(pattern, string, 0)`` in the C locale, in pure Python.

udev compares every match value that contains ``*``, ``?`` or ``[`` with ``fnmatch(3)`` and no
flags (``FNM_CASEFOLD`` for ``i"..."`` values). This module reproduces glibc's algorithm byte for
byte (the C locale, which udevd runs in), including its edge cases:

- ``*`` matches any sequence, ``/`` and leading dots included; ``?`` any single byte;
- ``\\x`` matches ``x`` literally; a trailing backslash never matches;
- ``[...]`` with ranges ``a-z``, negation ``[!...]`` (and ``[^...]``), a leading ``]`` as a
  member, ``\\`` escapes, POSIX classes ``[:digit:]`` (an unknown class name never matches),
  ``[=c=]`` and ``[.c.]``; a ``[`` without a closing ``]`` is an ordinary character.

Stars are matched without backtracking across each other (as glibc does), so the cost is
bounded by ``len(pattern) * len(string)`` per star segment rather than exponential.
"""

from __future__ import annotations

from dataclasses import dataclass

_NOMATCH = False
_MATCH = True

# glibc: CHAR_CLASS_MAX_LENGTH for the wctype-based implementation.
_CHAR_CLASS_MAX_LENGTH = 256

_LBRACKET = ord("[")
_RBRACKET = ord("]")
_BACKSLASH = ord("\\")
_STAR = ord("*")
_QUESTION = ord("?")
_COLON = ord(":")
_EQUALS = ord("=")
_DOT = ord(".")
_DASH = ord("-")
_BANG = ord("!")
_CARET = ord("^")
_A_LOWER = ord("a")
_Z_LOWER = ord("z")


def _ascii_set(chars: str) -> frozenset[int]:
    return frozenset(chars.encode())


_DIGITS = "0123456789"
_LOWER = "abcdefghijklmnopqrstuvwxyz"
_UPPER = _LOWER.upper()
_PUNCT = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
_CLASSES: dict[str, frozenset[int]] = {
    "alnum": _ascii_set(_DIGITS + _LOWER + _UPPER),
    "alpha": _ascii_set(_LOWER + _UPPER),
    "blank": _ascii_set(" \t"),
    "cntrl": frozenset([*range(0, 32), 127]),
    "digit": _ascii_set(_DIGITS),
    "graph": frozenset(range(33, 127)),
    "lower": _ascii_set(_LOWER),
    "print": frozenset(range(32, 127)),
    "punct": _ascii_set(_PUNCT),
    "space": _ascii_set(" \t\n\r\f\v"),
    "upper": _ascii_set(_UPPER),
    "xdigit": _ascii_set(_DIGITS + "abcdefABCDEF"),
}

GLOB_CHARS = frozenset(b"*?[")


def is_glob(value: bytes) -> bool:
    """udev's ``string_is_glob()``: the value contains ``*``, ``?`` or ``[``."""
    return any(byte in GLOB_CHARS for byte in value)


def _identity(byte: int) -> int:
    return byte


def _tolower(byte: int) -> int:
    return byte + 32 if 65 <= byte <= 90 else byte


@dataclass
class _Ends:
    pattern: int | None = None
    string: int = 0


class _Matcher:
    """One ``fnmatch`` call: the pattern, the string and the fold function."""

    def __init__(self, pattern: bytes, string: bytes, casefold: bool) -> None:
        self.pat = pattern
        self.plen = len(pattern)
        self.s = string
        self.send = len(string)
        self.fold = _tolower if casefold else _identity

    def at(self, index: int) -> int:
        """The pattern byte at ``index``, or 0 past the end (C's terminating NUL)."""
        return self.pat[index] if 0 <= index < self.plen else 0

    def fct(self, p: int, n: int, ends: _Ends | None) -> bool:
        fold = self.fold
        s = self.s
        send = self.send
        while True:
            c = self.at(p)
            p += 1
            if c == 0:
                break
            c = fold(c)
            if c == _QUESTION:
                if n == send:
                    return _NOMATCH
            elif c == _BACKSLASH:
                c = self.at(p)
                p += 1
                if c == 0:
                    return _NOMATCH  # trailing backslash loses
                c = fold(c)
                if n == send or fold(s[n]) != c:
                    return _NOMATCH
            elif c == _STAR:
                if ends is not None:
                    ends.pattern = p - 1
                    ends.string = n
                    return _MATCH
                c = self.at(p)
                p += 1
                while c in (_QUESTION, _STAR):
                    if c == _QUESTION:
                        if n == send:
                            return _NOMATCH
                        n += 1
                    c = self.at(p)
                    p += 1
                if c == 0:
                    return _MATCH  # the star(s) end the pattern
                end = _Ends()
                found = False
                if c == _LBRACKET:
                    p -= 1
                    while n < send:
                        if self.fct(p, n, end):
                            found = True
                            break
                        n += 1
                else:
                    if c == _BACKSLASH:
                        c = self.at(p)
                    c = fold(c)
                    p -= 1
                    while n < send:
                        if fold(s[n]) == c and self.fct(p, n, end):
                            found = True
                            break
                        n += 1
                if found and end.pattern is None:
                    return _MATCH
                if end.pattern is not None:
                    p = end.pattern
                    n = end.string
                    continue
                return _NOMATCH
            elif c == _LBRACKET:
                result = self._bracket(p, n)
                if result is None:
                    return _NOMATCH
                if isinstance(result, tuple):
                    # unterminated '[': an ordinary character
                    if n == send or fold(s[n]) != _LBRACKET:
                        return _NOMATCH
                else:
                    p = result
            else:
                if n == send or c != fold(s[n]):
                    return _NOMATCH
            n += 1
        return n == send

    def _bracket(self, p: int, n: int) -> int | tuple[()] | None:
        """Match ``s[n]`` against the bracket expression starting after ``[`` at ``p``.

        Returns the pattern index after the closing ``]`` on a match, ``None`` on no match,
        or ``()`` if the bracket is unterminated (then ``[`` is an ordinary character).
        """
        fold = self.fold
        if n == self.send:
            return None
        negate = self.at(p) in (_BANG, _CARET)
        if negate:
            p += 1
        raw = self.s[n]
        fn = fold(raw)
        c = self.at(p)
        p += 1
        while True:
            matched = False
            goto_normal = False
            if c == _BACKSLASH:
                if self.at(p) == 0:
                    return None
                c = fold(self.at(p))
                p += 1
                goto_normal = True
            elif c == _LBRACKET and self.at(p) == _COLON:
                name = bytearray()
                startp = p
                is_class = True
                while True:
                    if len(name) == _CHAR_CLASS_MAX_LENGTH:
                        return None
                    p += 1
                    c = self.at(p)
                    if c == _COLON and self.at(p + 1) == _RBRACKET:
                        p += 2
                        break
                    if c < _A_LOWER or c >= _Z_LOWER:
                        p = startp
                        c = _LBRACKET
                        is_class = False
                        break
                    name.append(c)
                if is_class:
                    members = _CLASSES.get(name.decode("ascii"))
                    if members is None:
                        return None  # invalid character class name
                    if raw in members:
                        matched = True
                    else:
                        c = self.at(p)
                        p += 1
                else:
                    goto_normal = True
            elif c == _LBRACKET and self.at(p) == _EQUALS:
                startp = p
                p += 1
                c = self.at(p)
                if c == 0:
                    p = startp
                    c = _LBRACKET
                    goto_normal = True
                else:
                    single = c
                    p += 1
                    c = self.at(p)
                    if c != _EQUALS or self.at(p + 1) != _RBRACKET:
                        p = startp
                        c = _LBRACKET
                        goto_normal = True
                    else:
                        p += 2
                        if raw == single:
                            matched = True
                        else:
                            c = self.at(p)
                            p += 1
            elif c == 0:
                return ()  # unterminated
            else:
                goto_normal = True
                if c == _LBRACKET and self.at(p) == _DOT:
                    # collating symbol; the C locale knows only single characters
                    startp = p
                    length = 0
                    while True:
                        p += 1
                        c = self.at(p)
                        if c == _DOT and self.at(p + 1) == _RBRACKET:
                            p += 2
                            break
                        if c == 0:
                            return None
                        length += 1
                    is_range = self.at(p) == _DASH and self.at(p + 1) != 0
                    if length != 1:
                        return None
                    symbol = self.at(startp + 1)
                    if not is_range and raw == symbol:
                        matched = True
                    else:
                        cold = symbol
                        c = self.at(p)
                        p += 1
                        goto_normal = False
                        range_result = self._range(c, p, cold, fn)
                        if range_result is None:
                            return None
                        matched, c, p = range_result
                else:
                    c = fold(c)
            if goto_normal and not matched:
                is_range = (
                    self.at(p) == _DASH and self.at(p + 1) != 0 and self.at(p + 1) != _RBRACKET
                )
                if not is_range and c == fn:
                    matched = True
                else:
                    cold = c
                    c = self.at(p)
                    p += 1
                    range_result = self._range(c, p, cold, fn)
                    if range_result is None:
                        return None
                    matched, c, p = range_result
            if matched:
                return self._skip_rest(p, negate)
            if c == _RBRACKET:
                break
        if not negate:
            return None
        return p

    def _range(self, c: int, p: int, cold: int, fn: int) -> tuple[bool, int, int] | None:
        """After a bracket member ``cold``: if ``c`` starts a range, test ``fn`` against it.

        Returns (matched, next c, next p), or None when the whole match fails.
        """
        if not (c == _DASH and self.at(p) != _RBRACKET):
            return False, c, p
        cend = self.at(p)
        p += 1
        if cend == _LBRACKET and self.at(p) == _DOT:
            startp = p
            length = 0
            while True:
                p += 1
                ch = self.at(p)
                if ch == _DOT and self.at(p + 1) == _RBRACKET:
                    p += 2
                    break
                if ch == 0:
                    return None
                length += 1
            if length != 1:
                return None
            cend = self.at(startp + 1)
        else:
            if cend == _BACKSLASH:
                cend = self.at(p)
                p += 1
            if cend == 0:
                return None
            cend = self.fold(cend)
        if cold <= fn <= cend:
            return True, c, p
        c = self.at(p)
        p += 1
        return False, c, p

    def _skip_rest(self, p: int, negate: bool) -> int | tuple[()] | None:
        """Skip the rest of a bracket that already matched; None = no match, () = the
        bracket is unterminated (then ``[`` is an ordinary character)."""
        while True:
            c = self.at(p)
            p += 1
            if c == _RBRACKET:
                break
            if c == 0:
                return ()
            if c == _BACKSLASH:
                if self.at(p) == 0:
                    return None
                p += 1
            elif c == _LBRACKET and self.at(p) == _COLON:
                length = 0
                startp = p
                while True:
                    p += 1
                    c = self.at(p)
                    length += 1
                    if length == _CHAR_CLASS_MAX_LENGTH:
                        return None
                    if self.at(p) == _COLON and self.at(p + 1) == _RBRACKET:
                        break
                    if c < _A_LOWER or c >= _Z_LOWER:
                        p = startp - 2
                        break
                p += 2
            elif c == _LBRACKET and self.at(p) == _EQUALS:
                p += 1
                c = self.at(p)
                if c == 0:
                    return None
                p += 1
                c = self.at(p)
                if c != _EQUALS or self.at(p + 1) != _RBRACKET:
                    return None
                p += 2
            elif c == _LBRACKET and self.at(p) == _DOT:
                while True:
                    p += 1
                    c = self.at(p)
                    if c == 0:
                        return None
                    if c == _DOT and self.at(p + 1) == _RBRACKET:
                        break
                p += 2
        if negate:
            return None
        return p


def fnmatch(pattern: bytes, string: bytes, *, casefold: bool = False) -> bool:
    """True if ``string`` matches the glob ``pattern`` exactly as glibc ``fnmatch`` does."""
    return _Matcher(pattern, string, casefold).fct(0, 0, None)
