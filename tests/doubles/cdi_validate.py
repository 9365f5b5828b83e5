"""A CDI spec validator: what a container runtime's CDI cache would reject when loading a spec.

:func:`validate_cdi_spec` returns a list of problems (empty = valid), each naming the field
(``devices[0].containerEdits.deviceNodes[1].path: ...``). It follows the reference
(``k8s-device-apis.md`` §6) and the rules of cncf-tags/container-device-interface
(``specs-go/version.go``, ``pkg/cdi/producer/validator``, ``pkg/parser``):

* ``cdiVersion`` is required and must be a released spec version from 0.3.0 to 1.1.0
  (0.3.0, 0.4.0, 0.5.0, 0.6.0, 0.7.0, 0.8.0, 1.0.0, 1.1.0), at least the minimum version the
  used fields need: mount ``type`` 0.4.0; deviceNode ``hostPath`` and device names starting
  with a digit 0.5.0; ``annotations`` and a ``.`` in the class 0.6.0; ``intelRdt`` and
  ``additionalGids`` 0.7.0; ``netDevices`` and intelRdt ``schemata``/``enableMonitoring``
  1.1.0 (while intelRdt ``enableCMT``/``enableMBM`` are rejected from 1.1.0 on).
* ``kind`` is ``<vendor>/<class>``: the vendor a DNS subdomain (≤253) that also passes the CDI
  parser (starts with a letter), the class ≤63 characters of alphanumerics with ``-_.`` inside,
  starting with a letter (CDI parser) and ending with an alphanumeric.
* At least one device; names start and end with an alphanumeric, with ``_ . : -`` inside;
  unique; each device has non-empty ``containerEdits``.
* Only known fields anywhere (loading uses strict decoding); field types are checked.
* ``env`` entries are ``NAME=value``; deviceNodes need an absolute ``path``, an absolute
  ``hostPath`` if set, ``permissions`` made of ``r``/``w``/``m`` (or ``none``), ``type`` in
  ``b c u p``; mounts need absolute ``hostPath``/``containerPath``; hooks a known ``hookName``
  (``prestart`` is still accepted by the library), an absolute ``path``, ``NAME=value`` env and
  a positive ``timeout``; netDevices need ``hostInterfaceName`` and ``name``; annotation keys
  must be valid Kubernetes qualified names.

Not checked: whether paths exist on the host, major/minor numbers against the host, and the
runtime's conflict resolution between spec files.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

KNOWN_VERSIONS: tuple[str, ...] = (
    "0.3.0",
    "0.4.0",
    "0.5.0",
    "0.6.0",
    "0.7.0",
    "0.8.0",
    "1.0.0",
    "1.1.0",
)
CURRENT_VERSION = "1.1.0"

TOP_LEVEL_FIELDS = frozenset({"cdiVersion", "kind", "annotations", "devices", "containerEdits"})
DEVICE_FIELDS = frozenset({"name", "annotations", "containerEdits"})
EDIT_FIELDS = frozenset(
    {"env", "deviceNodes", "mounts", "hooks", "additionalGids", "intelRdt", "netDevices"}
)
DEVICE_NODE_FIELDS = frozenset(
    {"path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"}
)
MOUNT_FIELDS = frozenset({"hostPath", "containerPath", "options", "type"})
HOOK_FIELDS = frozenset({"hookName", "path", "args", "env", "timeout"})
NET_DEVICE_FIELDS = frozenset({"hostInterfaceName", "name"})
INTEL_RDT_FIELDS = frozenset(
    {
        "closID",
        "l3CacheSchema",
        "memBwSchema",
        "enableCMT",
        "enableMBM",
        "schemata",
        "enableMonitoring",
    }
)
HOOK_NAMES = frozenset(
    {"prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"}
)
DEVICE_NODE_TYPES = frozenset({"b", "c", "u", "p"})

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN_RE = re.compile(rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*$")
_CDI_VENDOR_CLASS_RE = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_CLASS_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_DEVICE_NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
_QUALIFIED_NAME_PART_RE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def _at_least(declared: str | None, needed: str) -> bool:
    """True when the declared version allows a feature of ``needed`` (unknown: don't report)."""
    if declared is None:
        return True
    return _version_key(declared) >= _version_key(needed)


def vendor_errors(vendor: str) -> list[str]:
    """Problems with the vendor part of a kind / qualified name."""
    problems = []
    if not vendor:
        return ["empty vendor"]
    if len(vendor) > 253:
        problems.append(f"vendor {vendor!r} is longer than 253 characters")
    if not _DNS_SUBDOMAIN_RE.match(vendor):
        problems.append(
            f"vendor {vendor!r} must be a DNS subdomain (lower-case alphanumerics and '-', "
            "dot-separated labels starting and ending with an alphanumeric)"
        )
    if not _CDI_VENDOR_CLASS_RE.match(vendor):
        problems.append(f"vendor {vendor!r} must start with a letter (CDI parser)")
    return problems


def class_errors(class_: str) -> list[str]:
    """Problems with the class part of a kind / qualified name."""
    if not class_:
        return ["empty class"]
    problems = []
    if len(class_) > 63:
        problems.append(f"class {class_!r} is longer than 63 characters")
    if not _CLASS_RE.match(class_):
        problems.append(
            f"class {class_!r} must consist of alphanumerics, '-', '_' or '.', starting and "
            "ending with an alphanumeric"
        )
    elif not class_[0].isalpha():
        problems.append(f"class {class_!r} must start with a letter (CDI parser)")
    return problems


def device_name_errors(name: str) -> list[str]:
    if not name:
        return ["empty device name"]
    if not _DEVICE_NAME_RE.match(name):
        return [
            f"device name {name!r} must consist of alphanumerics, '-', '_', '.' or ':', "
            "starting and ending with an alphanumeric"
        ]
    return []


def qualified_device_name_ok(name: str) -> bool:
    """Is ``name`` a valid fully qualified CDI device name ``vendor/class=name``?"""
    return not qualified_device_name_errors(name)


def qualified_device_name_errors(name: str) -> list[str]:
    kind, sep, device = name.partition("=")
    vendor, slash, class_ = kind.partition("/")
    if not sep or not slash or "/" in class_:
        return [f"{name!r} is not of the form vendor/class=name"]
    return vendor_errors(vendor) + class_errors(class_) + device_name_errors(device)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Checker:
    def __init__(self, version: str | None) -> None:
        self.version = version
        self.problems: list[str] = []

    def add(self, path: str, message: str) -> None:
        self.problems.append(f"{path}: {message}" if path else message)

    def requires(self, path: str, needed: str) -> None:
        if not _at_least(self.version, needed):
            self.add(path, f"requires cdiVersion >= {needed} (declared {self.version})")

    def unknown_fields(self, path: str, obj: Mapping[str, Any], allowed: frozenset[str]) -> None:
        for key in obj:
            if key not in allowed:
                self.add(f"{path}.{key}" if path else str(key), "unknown field")

    def mapping(self, path: str, value: Any) -> bool:
        if not isinstance(value, dict):
            self.add(path, f"must be an object, got {type(value).__name__}")
            return False
        return True

    def string_list(self, path: str, value: Any) -> list[str]:
        if not isinstance(value, list):
            self.add(path, f"must be a list of strings, got {type(value).__name__}")
            return []
        good = []
        for i, item in enumerate(value):
            if isinstance(item, str):
                good.append(item)
            else:
                self.add(f"{path}[{i}]", f"must be a string, got {type(item).__name__}")
        return good

    def absolute(self, path: str, value: Any, required: bool = True) -> None:
        if value is None or value == "":
            if required:
                self.add(path, "required")
            return
        if not isinstance(value, str):
            self.add(path, f"must be a string, got {type(value).__name__}")
        elif not value.startswith("/"):
            self.add(path, f"must be an absolute path, got {value!r}")

    def uint(self, path: str, value: Any, maximum: int = 2**32 - 1) -> None:
        if not _is_int(value) or not 0 <= value <= maximum:
            self.add(path, f"must be an integer from 0 to {maximum}, got {value!r}")

    def env(self, path: str, value: Any) -> None:
        for i, item in enumerate(self.string_list(path, value)):
            if item.find("=") <= 0:
                self.add(f"{path}[{i}]", f"must be NAME=value, got {item!r}")

    def annotations(self, path: str, value: Any) -> None:
        if not self.mapping(path, value):
            return
        if value:
            self.requires(path, "0.6.0")
        for key, item in value.items():
            if not isinstance(item, str):
                self.add(f"{path}[{key!r}]", f"value must be a string, got {type(item).__name__}")
            prefix, slash, name = str(key).rpartition("/")
            bad = len(name) > 63 or not _QUALIFIED_NAME_PART_RE.match(name)
            if slash and (len(prefix) > 253 or not _DNS_SUBDOMAIN_RE.match(prefix)):
                bad = True
            if bad:
                self.add(f"{path}[{key!r}]", "key must be a valid qualified name")

    # --- containerEdits ------------------------------------------------------------------

    def edits(self, path: str, edits: Any, *, device: bool) -> None:
        if not self.mapping(path, edits):
            return
        self.unknown_fields(path, edits, EDIT_FIELDS)
        if device and not any(edits.get(k) for k in EDIT_FIELDS):
            self.add(path, "empty container edits (a device must edit the container)")
        if "env" in edits:
            self.env(f"{path}.env", edits["env"])
        for name, check in (
            ("deviceNodes", self.device_node),
            ("mounts", self.mount),
            ("hooks", self.hook),
            ("netDevices", self.net_device),
        ):
            if name not in edits:
                continue
            items = edits[name]
            if not isinstance(items, list):
                self.add(f"{path}.{name}", f"must be a list, got {type(items).__name__}")
                continue
            for i, item in enumerate(items):
                item_path = f"{path}.{name}[{i}]"
                if self.mapping(item_path, item):
                    check(item_path, item)
        if "netDevices" in edits:
            self.requires(f"{path}.netDevices", "1.1.0")
            names = [
                d.get("hostInterfaceName") for d in edits["netDevices"] or [] if isinstance(d, dict)
            ]
            for dup in {n for n in names if n and names.count(n) > 1}:
                self.add(f"{path}.netDevices", f"duplicate hostInterfaceName {dup!r}")
        if "additionalGids" in edits:
            gids = edits["additionalGids"]
            if not isinstance(gids, list):
                self.add(f"{path}.additionalGids", "must be a list of integers")
            else:
                for i, gid in enumerate(gids):
                    self.uint(f"{path}.additionalGids[{i}]", gid)
                if gids:
                    self.requires(f"{path}.additionalGids", "0.7.0")
        if "intelRdt" in edits and edits["intelRdt"] is not None:
            self.intel_rdt(f"{path}.intelRdt", edits["intelRdt"])

    def device_node(self, path: str, node: Mapping[str, Any]) -> None:
        self.unknown_fields(path, node, DEVICE_NODE_FIELDS)
        self.absolute(f"{path}.path", node.get("path"))
        if node.get("hostPath"):
            self.absolute(f"{path}.hostPath", node["hostPath"])
            self.requires(f"{path}.hostPath", "0.5.0")
        if "type" in node and node["type"] != "" and node["type"] not in DEVICE_NODE_TYPES:
            self.add(f"{path}.type", f"must be one of b, c, u, p; got {node['type']!r}")
        if "permissions" in node:
            permissions = node["permissions"]
            if not isinstance(permissions, str) or (
                permissions != "none" and any(c not in "rwm" for c in permissions)
            ):
                self.add(
                    f"{path}.permissions",
                    f"must be made of r, w, m (or be 'none'), got {permissions!r}",
                )
        for key in ("major", "minor"):
            if key in node and not _is_int(node[key]):
                self.add(f"{path}.{key}", f"must be an integer, got {node[key]!r}")
        if "fileMode" in node:
            self.uint(f"{path}.fileMode", node["fileMode"])
        for key in ("uid", "gid"):
            if key in node:
                self.uint(f"{path}.{key}", node[key])

    def mount(self, path: str, mount: Mapping[str, Any]) -> None:
        self.unknown_fields(path, mount, MOUNT_FIELDS)
        self.absolute(f"{path}.hostPath", mount.get("hostPath"))
        self.absolute(f"{path}.containerPath", mount.get("containerPath"))
        if "options" in mount:
            self.string_list(f"{path}.options", mount["options"])
        if "type" in mount:
            if not isinstance(mount["type"], str):
                self.add(f"{path}.type", "must be a string")
            elif mount["type"]:
                self.requires(f"{path}.type", "0.4.0")

    def hook(self, path: str, hook: Mapping[str, Any]) -> None:
        self.unknown_fields(path, hook, HOOK_FIELDS)
        name = hook.get("hookName")
        if name not in HOOK_NAMES:
            self.add(f"{path}.hookName", f"must be one of {sorted(HOOK_NAMES)}, got {name!r}")
        self.absolute(f"{path}.path", hook.get("path"))
        if "args" in hook:
            self.string_list(f"{path}.args", hook["args"])
        if "env" in hook:
            self.env(f"{path}.env", hook["env"])
        if "timeout" in hook and hook["timeout"] is not None:
            timeout = hook["timeout"]
            if not _is_int(timeout) or timeout <= 0:
                self.add(f"{path}.timeout", f"must be a positive integer, got {timeout!r}")

    def net_device(self, path: str, device: Mapping[str, Any]) -> None:
        self.unknown_fields(path, device, NET_DEVICE_FIELDS)
        for key in ("hostInterfaceName", "name"):
            value = device.get(key)
            if not value:
                self.add(f"{path}.{key}", "required")
            elif not isinstance(value, str):
                self.add(f"{path}.{key}", "must be a string")
            elif len(value) > 15 or value in (".", "..") or re.search(r"[/:\s]", value):
                self.add(f"{path}.{key}", f"invalid network interface name {value!r}")

    def intel_rdt(self, path: str, rdt: Any) -> None:
        if not self.mapping(path, rdt):
            return
        self.unknown_fields(path, rdt, INTEL_RDT_FIELDS)
        self.requires(path, "0.7.0")
        clos = rdt.get("closID", "")
        if not isinstance(clos, str) or (
            len(clos) >= 4096 or clos in (".", "..") or "/" in clos or "\n" in clos
        ):
            self.add(f"{path}.closID", f"invalid closID {clos!r}")
        for key in ("schemata", "enableMonitoring"):
            if key in rdt:
                self.requires(f"{path}.{key}", "1.1.0")
        for key in ("enableCMT", "enableMBM"):
            if key in rdt and self.version is not None and _at_least(self.version, "1.1.0"):
                self.add(f"{path}.{key}", f"is not valid for cdiVersion {self.version}")


def validate_cdi_spec(obj: Any) -> list[str]:
    """All problems found in a CDI spec (as parsed from JSON/YAML); empty means valid."""
    if not isinstance(obj, dict):
        return [f"the spec must be an object, got {type(obj).__name__}"]
    declared = obj.get("cdiVersion")
    version: str | None = None
    problems: list[str] = []
    if declared is None or declared == "":
        problems.append("cdiVersion: required")
    elif not isinstance(declared, str):
        problems.append(f"cdiVersion: must be a string, got {declared!r}")
    else:
        normalized = declared.removeprefix("v")
        if normalized in KNOWN_VERSIONS:
            version = normalized
        elif re.match(r"^\d+\.\d+\.\d+$", normalized):
            problems.append(
                f"cdiVersion: {declared!r} is not a released CDI spec version from "
                f"{KNOWN_VERSIONS[0]} to {CURRENT_VERSION} ({', '.join(KNOWN_VERSIONS)})"
            )
        else:
            problems.append(f"cdiVersion: {declared!r} is not a semantic version")
    checker = _Checker(version)
    checker.problems = problems
    checker.unknown_fields("", obj, TOP_LEVEL_FIELDS)

    kind = obj.get("kind")
    if not kind:
        checker.add("kind", "required")
    elif not isinstance(kind, str):
        checker.add("kind", f"must be a string, got {kind!r}")
    else:
        vendor, slash, class_ = kind.partition("/")
        if not slash or "/" in class_:
            checker.add("kind", f"{kind!r} must be of the form <vendor>/<class>")
        else:
            for problem in vendor_errors(vendor) + class_errors(class_):
                checker.add("kind", problem)
            if "." in class_:
                checker.requires("kind", "0.6.0")

    if "annotations" in obj:
        checker.annotations("annotations", obj["annotations"])
    if "containerEdits" in obj and obj["containerEdits"] is not None:
        checker.edits("containerEdits", obj["containerEdits"], device=False)

    devices = obj.get("devices")
    if not isinstance(devices, list) or not devices:
        checker.add("devices", "at least one device is required")
        devices = devices if isinstance(devices, list) else []
    seen: set[str] = set()
    for i, device in enumerate(devices):
        path = f"devices[{i}]"
        if not checker.mapping(path, device):
            continue
        checker.unknown_fields(path, device, DEVICE_FIELDS)
        name = device.get("name")
        if not isinstance(name, str):
            checker.add(f"{path}.name", "required (a string)")
        else:
            for problem in device_name_errors(name):
                checker.add(f"{path}.name", problem)
            if name in seen:
                checker.add(f"{path}.name", f"duplicate device name {name!r}")
            seen.add(name)
            if name[:1].isdigit():
                checker.requires(f"{path}.name", "0.5.0")
        if "annotations" in device:
            checker.annotations(f"{path}.annotations", device["annotations"])
        if "containerEdits" not in device:
            checker.add(f"{path}.containerEdits", "required")
        else:
            checker.edits(f"{path}.containerEdits", device["containerEdits"], device=True)
    return checker.problems


def validate_cdi_file(path: str | Path) -> list[str]:
    """Validate a spec file: ``.json`` or ``.yaml`` extension, parseable, then the spec."""
    target = Path(path)
    if target.suffix not in (".json", ".yaml"):
        return [f"{target.name}: CDI spec files must end in .json or .yaml"]
    try:
        text = target.read_text()
        obj = json.loads(text) if target.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        return [f"{target.name}: cannot be parsed: {exc}"]
    return validate_cdi_spec(obj)
