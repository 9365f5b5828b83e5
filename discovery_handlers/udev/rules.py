"""Akri's ``udevRules``: parse one rule and match it against a device, as udev does.

A rule is a list of ``KEY==\"value\"`` / ``KEY!=\"value\"`` pairs separated by commas and/or
whitespace (udev's ``udev_rules_parse_file()`` line syntax). Only udev's *match* keys that Akri
supports are accepted::

    DEVPATH KERNEL SUBSYSTEM DRIVER ENV{name} ATTR{name} TAG          (the device itself)
    KERNELS SUBSYSTEMS DRIVERS ATTRS{name} TAGS                         (the device or a parent)

Anything else — assignments (``=``, ``+=``, ``-=``, ``:=``), keys such as ``RUN``, ``NAME``,
``PROGRAM``, ``IMPORT``, ``GOTO``, ``LABEL``, ``ACTION``, ``TEST`` — raises
:class:`RuleSyntaxError` naming the column and the offending token.

Matching follows ``src/udev/udev-rules.c``:

- a value is split at ``|`` into alternatives; an empty alternative matches the empty string;
- a value containing ``*``, ``?`` or ``[`` is a glob (glibc ``fnmatch(3)``, see
  :mod:`discovery_handlers.udev.glob`), otherwise it is compared literally;
- a missing property, subsystem or driver is the empty string; a missing sysfs attribute makes
  ``ATTR``/``ATTRS`` false whatever the operator; trailing whitespace of an attribute value is
  ignored unless the match value itself ends with whitespace;
- ``SUBSYSTEM==\"subsystem\"`` (or ``\"bus\"``, ``\"class\"``) matches any of the three words;
- ``TAG==\"x\"`` is true when some tag matches, ``TAG!=\"x\"`` when none does;
- the parent keys (``KERNELS``, ``SUBSYSTEMS``, ``DRIVERS``, ``ATTRS``, ``TAGS``) must all
  match on the **same** device: the device itself or one of its ancestors, tried from the
  device upwards.

Values are double-quoted; inside them ``\\\"`` is a quote and every other backslash is kept
(it escapes glob characters). ``e\"...\"`` values take C escapes (``\\n``, ``\\x41``, ``\\101``,
``\\u00e9``…), ``i\"...\"`` values match case-insensitively (udev ≥ 256), as in udev.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

from discovery_handlers.details import brief
from discovery_handlers.udev.glob import fnmatch, is_glob

DEVICE_KEYS = ("DEVPATH", "KERNEL", "SUBSYSTEM", "DRIVER", "ENV", "ATTR", "TAG")
PARENT_KEYS = ("KERNELS", "SUBSYSTEMS", "DRIVERS", "ATTRS", "TAGS")
SUPPORTED_KEYS = DEVICE_KEYS + PARENT_KEYS
KEYS_WITH_NAME = frozenset({"ENV", "ATTR", "ATTRS"})

# Keys udev knows that the discovery handler refuses (they act, or depend on an event).
UNSUPPORTED_UDEV_KEYS = frozenset(
    {
        "ACTION",
        "CONST",
        "GOTO",
        "GROUP",
        "IMPORT",
        "LABEL",
        "MODE",
        "NAME",
        "OPTIONS",
        "OWNER",
        "PROGRAM",
        "RESULT",
        "RUN",
        "SECLABEL",
        "SYMLINK",
        "SYSCTL",
        "TEST",
        "WAIT_FOR",
        "WAIT_FOR_SYSFS",
    }
)

MATCH = "=="
NOMATCH = "!="
ASSIGNMENT_OPERATORS = ("+=", "-=", ":=", "=")
_WHITESPACE = " \t\n\r"
_ATTR_TRAILING_WHITESPACE = b" \t\n\r\v\f"
_SUBSYSTEM_WORDS = (b"subsystem", b"bus", b"class")
_MAX_RULE_LENGTH = 16384  # udev's UDEV_LINE_SIZE


class RuleSyntaxError(ValueError):
    """A rule cannot be used. ``column`` is 1-based; ``token`` is the offending text."""

    def __init__(self, reason: str, *, column: int, token: str) -> None:
        self.reason = reason
        self.column = column
        self.token = token
        super().__init__(f"column {column}: {reason}: {brief(token)}")


class UdevDevice(Protocol):
    """What rule matching needs to know about a device (pyudev devices are adapted to this)."""

    @property
    def devpath(self) -> str:
        """The sysfs path below ``/sys``, e.g. ``/devices/virtual/net/lo``."""

    @property
    def kernel(self) -> str:
        """The kernel name (sysname), e.g. ``video0``."""

    @property
    def subsystem(self) -> str | None:
        """The subsystem, e.g. ``video4linux``; None if the device has none."""

    @property
    def driver(self) -> str | None:
        """The bound driver, e.g. ``uvcvideo``; None if none."""

    @property
    def tags(self) -> Collection[str]:
        """udev tags (from the udev database; empty without udevd)."""

    @property
    def parent(self) -> UdevDevice | None:
        """The parent device in the sysfs tree, or None at the top."""

    def property(self, name: str) -> str | None:
        """The udev property (``ENV{name}``), or None."""

    def attribute(self, name: str) -> bytes | None:
        """The sysfs attribute value with trailing newlines removed, or None if absent."""


def _encode(value: str) -> bytes:
    """Device strings as the C strings udev compares (bytes; cut at a NUL)."""
    return value.encode("utf-8", "surrogateescape").split(b"\0", 1)[0]


@dataclass(frozen=True)
class Match:
    """One ``KEY==\"value\"`` / ``KEY!=\"value\"`` pair of a rule."""

    key: str
    name: str | None
    negate: bool
    value: bytes
    case_insensitive: bool
    column: int
    text: str
    kind: str = field(init=False)
    invert: bool = field(init=False)
    alternatives: tuple[bytes, ...] = field(init=False)
    with_empty: bool = field(init=False)
    strip_trailing_whitespace: bool = field(init=False)

    def __post_init__(self) -> None:
        value = self.value
        negate = self.negate
        if self.key == "SUBSYSTEM" and value in _SUBSYSTEM_WORDS:
            kind = "subsystem"
        elif value == b"":
            kind = "empty"
        elif value == b"?*":
            # udev converts KEY=="?*" into KEY!="" (and KEY!="?*" into KEY=="")
            kind = "empty"
            negate = not negate
        elif is_glob(value):
            kind = "glob"
        else:
            kind = "plain"
        parts = value.split(b"|")
        alternatives = tuple(part for part in parts if part)
        with_empty = any(part == b"" for part in parts)
        object.__setattr__(self, "invert", negate)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "alternatives", alternatives)
        object.__setattr__(self, "with_empty", with_empty)
        # udev looks at the last character of the first non-empty alternative
        first = alternatives[0] if alternatives else b""
        object.__setattr__(
            self,
            "strip_trailing_whitespace",
            bool(first) and first[-1:] not in (b" ", b"\t", b"\n", b"\r", b"\v", b"\f"),
        )

    @property
    def is_parent_key(self) -> bool:
        """True for the keys that may match on an ancestor (KERNELS, ATTRS, …)."""
        return self.key in PARENT_KEYS

    def _matches_string(self, value: bytes) -> bool:
        """udev's ``token_match_string()`` without the operator."""
        folded = value.lower() if self.case_insensitive else value
        if self.kind == "empty":
            return value == b""
        if self.kind == "subsystem":
            return folded in _SUBSYSTEM_WORDS
        if self.with_empty and value == b"":
            return True
        if self.kind == "plain":
            if self.case_insensitive:
                return any(folded == alt.lower() for alt in self.alternatives)
            return value in self.alternatives
        return any(fnmatch(alt, value, casefold=self.case_insensitive) for alt in self.alternatives)

    def _test(self, value: bytes) -> bool:
        return self._matches_string(value) != self.invert

    def evaluate(self, device: UdevDevice) -> bool:
        """This pair on ``device`` alone (no parent walking)."""
        key = self.key
        if key == "DEVPATH":
            return self._test(_encode(device.devpath))
        if key in ("KERNEL", "KERNELS"):
            return self._test(_encode(device.kernel))
        if key in ("SUBSYSTEM", "SUBSYSTEMS"):
            return self._test(_encode(device.subsystem or ""))
        if key in ("DRIVER", "DRIVERS"):
            return self._test(_encode(device.driver or ""))
        if key == "ENV":
            assert self.name is not None
            return self._test(_encode(device.property(self.name) or ""))
        if key in ("ATTR", "ATTRS"):
            assert self.name is not None
            raw = device.attribute(self.name)
            if raw is None:
                return False  # a missing attribute never matches, whatever the operator
            raw = raw.split(b"\0", 1)[0]
            if self.strip_trailing_whitespace:
                raw = raw.rstrip(_ATTR_TRAILING_WHITESPACE)
            return self._test(raw)
        # TAG / TAGS: true for == when some tag matches, for != when none does
        for tag in device.tags:
            if self._matches_string(_encode(tag)):
                return not self.invert
        return self.invert


@dataclass(frozen=True)
class Rule:
    """A parsed rule: device keys match the device; parent keys one common ancestor-or-self."""

    text: str
    matches: tuple[Match, ...]
    device_matches: tuple[Match, ...] = field(init=False, repr=False, compare=False)
    parent_matches: tuple[Match, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "device_matches", tuple(m for m in self.matches if not m.is_parent_key)
        )
        object.__setattr__(
            self, "parent_matches", tuple(m for m in self.matches if m.is_parent_key)
        )

    def matches_device(self, device: UdevDevice) -> bool:
        """True if ``device`` satisfies every pair of the rule (udev semantics)."""
        for match in self.device_matches:
            if not match.evaluate(device):
                return False
        parent_matches = self.parent_matches
        if not parent_matches:
            return True
        node: UdevDevice | None = device
        while node is not None:
            if all(match.evaluate(node) for match in parent_matches):
                return True
            node = node.parent
        return False


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def _token_at(text: str, pos: int) -> str:
    """The text from ``pos`` up to the next separator (for error messages)."""
    end = pos
    while end < len(text) and text[end] not in _WHITESPACE + ",":
        end += 1
    return text[pos:end] if end > pos else text[pos : pos + 1]


_SIMPLE_ESCAPES = {
    "a": 0x07,
    "b": 0x08,
    "f": 0x0C,
    "n": 0x0A,
    "r": 0x0D,
    "t": 0x09,
    "v": 0x0B,
    "\\": 0x5C,
    '"': 0x22,
    "'": 0x27,
    "s": 0x20,
}
_HEX = "0123456789abcdefABCDEF"


def _c_unescape(content: str, start: int) -> bytes:
    """systemd's ``cunescape()`` (no flags) of an ``e\"...\"`` value; ``start`` = its column."""
    out = bytearray()
    index = 0
    while index < len(content):
        char = content[index]
        if char != "\\":
            out += char.encode("utf-8", "surrogateescape")
            index += 1
            continue
        column = start + index
        if index + 1 >= len(content):
            raise RuleSyntaxError("incomplete escape sequence", column=column, token="\\")
        code = content[index + 1]
        if code in _SIMPLE_ESCAPES:
            out.append(_SIMPLE_ESCAPES[code])
            index += 2
        elif code == "x":
            digits = content[index + 2 : index + 4]
            if len(digits) != 2 or any(d not in _HEX for d in digits) or int(digits, 16) == 0:
                raise RuleSyntaxError(
                    "invalid \\x escape (two hex digits, not 00)",
                    column=column,
                    token=content[index : index + 4],
                )
            out.append(int(digits, 16))
            index += 4
        elif code in ("u", "U"):
            width = 4 if code == "u" else 8
            digits = content[index + 2 : index + 2 + width]
            value = (
                int(digits, 16) if len(digits) == width and all(d in _HEX for d in digits) else -1
            )
            if value <= 0 or value > 0x10FFFF or 0xD800 <= value <= 0xDFFF:
                raise RuleSyntaxError(
                    f"invalid \\{code} escape ({width} hex digits, a valid non-NUL code point)",
                    column=column,
                    token=content[index : index + 2 + width],
                )
            out += chr(value).encode()
            index += 2 + width
        elif code in "01234567":
            digits = content[index + 1 : index + 4]
            if len(digits) != 3 or any(d not in "01234567" for d in digits):
                raise RuleSyntaxError(
                    "invalid octal escape (three octal digits)",
                    column=column,
                    token=content[index : index + 4],
                )
            value = int(digits, 8)
            if value == 0 or value > 255:
                raise RuleSyntaxError(
                    "invalid octal escape (1-377)", column=column, token=content[index : index + 4]
                )
            out.append(value)
            index += 4
        else:
            raise RuleSyntaxError(
                "unknown escape sequence", column=column, token=content[index : index + 2]
            )
    return bytes(out)


def _parse_value(text: str, pos: int) -> tuple[bytes, bool, int]:
    """udev's ``udev_rule_parse_value()``: (value, case_insensitive, position after it)."""
    start = pos
    escaped = False
    case_insensitive = False
    while pos < len(text) and text[pos] != '"' and pos < start + 2:
        if text[pos] == "e" and not escaped:
            escaped = True
        elif text[pos] == "i" and not case_insensitive:
            case_insensitive = True
        else:
            break
        pos += 1
    if pos >= len(text) or text[pos] != '"':
        raise RuleSyntaxError(
            'the value must be a double-quoted string (e.g. "video0")',
            column=start + 1,
            token=_token_at(text, start) if start < len(text) else "<end of rule>",
        )
    content_start = pos + 1
    index = content_start
    if escaped:
        while index < len(text) and text[index] != '"':
            index += 2 if text[index] == "\\" else 1
        if index >= len(text):
            raise RuleSyntaxError("unterminated string", column=pos + 1, token=text[pos:])
        value = _c_unescape(text[content_start:index], content_start + 1)
    else:
        chars: list[str] = []
        while index < len(text) and text[index] != '"':
            if text[index] == "\\" and index + 1 < len(text) and text[index + 1] == '"':
                index += 1
            chars.append(text[index])
            index += 1
        if index >= len(text):
            raise RuleSyntaxError("unterminated string", column=pos + 1, token=text[pos:])
        value = "".join(chars).encode("utf-8", "surrogateescape")
    return value, case_insensitive, index + 1


def _operator_at(text: str, pos: int) -> str | None:
    for operator in (MATCH, NOMATCH, "+=", "-=", ":=", "="):
        if text.startswith(operator, pos):
            return operator
    return None


def _check_key(key: str, name: str | None, token: str, column: int, name_column: int) -> None:
    if key not in SUPPORTED_KEYS:
        if key in UNSUPPORTED_UDEV_KEYS:
            raise RuleSyntaxError(
                f"udev key {key} is not supported: discovery rules may only use the match "
                f"keys {', '.join(_display_key(k) for k in SUPPORTED_KEYS)}",
                column=column,
                token=token,
            )
        raise RuleSyntaxError(
            f"unknown key {brief(key)} (supported: "
            f"{', '.join(_display_key(k) for k in SUPPORTED_KEYS)})",
            column=column,
            token=token,
        )
    if key in KEYS_WITH_NAME:
        if not name:
            raise RuleSyntaxError(
                f"{key} needs a name in braces, e.g. {key}{{idVendor}}",
                column=column,
                token=token,
            )
        if key != "ENV" and (name.startswith("[") or "%" in name or "$" in name):
            raise RuleSyntaxError(
                f"substitutions in {key}{{}} names are not supported",
                column=name_column,
                token=name,
            )
    elif name is not None:
        raise RuleSyntaxError(f"{key} takes no {{name}}", column=column, token=token)


def _display_key(key: str) -> str:
    return f"{key}{{}}" if key in KEYS_WITH_NAME else key


def parse_rule(text: str) -> Rule:
    """Parse one Akri ``udevRules`` entry; raises :class:`RuleSyntaxError`."""
    if not isinstance(text, str):
        raise RuleSyntaxError("a rule must be a string", column=1, token=repr(text))
    if "\0" in text:
        position = text.index("\0")
        raise RuleSyntaxError("NUL character in rule", column=position + 1, token="\\0")
    if len(text) > _MAX_RULE_LENGTH:
        raise RuleSyntaxError(
            f"rule longer than {_MAX_RULE_LENGTH} characters",
            column=_MAX_RULE_LENGTH + 1,
            token=text[_MAX_RULE_LENGTH : _MAX_RULE_LENGTH + 20],
        )
    matches: list[Match] = []
    pos = 0
    while True:
        pos = _skip(text, pos, _WHITESPACE + ",")
        if pos >= len(text):
            break
        key_start = pos
        # udev: the key ends at whitespace, '=', '{' or an operator ("+=", "-=", "!=", ":=")
        while pos < len(text):
            char = text[pos]
            if char in _WHITESPACE + "={":
                break
            if char in "+-!:" and text.startswith("=", pos + 1):
                break
            pos += 1
        key = text[key_start:pos]
        if pos >= len(text):
            raise RuleSyntaxError(
                'incomplete pair: expected KEY=="value" or KEY!="value"',
                column=key_start + 1,
                token=text[key_start:],
            )
        name: str | None = None
        name_column = 0
        if text[pos] == "{":
            close = text.find("}", pos + 1)
            if close < 0:
                raise RuleSyntaxError(
                    "unterminated '{' in key", column=pos + 1, token=text[key_start:]
                )
            name = text[pos + 1 : close]
            name_column = pos + 2
            pos = close + 1
        if not key:
            raise RuleSyntaxError(
                "missing key before operator",
                column=key_start + 1,
                token=_token_at(text, key_start),
            )
        key_text = text[key_start:pos]
        pos = _skip(text, pos, _WHITESPACE)
        operator_column = pos + 1
        operator = _operator_at(text, pos)
        if operator is None:
            raise RuleSyntaxError(
                "expected an operator (== or !=)",
                column=pos + 1,
                token=_token_at(text, pos) if pos < len(text) else "<end of rule>",
            )
        pos = _skip(text, pos + len(operator), _WHITESPACE)
        value, case_insensitive, pos = _parse_value(text, pos)
        token = text[key_start:pos]
        _check_key(key, name, key_text, key_start + 1, name_column)
        if operator not in (MATCH, NOMATCH):
            raise RuleSyntaxError(
                f"operator {operator} in {token} is an assignment; discovery rules may only "
                "use == and !=",
                column=operator_column,
                token=operator,
            )
        matches.append(
            Match(
                key=key,
                name=name,
                negate=operator == NOMATCH,
                value=value,
                case_insensitive=case_insensitive,
                column=key_start + 1,
                text=token,
            )
        )
    if not matches:
        raise RuleSyntaxError(
            'empty rule: it needs at least one KEY=="value"', column=1, token=text
        )
    return Rule(text=text, matches=tuple(matches))
