"""Label selectors and field selectors, parsed from their query-string forms."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

JSON = dict[str, Any]


class SelectorError(ValueError):
    """A selector string that cannot be parsed (answered with 400 BadRequest)."""


@dataclass(frozen=True)
class LabelRequirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!", "gt", "lt"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        if self.op in ("=", "in"):
            return present and value in self.values
        if self.op in ("!=", "notin"):
            return not present or value not in self.values
        if self.op in ("gt", "lt"):
            if not present:
                return False
            try:
                have, want = int(str(value)), int(self.values[0])
            except ValueError:
                return False
            return have > want if self.op == "gt" else have < want
        raise AssertionError(self.op)


_KEY = r"[A-Za-z0-9](?:[-A-Za-z0-9_./]*[A-Za-z0-9])?"
_VALUE = r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_SET_RE = re.compile(rf"^\s*({_KEY})\s+(in|notin)\s*\(\s*(.*?)\s*\)\s*$")
_EQ_RE = re.compile(rf"^\s*({_KEY})\s*(==|=|!=)\s*({_VALUE})\s*$")
_CMP_RE = re.compile(rf"^\s*({_KEY})\s*([<>])\s*(-?\d+)\s*$")
_EXISTS_RE = re.compile(rf"^\s*(!?)\s*({_KEY})\s*$")
_VALUE_RE = re.compile(rf"^{_VALUE}$")


def _split_outside_parens(text: str) -> list[str]:
    parts: list[str] = []
    depth = 0
    current = ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise SelectorError(f"unable to parse requirement: unbalanced ')' in {text!r}")
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    if depth:
        raise SelectorError(f"unable to parse requirement: unbalanced '(' in {text!r}")
    parts.append(current)
    return parts


@dataclass(frozen=True)
class LabelSelector:
    requirements: tuple[LabelRequirement, ...] = ()

    @classmethod
    def parse(cls, text: str | None) -> LabelSelector:
        if text is None or not text.strip():
            return cls()
        reqs: list[LabelRequirement] = []
        for part in _split_outside_parens(text):
            if not part.strip():
                raise SelectorError(f"unable to parse requirement: empty requirement in {text!r}")
            reqs.append(_parse_label_requirement(part))
        return cls(tuple(reqs))

    def matches(self, labels: Mapping[str, str] | None) -> bool:
        labels = labels or {}
        return all(r.matches(labels) for r in self.requirements)

    def __bool__(self) -> bool:
        return bool(self.requirements)


def _parse_label_requirement(part: str) -> LabelRequirement:
    if m := _SET_RE.match(part):
        raw_values = [v.strip() for v in m.group(3).split(",")] if m.group(3).strip() else []
        for v in raw_values:
            if not _VALUE_RE.match(v):
                raise SelectorError(f"unable to parse requirement: invalid label value: {v!r}")
        if not raw_values and m.group(2) == "in":
            raise SelectorError(
                "unable to parse requirement: for 'in' operator, values set can't be empty"
            )
        return LabelRequirement(m.group(1), m.group(2), tuple(raw_values))
    if m := _EQ_RE.match(part):
        op = "!=" if m.group(2) == "!=" else "="
        return LabelRequirement(m.group(1), op, (m.group(3),))
    if m := _CMP_RE.match(part):
        return LabelRequirement(m.group(1), "gt" if m.group(2) == ">" else "lt", (m.group(3),))
    if m := _EXISTS_RE.match(part):
        return LabelRequirement(m.group(2), "!" if m.group(1) else "exists")
    raise SelectorError(f"unable to parse requirement: {part.strip()!r}")


@dataclass(frozen=True)
class FieldRequirement:
    path: str
    op: str  # "=" or "!="
    value: str

    def matches(self, obj: JSON) -> bool:
        have = field_value(obj, self.path)
        return (have == self.value) if self.op == "=" else (have != self.value)


def field_value(obj: JSON, path: str) -> str:
    """The string form of a dotted field path; missing fields read as ``""`` (so
    ``spec.nodeName=`` selects objects without a node, as for pods)."""
    current: Any = obj
    for part in path.split("."):
        if isinstance(current, dict) and part in current:
            current = current[part]
        else:
            return ""
    if current is None:
        return ""
    if isinstance(current, bool):
        return "true" if current else "false"
    if isinstance(current, str):
        return current
    if isinstance(current, int | float):
        return str(current)
    import json

    return json.dumps(current, separators=(",", ":"), sort_keys=True)


def _split_escaped(text: str, sep: str) -> list[str]:
    """Split on ``sep`` that is not preceded by a backslash; keep the escapes."""
    parts: list[str] = []
    current = ""
    escaped = False
    for ch in text:
        if escaped:
            current += "\\" + ch
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == sep:
            parts.append(current)
            current = ""
        else:
            current += ch
    if escaped:
        current += "\\"
    parts.append(current)
    return parts


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)


@dataclass(frozen=True)
class FieldSelector:
    requirements: tuple[FieldRequirement, ...] = ()

    @classmethod
    def parse(cls, text: str | None) -> FieldSelector:
        if text is None or not text.strip():
            return cls()
        reqs: list[FieldRequirement] = []
        for term in _split_escaped(text, ","):
            reqs.append(_parse_field_term(term))
        return cls(tuple(reqs))

    def matches(self, obj: JSON) -> bool:
        return all(r.matches(obj) for r in self.requirements)

    def __bool__(self) -> bool:
        return bool(self.requirements)

    def exact_name(self) -> str | None:
        """The name if the selector pins ``metadata.name`` (used for single-object watches)."""
        for r in self.requirements:
            if r.path == "metadata.name" and r.op == "=":
                return r.value
        return None


def _parse_field_term(term: str) -> FieldRequirement:
    # Find the first unescaped operator: "!=", "==" or "=".
    i = 0
    while i < len(term):
        ch = term[i]
        if ch == "\\":
            i += 2
            continue
        if term.startswith("!=", i):
            key, op, value = term[:i], "!=", term[i + 2 :]
            break
        if term.startswith("==", i):
            key, op, value = term[:i], "=", term[i + 2 :]
            break
        if ch == "=":
            key, op, value = term[:i], "=", term[i + 1 :]
            break
        i += 1
    else:
        raise SelectorError(f"invalid selector: '{term}'; can't understand '{term}'")
    key = key.strip()
    if not key:
        raise SelectorError(f"invalid selector: '{term}'; field label is empty")
    return FieldRequirement(_unescape(key), op, _unescape(value.strip()))
