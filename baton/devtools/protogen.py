"""Generate the Python gRPC stubs of protos/ into baton/wire, or check they are current.

    python -m baton.devtools.protogen           # regenerate baton/wire/v1, baton/wire/internal/v1
    python -m baton.devtools.protogen --check   # exit 1 if the committed stubs differ

protos/ is the source of truth, but for the fields of statistics, which
engine/statistics.py declares (with their help and field numbers): this writes them
into their messages first, between the BEGIN and END markers. The stubs are
committed so that a fresh clone runs without a code generator, and the check (run
by the tests) keeps them and the declared fields from drifting. Needs grpcio-tools (a test dependency).

The .proto files keep their import paths (protos/baton/v1/generation.proto is
"baton/v1/generation.proto" to protoc, to reflection and to clients generated
elsewhere), while our stubs live in the wire package: protoc writes
baton/v1/x_pb2.py, and it lands as baton/wire/v1/x_pb2.py with its imports of
sibling stubs (`from baton.v1 import ...`) moved along.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
STUB_PACKAGE = Path("baton/wire")  # where protoc's baton/... lands
STUB_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
_SIBLING_IMPORT = re.compile(r"^from baton\.((?:internal\.)?v\d+) import", re.MULTILINE)


# Message fields declared in Python (engine/statistics.py) rather than here: between its
# markers in the .proto, each block is written from the declarations of its class.
DECLARED_BLOCKS = {Path("baton/internal/v1/worker.proto"): ("EngineStats", "RecentStats")}
_BLOCK = re.compile(r"(?P<begin>  // BEGIN (?P<name>\w+): written from engine/statistics\.py by "
                    r"baton\.devtools\.protogen; edit there\n)(?P<body>.*?)(?P<end>  // END (?P=name)\n)", re.DOTALL)


def declared_proto(text: str) -> str:
    """`text` (a .proto) with each declared block written afresh from its class."""
    from engine import statistics

    def render(match: re.Match) -> str:
        body = "\n".join(statistics.proto_fields(getattr(statistics, match["name"]))) + "\n"
        return match["begin"] + body + match["end"]

    return _BLOCK.sub(render, text)


def write_declared(check_only: bool) -> list[str]:
    """Write the declared blocks into their .proto files (check_only: write nothing);
    the files that were, or would be, changed."""
    changed = []
    for rel, names in DECLARED_BLOCKS.items():
        path = PROTO_ROOT / rel
        text = path.read_text()
        if sorted(match["name"] for match in _BLOCK.finditer(text)) != sorted(names):
            raise RuntimeError(f"{path}: expected the declared blocks {names}")
        fresh = declared_proto(text)
        if fresh != text:
            changed.append(str(path.relative_to(REPO_ROOT)))
            if not check_only:
                path.write_text(fresh)
    return changed


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Run protoc over every .proto and place the stubs under out_root/baton/wire;
    returns their paths relative to out_root."""
    import importlib.resources

    from grpc_tools import protoc

    include = importlib.resources.files("grpc_tools") / "_proto"
    files = [str(path.relative_to(PROTO_ROOT)) for path in proto_files()]
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp)
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={raw}",
            f"--pyi_out={raw}",
            f"--grpc_python_out={raw}",
            *files,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        written = []
        for stub in sorted((raw / "baton").rglob("*")):
            if not stub.name.endswith(STUB_SUFFIXES):
                continue
            rel = STUB_PACKAGE / stub.relative_to(raw / "baton")
            text = _SIBLING_IMPORT.sub(r"from baton.wire.\1 import", stub.read_text())
            (out_root / rel).parent.mkdir(parents=True, exist_ok=True)
            (out_root / rel).write_text(text)
            written.append(rel)
    return written


def check() -> list[str]:
    """Differences between freshly generated stubs and the committed ones, and the
    .proto files whose declared blocks differ from their declarations."""
    problems = [f"out of date (declared in engine/statistics.py): {rel}" for rel in write_declared(check_only=True)]
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        for rel in fresh:
            committed = REPO_ROOT / rel
            if not committed.exists():
                problems.append(f"missing: {rel}")
            elif not filecmp.cmp(Path(tmp) / rel, committed, shallow=False):
                problems.append(f"out of date: {rel}")
        fresh_set = set(fresh)
        for committed in (REPO_ROOT / "baton").rglob("*"):
            rel = committed.relative_to(REPO_ROOT)
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
            print("run `python -m baton.devtools.protogen` and commit the result", file=sys.stderr)
        return 1 if problems else 0
    for rel in write_declared(check_only=False):
        print(f"wrote {rel}")
    for rel in generate(REPO_ROOT):
        print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
