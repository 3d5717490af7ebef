"""The docs keep to the tree: every table that lists files names files that exist, the
engine's file table lists every module of the engine, the package maps every package,
links between pages land, and the front pages stay short enough to read."""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO_ROOT / "README.md", *REPO_ROOT.glob("docs/*.md"), *REPO_ROOT.glob("*/README.md"),
                *REPO_ROOT.glob("tests/README.md")])
# A table lists files when its first column is headed so.
FILE_COLUMNS = ("file", "files", "path", "package", "folder")
PACKAGES = ("engine", "gateway", "prefill_worker", "decode_worker", "kvtransfer")
# Folders the package maps list beside the packages.
NOT_PACKAGES = {"tests/", "benchmarks/", "deploy/"}
MAX_PAGE_LINES = {"README.md": 250, "docs/ARCHITECTURE.md": 500}


def file_tables(page: Path) -> list[tuple[str, list[list[str]]]]:
    """Each table of `page` that lists files: (the directory its paths are under, its rows'
    cells). A table's paths are from the repository root, or under the directory the text
    above it names ("Paths are under `engine/`")."""
    tables, base, rows, in_table = [], "", [], False
    for line in [*page.read_text().splitlines(), ""]:
        if line.startswith("#"):
            base = ""
        if found := re.search(r"Paths are under `([^`]+/)`", line):
            base = found.group(1)
        if line.startswith("|"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            if not in_table:
                in_table, rows = True, [cells]
            elif not set(line) <= set("|-: "):
                rows.append(cells)
            continue
        if in_table and rows[0][0].lower() in FILE_COLUMNS:
            tables.append((base, rows[1:]))
        in_table = False
    return tables


def listed_paths(page: Path) -> list[tuple[str, str]]:
    """(the path as written, the path from the repository root) of every backticked name in
    the first column of a file table."""
    return [(name, base + name) for base, rows in file_tables(page) for row in rows
            for name in re.findall(r"`([^`]+)`", row[0])]


def test_every_file_a_doc_table_lists_exists():
    missing = [f"{page.relative_to(REPO_ROOT)}: {written}" for page in PAGES
               for written, path in listed_paths(page) if not (REPO_ROOT / path).exists()]
    assert missing == []
    assert sum(len(listed_paths(page)) for page in PAGES) > 60  # the tables were read


def test_the_engine_page_lists_every_module_of_the_engine():
    """docs/engine.md's table: every Python file of engine/ (a sub-package's __init__.py
    is empty, so the folder stands for it), each in one row."""
    listed = [path for _, path in listed_paths(REPO_ROOT / "docs" / "engine.md")]
    assert len(listed) == len(set(listed)), "a file in two rows"
    listed_files = {path for path in listed if not path.endswith("/")}
    listed_folders = tuple(path for path in listed if path.endswith("/"))
    on_disk = {str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "engine").rglob("*.py")
               if p.name != "__init__.py" or p.parent == REPO_ROOT / "engine"}
    unlisted = sorted(path for path in on_disk - listed_files if not path.startswith(listed_folders))
    assert unlisted == []


def test_the_docs_map_every_package():
    """docs/ARCHITECTURE.md opens with the package map, every package in it, one line each;
    README's layout table matches it."""
    on_disk = {"protos/"} | {f"{package}/" for package in PACKAGES}
    on_disk |= {f"baton/{p.parent.name}/" for p in (REPO_ROOT / "baton").glob("*/__init__.py")}
    architecture = REPO_ROOT / "docs" / "ARCHITECTURE.md"
    text = architecture.read_text()
    assert text.index("## Layers") < text.index("## Packages") < text.index("## One request, file by file")
    mapped = {path for written, path in listed_paths(architecture) if path.endswith("/")} - NOT_PACKAGES
    readme = {path for written, path in listed_paths(REPO_ROOT / "README.md") if path.endswith("/")} - NOT_PACKAGES
    assert mapped == on_disk
    assert readme == on_disk


def test_links_between_pages_land():
    """Every relative link of a page names a file that exists (anchors are not checked)."""
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not target.startswith("mailto:") \
                    and not (page.parent / target).resolve().exists():
                broken.append(f"{page.relative_to(REPO_ROOT)} -> {target}")
    assert broken == []


def test_the_front_pages_stay_short():
    long = {name: n for name, limit in MAX_PAGE_LINES.items()
            if (n := len((REPO_ROOT / name).read_text().splitlines())) > limit}
    assert long == {}
