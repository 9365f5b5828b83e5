"""Patch algorithms: JSON merge patch (RFC 7386), JSON patch (RFC 6902) and a small
strategic-merge-patch approximation (merge patch plus the common ``$patch`` directives and
merge keys of the built-in list fields)."""

from __future__ import annotations

import copy
from typing import Any

JSON = dict[str, Any]


class PatchError(ValueError):
    """A patch that cannot be applied (answered with 422 Invalid / 400 BadRequest)."""


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, ``null`` deletes, everything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# Merge keys of list fields of the built-in kinds, as declared by ``patchMergeKey`` in the
# Kubernetes API types. Lists not named here are replaced wholesale, like in a merge patch.
MERGE_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "env": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "ports": "containerPort",
    "conditions": "type",
    "ownerReferences": "uid",
    "imagePullSecrets": "name",
    "hostAliases": "ip",
    "taints": "key",
}
# Primitive lists that strategic merge patch merges (set semantics) instead of replacing.
MERGED_PRIMITIVE_LISTS: frozenset[str] = frozenset({"finalizers"})


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """An approximation of Kubernetes strategic merge patch, good enough for what kubectl
    and client libraries send for the built-in kinds."""
    return _smp(target, patch)


def _smp(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if directive == "delete":
        return None
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    retain = patch.get("$retainKeys")
    for key, value in patch.items():
        if key.startswith("$setElementOrder/") or key in ("$patch", "$retainKeys"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            if isinstance(result.get(field), list) and isinstance(value, list):
                result[field] = [v for v in result[field] if v not in value]
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list):
            result[key] = _smp_list(key, result.get(key), value)
        else:
            merged = _smp(result.get(key), value)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
    if isinstance(retain, list):
        for key in list(result):
            if key not in retain:
                del result[key]
    return result


def _smp_list(field: str, current: Any, patch: list[Any]) -> list[Any]:
    merge_key = MERGE_KEYS.get(field)
    if field in MERGED_PRIMITIVE_LISTS and isinstance(current, list):
        out = list(current)
        out.extend(v for v in patch if v not in out)
        return out
    if (
        merge_key is None
        or not isinstance(current, list)
        or not all(isinstance(v, dict) for v in patch)
    ):
        return [v for v in copy.deepcopy(patch) if not (isinstance(v, dict) and "$patch" in v)]
    out = copy.deepcopy(current)
    for item in patch:
        if item.get("$patch") == "replace" and len(item) == 1:
            return [v for v in copy.deepcopy(patch) if v != item]
        key_value = item.get(merge_key)
        index = next(
            (i for i, v in enumerate(out) if isinstance(v, dict) and v.get(merge_key) == key_value),
            None,
        )
        if item.get("$patch") == "delete":
            if index is not None:
                del out[index]
        elif index is None:
            out.append({k: v for k, v in copy.deepcopy(item).items() if k != "$patch"})
        else:
            out[index] = _smp(out[index], item)
    return out


# --- RFC 6902 -----------------------------------------------------------------------------


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"invalid JSON pointer: {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _index(container: list[Any], token: str, *, for_add: bool) -> int:
    if token == "-" and for_add:
        return len(container)
    if not token.isdigit() or (len(token) > 1 and token.startswith("0")):
        raise PatchError(f"invalid array index: {token!r}")
    i = int(token)
    limit = len(container) if for_add else len(container) - 1
    if i > limit:
        raise PatchError(f"array index out of bounds: {i}")
    return i


def _parent(doc: Any, tokens: list[str], path: str) -> Any:
    current = doc
    for token in tokens[:-1]:
        if isinstance(current, dict):
            if token not in current:
                raise PatchError(f"doc is missing path: {path!r}")
            current = current[token]
        elif isinstance(current, list):
            current = current[_index(current, token, for_add=False)]
        else:
            raise PatchError(f"doc is missing path: {path!r}")
    return current


def _get(doc: Any, path: str) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return doc
    parent = _parent(doc, tokens, path)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"doc is missing path: {path!r}")
        return parent[last]
    if isinstance(parent, list):
        return parent[_index(parent, last, for_add=False)]
    raise PatchError(f"doc is missing path: {path!r}")


def _add(doc: Any, path: str, value: Any) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return value
    parent = _parent(doc, tokens, path)
    last = tokens[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, last, for_add=True), value)
    else:
        raise PatchError(f"doc is missing path: {path!r}")
    return doc


def _remove(doc: Any, path: str) -> tuple[Any, Any]:
    tokens = _pointer(path)
    if not tokens:
        raise PatchError("cannot remove the whole document")
    parent = _parent(doc, tokens, path)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"unable to remove nonexistent key: {last}: missing value")
        return doc, parent.pop(last)
    if isinstance(parent, list):
        return doc, parent.pop(_index(parent, last, for_add=False))
    raise PatchError(f"doc is missing path: {path!r}")


def json_equal(a: Any, b: Any) -> bool:
    """JSON value equality (``true`` is not ``1``, ``1`` equals ``1.0``)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def json_patch(target: Any, operations: Any) -> Any:
    """Apply an RFC 6902 operation list to a copy of ``target``."""
    if not isinstance(operations, list):
        raise PatchError("a JSON patch must be a list of operations")
    doc = copy.deepcopy(target)
    for op in operations:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise PatchError(f"invalid JSON patch operation: {op!r}")
        kind, path = op["op"], op["path"]
        if kind in ("add", "replace", "test") and "value" not in op:
            raise PatchError(f"missing value for {kind} operation on {path!r}")
        if kind == "add":
            doc = _add(doc, path, copy.deepcopy(op["value"]))
        elif kind == "remove":
            doc, _ = _remove(doc, path)
        elif kind == "replace":
            _get(doc, path)  # must exist
            if _pointer(path):
                doc, _ = _remove(doc, path)
            doc = _add(doc, path, copy.deepcopy(op["value"]))
        elif kind == "move":
            source = op.get("from")
            if not isinstance(source, str):
                raise PatchError("missing 'from' for move operation")
            doc, value = _remove(doc, source)
            doc = _add(doc, path, value)
        elif kind == "copy":
            source = op.get("from")
            if not isinstance(source, str):
                raise PatchError("missing 'from' for copy operation")
            doc = _add(doc, path, copy.deepcopy(_get(doc, source)))
        elif kind == "test":
            try:
                current = _get(doc, path)
            except PatchError as exc:
                raise PatchError(f"testing value {path} failed: {exc}") from exc
            if not json_equal(current, op["value"]):
                raise PatchError(f"testing value {path} failed: test failed")
        else:
            raise PatchError(f"unexpected operation {kind!r}")
    return doc
