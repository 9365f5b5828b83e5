#!/usr/bin/env python3
"""Generate the Python protobuf/gRPC stubs in ``agent/protos`` from ``protos/``.

Usage::

    python scripts/gen_protos.py            # regenerate agent/protos in place
    python scripts/gen_protos.py --out DIR  # write the stubs somewhere else
    python scripts/gen_protos.py --check    # exit 1 if agent/protos is stale

Every ``.proto`` below ``protos/`` is compiled with ``grpc_tools.protoc -I protos`` so the
descriptor file names are include-relative (``deviceplugin/v1beta1/api.proto``,
``dra/v1/api.proto``, ...). They must stay distinct: Python's default descriptor pool
rejects two files with the same name, and several upstream files are called ``api.proto``.

protoc emits ``--python_out``, ``--pyi_out`` and ``--grpc_python_out`` mirroring the
directory tree. Its cross-module imports are absolute from the include root
(``from deviceplugin.v1beta1 import api_pb2``); they are rewritten to the package the
stubs live in (``from agent.protos.deviceplugin.v1beta1 import api_pb2``), as is the
module name the ``_pb2`` modules give their message classes. The output depends only on
the ``.proto`` files and the grpcio-tools version, so it is reproducible byte for byte.
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.resources
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
DEFAULT_OUT = REPO_ROOT / "agent" / "protos"
DEFAULT_PACKAGE = "agent.protos"

GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
INIT_TEXT = ""
ROOT_INIT_TEXT = '"""Generated protobuf/gRPC stubs; see README.md. Do not edit by hand."""\n'


def find_protos(proto_root: Path) -> list[str]:
    """Include-relative paths (POSIX separators) of all .proto files, sorted."""
    return sorted(p.relative_to(proto_root).as_posix() for p in proto_root.rglob("*.proto"))


def _well_known_include() -> str:
    """grpc_tools ships google/protobuf/*.proto (well-known types) in its _proto dir."""
    return str(importlib.resources.files("grpc_tools") / "_proto")


def run_protoc(proto_root: Path, protos: list[str], out_dir: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{_well_known_include()}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    # Run from the include root so nothing in the output depends on the caller's cwd.
    result = subprocess.run(cmd, cwd=proto_root, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(
            f"protoc failed (exit {result.returncode}):\n{result.stdout}{result.stderr}"
        )


def _module_of(proto: str) -> str:
    """'dra/v1/api.proto' -> 'dra.v1.api_pb2'."""
    return proto[: -len(".proto")].replace("/", ".") + "_pb2"


def postprocess(text: str, protos: list[str], package: str) -> str:
    """Point protoc's include-root-absolute imports at ``package``."""
    top_level = sorted({p.split("/", 1)[0] for p in protos if "/" in p})
    if top_level:
        alt = "|".join(re.escape(t) for t in top_level)
        # from deviceplugin.v1beta1 import api_pb2 as ...
        text = re.sub(
            rf"^from ((?:{alt})(?:\.\w+)*) import (\w+_pb2\b)",
            rf"from {package}.\1 import \2",
            text,
            flags=re.MULTILINE,
        )
    root_modules = sorted(_module_of(p) for p in protos if "/" not in p)
    if root_modules:
        alt = "|".join(re.escape(m) for m in root_modules)
        # import foo_pb2 as foo__pb2   (protos directly in the include root)
        text = re.sub(
            rf"^import ({alt}) as ",
            rf"from {package} import \1 as ",
            text,
            flags=re.MULTILINE,
        )
    # Message classes get __module__ from this name (matters for pickling and reprs).
    for proto in protos:
        module = _module_of(proto)
        text = text.replace(
            f"BuildTopDescriptorsAndMessages(DESCRIPTOR, '{module}', _globals)",
            f"BuildTopDescriptorsAndMessages(DESCRIPTOR, '{package}.{module}', _globals)",
        )
    return text


def generate_into(out_dir: Path, package: str = DEFAULT_PACKAGE) -> list[Path]:
    """Generate all stubs into ``out_dir``; return the generated files (relative paths).

    Stale generated files in ``out_dir`` are removed; ``__init__.py`` files are created
    where missing (existing ones and other files such as README.md are left alone).
    """
    protos = find_protos(PROTO_ROOT)
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_ROOT}")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gen_protos_") as tmp:
        tmp_dir = Path(tmp)
        run_protoc(PROTO_ROOT, protos, tmp_dir)
        generated = sorted(
            p.relative_to(tmp_dir)
            for p in tmp_dir.rglob("*")
            if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)
        )
        for rel in generated:
            src = tmp_dir / rel
            text = postprocess(src.read_text(encoding="utf-8"), protos, package)
            dst = out_dir / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            data = text.encode("utf-8")
            if not dst.exists() or dst.read_bytes() != data:
                dst.write_bytes(data)

    wanted = set(generated)
    for existing in sorted(out_dir.rglob("*")):
        rel = existing.relative_to(out_dir)
        if existing.is_file() and existing.name.endswith(GENERATED_SUFFIXES) and rel not in wanted:
            existing.unlink()

    package_dirs = {out_dir}
    for rel in generated:
        parent = (out_dir / rel).parent
        while parent != out_dir:
            package_dirs.add(parent)
            parent = parent.parent
    for pkg in sorted(package_dirs):
        init = pkg / "__init__.py"
        if not init.exists():
            init.write_text(ROOT_INIT_TEXT if pkg == out_dir else INIT_TEXT, encoding="utf-8")
    return generated


def stale_files(committed: Path, fresh: Path) -> list[str]:
    """Generated files that differ between two output trees (missing on either side too)."""

    def listing(root: Path) -> set[Path]:
        return {
            p.relative_to(root)
            for p in root.rglob("*")
            if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)
        }

    a, b = listing(committed), listing(fresh)
    diff = sorted(str(p) for p in a ^ b)
    diff += sorted(
        str(p) for p in a & b if not filecmp.cmp(committed / p, fresh / p, shallow=False)
    )
    return diff


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"output directory (default: {DEFAULT_OUT.relative_to(REPO_ROOT)})",
    )
    parser.add_argument(
        "--package",
        default=DEFAULT_PACKAGE,
        help=f"Python package the stubs are imported from (default: {DEFAULT_PACKAGE})",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="do not write; exit 1 if the stubs in --out differ from a fresh generation",
    )
    args = parser.parse_args(argv)
    out: Path = args.out.resolve()

    if args.check:
        with tempfile.TemporaryDirectory(prefix="gen_protos_check_") as tmp:
            generate_into(Path(tmp), args.package)
            diff = stale_files(out, Path(tmp))
        if diff:
            print(
                "generated stubs are stale: " + ", ".join(diff) + "\n"
                "regenerate with: python scripts/gen_protos.py",
                file=sys.stderr,
            )
            return 1
        print(f"{out}: up to date")
        return 0

    generated = generate_into(out, args.package)
    print(f"generated {len(generated)} files in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
