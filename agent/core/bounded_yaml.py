"""Bounded YAML loading, and short values and suggestions for messages: for every YAML text
users give (local Configuration files, kubeconfigs, handlers' ``discoveryDetails``).

YAML from users is bounded before it is turned into objects: a size limit, and a limit on the
number of nodes once aliases are expanded. PyYAML shares aliased objects, so a few hundred
bytes of nested anchors load quickly — but anything that walks or prints the result (a
validation message, a device list) expands them: 504 bytes made an 80 MB error message and
blocked the agent for seconds. Values quoted in messages go through :func:`brief`.

Standard library and PyYAML only: the discovery handlers use it too (through
``discovery_handlers/details.py``), so it imports nothing else of the agent.
"""

from __future__ import annotations

import difflib
import reprlib
from collections.abc import Iterable, Iterator
from typing import Any

import yaml

# libyaml's parser where PyYAML was built with it: 12x faster (a 1,000-device debugEcho
# list: 5.6 ms instead of 67 ms, parsed on the event loop); the same safe constructor
_SAFE_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

MAX_DETAILS_BYTES = 256 * 1024
MAX_EXPANDED_NODES = 100_000  # scalars, sequences and mappings after alias expansion

_BRIEF = reprlib.Repr()
_BRIEF.maxlevel = 3
_BRIEF.maxstring = 80
_BRIEF.maxother = 80
_BRIEF.maxlist = _BRIEF.maxtuple = _BRIEF.maxset = _BRIEF.maxdict = 8


def brief(value: Any) -> str:
    """A short ``repr`` of ``value`` for messages (nested, long or aliased values cut)."""
    return _BRIEF.repr(value)


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """``"; did you mean 'X'?"`` for the known word closest to ``word``, or ``""`` (a misspelt
    field, flag or value: the message says what was probably meant)."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


class YamlLimitError(ValueError):
    """YAML text over the size or alias-expansion limits."""


def yaml_problem(error: yaml.YAMLError) -> str:
    """One line: what is wrong and where (line/column), without PyYAML's multi-line dump."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return " ".join(f"{problem}{where}".split())[:300]


def _expanded_size(node: yaml.Node, memo: dict[int, int], limit: int) -> int:
    """Nodes under ``node`` counting every alias as a copy (memoized per node; capped)."""
    known = memo.get(id(node))
    if known is not None:
        return known
    memo[id(node)] = limit + 1  # a cycle counts as too big
    total = 1
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            total += _expanded_size(item, memo, limit)
            if total > limit:
                break
    elif isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            total += _expanded_size(key, memo, limit) + _expanded_size(value, memo, limit)
            if total > limit:
                break
    memo[id(node)] = min(total, limit + 1)
    return memo[id(node)]


def safe_load_all_limited(
    text: str, *, max_bytes: int = MAX_DETAILS_BYTES, max_nodes: int = MAX_EXPANDED_NODES
) -> Iterator[Any]:
    """``yaml.safe_load_all`` that raises :class:`YamlLimitError` for text over ``max_bytes``
    or a document over ``max_nodes`` nodes once aliases are expanded (and ``yaml.YAMLError``
    for bad YAML)."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise YamlLimitError(f"{size} bytes is more than the limit of {max_bytes}")
    loader = _SAFE_LOADER(text)
    try:
        while loader.check_node():
            node = loader.get_node()
            if node is None:
                continue
            if _expanded_size(node, {}, max_nodes) > max_nodes:
                raise YamlLimitError(
                    f"more than {max_nodes} values once its aliases (*) are expanded"
                )
            yield loader.construct_document(node)
    finally:
        loader.dispose()
