"""Generate the Python gRPC stubs of protos/ into this package, or check they are current.

    python -m baton.protogen           # regenerate baton/v1, baton/internal/v1
    python -m baton.protogen --check   # exit 1 if the committed stubs differ

protos/ is the source of truth; the stubs are committed so that a fresh clone
runs without a code generator, and the check (run by the tests) keeps them
from drifting. Needs grpcio-tools (a test dependency).
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
# Stubs land next to this package: protos/baton/v1/x.proto -> baton/v1/x_pb2.py.
OUTPUT_ROOT = REPO_ROOT
STUB_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc over every .proto; returns the stub paths relative to out_dir."""
    import importlib.resources

    from grpc_tools import protoc

    include = importlib.resources.files("grpc_tools") / "_proto"
    files = [str(path.relative_to(PROTO_ROOT)) for path in proto_files()]
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    stubs = (out_dir / "baton").rglob("*")
    return sorted(p.relative_to(out_dir) for p in stubs if p.name.endswith(STUB_SUFFIXES))


def check() -> list[str]:
    """Differences between freshly generated stubs and the committed ones."""
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        for rel in fresh:
            committed = OUTPUT_ROOT / rel
            if not committed.exists():
                problems.append(f"missing: {rel}")
            elif not filecmp.cmp(Path(tmp) / rel, committed, shallow=False):
                problems.append(f"out of date: {rel}")
        fresh_set = set(fresh)
        for committed in (OUTPUT_ROOT / "baton").rglob("*"):
            rel = committed.relative_to(OUTPUT_ROOT)
            if committed.name.endswith(STUB_SUFFIXES) and rel not in fresh_set:
                problems.append(f"stale (no .proto): {rel}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print("run `python -m baton.protogen` and commit the result", file=sys.stderr)
        return 1 if problems else 0
    for rel in generate(OUTPUT_ROOT):
        print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
