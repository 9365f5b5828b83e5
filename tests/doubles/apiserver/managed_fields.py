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
manager, so no apply that omits it removes it.

``metadata.annotations`` and ``metadata.labels`` (each a ``map[string]string``, granular:
each key is a field of its own) are tracked per key the same way: an apply owns the keys it
sends and removes the keys it applied before and omits now unless another manager owns them
too; a plain write owns the keys it adds or changes (taking them from their former owners)
and a key it drops is nobody's.
An apply that changes the value of a key another manager owns is refused with 409 and a
``FieldManagerConflict`` cause for each, as structured-merge-diff does without ``force``
(:class:`ApplyConflict`). Other fields are not tracked: an apply merges them like a merge
patch and never removes them (docs/testing-apiserver-double.md, "What it does not do").
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
ANNOTATIONS: Path = ("metadata", "annotations")
LABELS: Path = ("metadata", "labels")


class ApplyConflict(Exception):
    """An apply would change fields other managers own: ``(manager, field path)`` each, the
    manager as the API server prints it (``"name"`` for an apply, ``"name" using <apiVersion>
    at <time>`` for a plain write: ``printManager``)."""

    def __init__(self, conflicts: list[tuple[str, str]]) -> None:
        self.conflicts = conflicts
        super().__init__(f"{len(conflicts)} conflict(s)")


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


def map_owners(obj: JSON | None, path: Path) -> dict[Owner, list[str]]:
    """Who owns which keys of the granular map at ``path``."""
    result: dict[Owner, list[str]] = {}
    for entry in ((obj or {}).get("metadata") or {}).get("managedFields") or []:
        node: Any = entry.get("fieldsV1") or {}
        for key in path:
            node = node.get(f"f:{key}") if isinstance(node, dict) else None
        if not isinstance(node, dict):
            continue
        keys = [k[2:] for k in node if k.startswith("f:")]
        if keys:
            result[(str(entry.get("manager")), str(entry.get("operation")))] = keys
    return result


def _with_owners(
    obj: JSON,
    sets: dict[Path, dict[Owner, list[Any]]],
    api_version: str,
    now: str,
    maps: dict[Path, dict[Owner, list[str]]] | None = None,
) -> None:
    """Write ``sets`` (and the ``maps``' keys) as ``metadata.managedFields`` (one entry per
    owner, sorted)."""
    entries: dict[Owner, JSON] = {}

    def entry_of(owner: Owner) -> JSON:
        return entries.setdefault(
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

    for path, by_owner in sets.items():
        for owner, values in by_owner.items():
            node = entry_of(owner)["fieldsV1"]
            for key in path:
                node = node.setdefault(f"f:{key}", {})
            for value in values:
                node[_element_key(value)] = {}
    for path, by_key_owner in (maps or {}).items():
        for owner, keys in by_key_owner.items():
            node = entry_of(owner)["fieldsV1"]
            for key in path:
                node = node.setdefault(f"f:{key}", {})
            for name in keys:
                node[f"f:{name}"] = {}
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
    maps: Iterable[Path] = (),
) -> JSON:
    """The object after ``manager`` applies ``patch`` (``current`` None: it is created).
    ``paths``: the set-typed lists, ``maps``: the granular maps whose keys have owners.
    Raises :class:`ApplyConflict`."""
    paths = list(paths)
    maps = list(maps)
    rest = copy.deepcopy(patch)
    rest.get("metadata", {}).pop("managedFields", None)
    for path in [*paths, *maps]:
        parent = _get(rest, path[:-1]) if len(path) > 1 else rest
        if isinstance(parent, dict):
            parent.pop(path[-1], None)
    result = merge_patch(current or {}, rest)
    owned_maps = _apply_maps(current, patch, result, manager, maps)
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
    _with_owners(result, sets, api_version, now, owned_maps)
    if current is not None:
        _keep_times(current, result)
    return result


def _printed(current: JSON | None, owner: Owner) -> str:
    """A manager as a conflict names it (upstream ``printManager``)."""
    name, operation = owner
    if operation != "Update":
        return f'"{name}"'
    for entry in ((current or {}).get("metadata") or {}).get("managedFields") or []:
        if (entry.get("manager"), entry.get("operation")) == owner:
            version, when = entry.get("apiVersion"), entry.get("time")
            return f'"{name}" using {version}' + (f" at {when}" if when else "")
    return f'"{name}"'


def _apply_maps(
    current: JSON | None,
    patch: JSON,
    result: JSON,
    manager: str,
    maps: list[Path],
) -> dict[Path, dict[Owner, list[str]]]:
    """Apply the granular maps of ``patch`` into ``result`` (in place); their new owners."""
    me: Owner = (manager, "Apply")
    owned: dict[Path, dict[Owner, list[str]]] = {}
    conflicts: list[tuple[str, str]] = []
    for path in maps:
        applied = dict(_get(patch, path) or {})
        by_owner = map_owners(current, path)
        before = by_owner.get(me, [])
        others = {k for owner, keys in by_owner.items() if owner != me for k in keys}
        present = dict(_get(current, path) or {}) if current is not None else {}
        for name, value in applied.items():
            if name in present and present[name] != value:
                conflicts += [
                    (_printed(current, owner), "." + ".".join((*path, name)))
                    for owner, keys in sorted(by_owner.items())
                    if owner != me and name in keys
                ]
        kept = {k: v for k, v in present.items() if k in applied or k not in before or k in others}
        kept.update(applied)
        parent = _get(result, path[:-1]) if len(path) > 1 else result
        if kept:
            _set(result, path, kept)
        elif isinstance(parent, dict):
            parent.pop(path[-1], None)  # an empty map is stored as absent
        by_owner[me] = list(applied)
        owned[path] = {o: keys for o, keys in by_owner.items() if keys}
    if conflicts:
        raise ApplyConflict(conflicts)
    return owned


def track_update(
    current: JSON | None,
    new: JSON,
    manager: str | None,
    paths: Iterable[Path],
    api_version: str,
    now: str,
    maps: Iterable[Path] = (),
) -> None:
    """Record in ``new`` (in place) the ownership after a plain write by ``manager``: elements
    it added are its own (operation ``Update``), elements it dropped are nobody's; map keys it
    added or changed are its own alone."""
    paths = list(paths)
    maps = list(maps)
    if not paths and not maps:
        return
    me: Owner = (manager or UNKNOWN_MANAGER, "Update")
    owned_maps: dict[Path, dict[Owner, list[str]]] = {}
    for path in maps:
        map_by_owner = map_owners(current, path)
        old_map = dict(_get(current, path) or {}) if current is not None else {}
        new_map = dict(_get(new, path) or {})
        changed = [k for k, v in new_map.items() if k not in old_map or old_map[k] != v]
        map_by_owner = {
            o: [k for k in keys if k in new_map and k not in changed]
            for o, keys in map_by_owner.items()
        }
        if changed:
            mine = map_by_owner.get(me, [])
            map_by_owner[me] = [*mine, *(k for k in changed if k not in mine)]
        owned_maps[path] = {o: keys for o, keys in map_by_owner.items() if keys}
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
    _with_owners(new, sets, api_version, now, owned_maps)
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
