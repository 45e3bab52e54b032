"""Generate torch_dataservice/proto/ from protos/torch_dataservice/v1/*.proto.

The generated modules are committed so that installing the package needs no protoc; this script
is the one command that regenerates them (``make protos``), and ``--check`` lets a test prove the
committed files still match the .proto sources.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTO_PACKAGE = "torch_dataservice/v1"
PROTO_NAMES = ("common", "dispatcher", "snapshot", "status", "worker")
OUT_DIR = ROOT / "torch_dataservice" / "proto"
GENERATED_GLOB = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")

# protoc names modules after the proto package (torch_dataservice.v1.x_pb2); we ship them flat
# under torch_dataservice.proto. Only module references are rewritten: the proto package name in
# descriptors and RPC paths (/torch_dataservice.v1.WorkerService/...) is the wire contract.
_IMPORT_RE = re.compile(r"\bfrom torch_dataservice\.v1 import (\w+_pb2)\b")
_MODULE_RE = re.compile(r"\btorch_dataservice([./])v1\1(\w+_pb2(?:_grpc)?)\b")


def _rewrite(text: str) -> str:
    text = _IMPORT_RE.sub(r"from torch_dataservice.proto import \1", text)
    return _MODULE_RE.sub(r"torch_dataservice\1proto\1\2", text)


def generate(out_dir: Path) -> list[Path]:
    """Run protoc into a scratch dir, rewrite imports and write the flat modules to out_dir."""
    from grpc_tools import protoc  # imported here so --help works without grpcio-tools

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        proto_include = Path(protoc.__file__).parent / "_proto"
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{proto_include}",
            f"--python_out={scratch}",
            f"--pyi_out={scratch}",
            f"--grpc_python_out={scratch}",
            *(f"{PROTO_ROOT / PROTO_PACKAGE / name}.proto" for name in PROTO_NAMES),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed: {' '.join(args)}")
        written = []
        for src in sorted((Path(scratch) / PROTO_PACKAGE).iterdir()):
            dst = out_dir / src.name
            dst.write_text(_rewrite(src.read_text(encoding="utf-8")), encoding="utf-8")
            written.append(dst)
    return written


def _generated_files(directory: Path) -> dict[str, str]:
    files = sorted({p for pattern in GENERATED_GLOB for p in directory.glob(pattern)})
    return {p.name: p.read_text(encoding="utf-8") for p in files}


def check() -> int:
    """Return 0 if the committed modules match a fresh generation, else print the diff, 1."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = _generated_files(Path(tmp))
    committed = _generated_files(OUT_DIR)
    problems = []
    for name in sorted(fresh.keys() | committed.keys()):
        if name not in committed:
            problems.append(f"missing: torch_dataservice/proto/{name}")
        elif name not in fresh:
            problems.append(f"stale (no longer generated): torch_dataservice/proto/{name}")
        elif fresh[name] != committed[name]:
            diff = difflib.unified_diff(
                committed[name].splitlines(keepends=True),
                fresh[name].splitlines(keepends=True),
                fromfile=f"committed/{name}",
                tofile=f"generated/{name}",
                n=1,
            )
            problems.append(f"differs: torch_dataservice/proto/{name}\n{''.join(diff)}")
    if problems:
        print("generated protobuf code is out of date; run `make protos`:", file=sys.stderr)
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1
    print("torch_dataservice/proto is up to date")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="generate into a temp dir and exit 1 if the committed files differ",
    )
    args = parser.parse_args(argv)
    if args.check:
        return check()
    for path in generate(OUT_DIR):
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
