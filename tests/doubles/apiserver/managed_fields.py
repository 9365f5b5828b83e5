"""Field ownership (``metadata.managedFields``) of set-typed lists, as server-side apply keeps it.

A list declared ``x-kubernetes-list-type: set`` in a CRD schema is merged per element: each
element is owned by the managers that applied it (operation ``Apply``) or added it with a
plain write (operation ``Update``: create, PUT, merge/JSON patch). What the real server does,
reduced to those lists (structured-merge-diff's set semantics):

* an apply by manager M sets M's applied elements to exactly the ones it sends; elements it
  applied before and omits now are removed from the object unless another manager owns them
  too; elements it sends that are missing are appended; no resourceVersion is needed and two
  managers applying different elements never conflict (an element is its own key);
* a plain write owns the elements it adds for its manager (``fieldManager``, else
  ``unknown``) and removes the elements it drops from every manager's ownership;
* ownership is reported in ``metadata.managedFields`` in the FieldsV1 form
  (``{"f:spec": {"f:nodes": {"v:\\"node-a\\"": {}}}}``); a client's own ``managedFields`` in a
  write body are ignored (as a nil list is on the real server).

``metadata.finalizers`` is one of these lists on every object (``+listType=set`` in
ObjectMeta; a CRD's schema cannot change it): an apply adds and drops finalizers as elements of
a set, and a finalizer a plain write added (a create, a PUT) stays owned by that write's
manager, so no apply that omits it removes it. Other fields are not tracked: an apply merges
them like a merge patch and never removes them (docs/testing-apiserver-double.md, "What it
does not do").
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from typing import Any

from tests.doubles.apiserver.patches import merge_patch

JSON = dict[str, Any]
Path = tuple[str, ...]
Owner = tuple[str, str]  # (manager, operation)
UNKNOWN_MANAGER = "unknown"
FINALIZERS: Path = ("metadata", "finalizers")


def set_list_paths(schema: JSON | None) -> list[Path]:
    """Paths (through object properties) of the lists a structural schema declares as sets."""
    found: list[Path] = []

    def walk(node: Any, path: Path) -> None:
        if not isinstance(node, dict):
            return
        if node.get("type") == "array" and node.get("x-kubernetes-list-type") == "set":
            found.append(path)
            return
        for key, sub in (node.get("properties") or {}).items():
            walk(sub, (*path, key))

    walk(schema or {}, ())
    return found


def _get(obj: Any, path: Path) -> Any:
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def _set(obj: JSON, path: Path, value: Any) -> None:
    for key in path[:-1]:
        obj = obj.setdefault(key, {})
    obj[path[-1]] = value


def _element_key(value: Any) -> str:
    return "v:" + json.dumps(value, separators=(",", ":"), sort_keys=True)


def owners(obj: JSON, path: Path) -> dict[Owner, list[Any]]:
    """Who owns which elements of the set at ``path`` (from ``metadata.managedFields``)."""
    result: dict[Owner, list[Any]] = {}
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        fields = entry.get("fieldsV1") or {}
        node: Any = fields
        for key in path:
            node = node.get(f"f:{key}") if isinstance(node, dict) else None
        if not isinstance(node, dict):
            continue
        values = [json.loads(k[2:]) for k in node if k.startswith("v:")]
        result[(str(entry.get("manager")), str(entry.get("operation")))] = values
    return result


def _with_owners(
    obj: JSON, sets: dict[Path, dict[Owner, list[Any]]], api_version: str, now: str
) -> None:
    """Write ``sets`` as ``metadata.managedFields`` (one entry per owner, sorted)."""
    entries: dict[Owner, JSON] = {}
    for path, by_owner in sets.items():
        for owner, values in by_owner.items():
            entry = entries.setdefault(
                owner,
                {
                    "manager": owner[0],
                    "operation": owner[1],
                    "apiVersion": api_version,
                    "time": now,
                    "fieldsType": "FieldsV1",
                    "fieldsV1": {},
                },
            )
            node = entry["fieldsV1"]
            for key in path:
                node = node.setdefault(f"f:{key}", {})
            for value in values:
                node[_element_key(value)] = {}
    meta = obj.setdefault("metadata", {})
    if entries:
        meta["managedFields"] = [entries[o] for o in sorted(entries)]
    else:
        meta.pop("managedFields", None)


def apply(
    current: JSON | None,
    patch: JSON,
    manager: str,
    paths: Iterable[Path],
    api_version: str,
    now: str,
) -> JSON:
    """The object after ``manager`` applies ``patch`` (``current`` None: it is created)."""
    paths = list(paths)
    rest = copy.deepcopy(patch)
    rest.get("metadata", {}).pop("managedFields", None)
    for path in paths:
        parent = _get(rest, path[:-1]) if len(path) > 1 else rest
        if isinstance(parent, dict):
            parent.pop(path[-1], None)
    result = merge_patch(current or {}, rest)
    sets: dict[Path, dict[Owner, list[Any]]] = {}
    me: Owner = (manager, "Apply")
    for path in paths:
        applied = list(_get(patch, path) or [])
        by_owner = owners(current, path) if current is not None else {}
        before = by_owner.get(me, [])
        others = [v for owner, values in by_owner.items() if owner != me for v in values]
        present = list(_get(current, path) or []) if current is not None else []
        kept = [v for v in present if v in applied or v not in before or v in others]
        kept += [v for v in applied if v not in kept]
        if current is not None or applied or _get(patch, path) is not None:
            _set(result, path, kept)
        by_owner[me] = applied
        sets[path] = {o: v for o, v in by_owner.items() if v}
    _with_owners(result, sets, api_version, now)
    if current is not None:
        _keep_times(current, result)
    return result


def track_update(
    current: JSON | None,
    new: JSON,
    manager: str | None,
    paths: Iterable[Path],
    api_version: str,
    now: str,
) -> None:
    """Record in ``new`` (in place) the ownership after a plain write by ``manager``: elements
    it added are its own (operation ``Update``), elements it dropped are nobody's."""
    paths = list(paths)
    if not paths:
        return
    me: Owner = (manager or UNKNOWN_MANAGER, "Update")
    sets: dict[Path, dict[Owner, list[Any]]] = {}
    for path in paths:
        by_owner = owners(current, path) if current is not None else {}
        before = list(_get(current, path) or []) if current is not None else []
        after = list(_get(new, path) or [])
        by_owner = {o: [v for v in values if v in after] for o, values in by_owner.items()}
        added = [v for v in after if v not in before]
        if added:
            mine = by_owner.get(me, [])
            by_owner[me] = [*mine, *(v for v in added if v not in mine)]
        sets[path] = {o: v for o, v in by_owner.items() if v}
    _with_owners(new, sets, api_version, now)
    if current is not None:
        _keep_times(current, new)


def _keep_times(current: JSON, new: JSON) -> None:
    """An ownership entry that did not change keeps its time: a write that changes nothing
    stays a no-op (no new resourceVersion, no watch event)."""
    before = {
        (str(e.get("manager")), str(e.get("operation"))): e
        for e in (current.get("metadata") or {}).get("managedFields") or []
    }
    for entry in (new.get("metadata") or {}).get("managedFields") or []:
        old = before.get((entry["manager"], entry["operation"]))
        if old is not None and old.get("fieldsV1") == entry["fieldsV1"]:
            entry["time"] = old.get("time")
