"""Commit messages a person can scan (docs/CONTRIBUTING.md): a subject of at most 72
characters, in the imperative, with no full stop; then, if there is more, a blank line
and the body. `git log --oneline` is the project's table of contents.

    python -m baton.devtools.commits MESSAGE_FILE   the commit-msg hook (tools/hooks/commit-msg)
    python -m baton.devtools.commits --since REV    every commit after REV
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

MAX_SUBJECT = 72


SCISSORS = " ------------------------ >8 ------------------------"


def message_problems(message: str, comment_char: str = "#") -> list[str]:
    """What is wrong with a commit message as git keeps it: its comment lines left out, and
    everything from the scissors line on (`git commit -v` puts the diff there); [] if nothing."""
    lines = message.splitlines()
    if comment_char + SCISSORS in lines:
        lines = lines[:lines.index(comment_char + SCISSORS)]
    lines = [line for line in lines if not line.startswith(comment_char)]
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines or not lines[0].strip():
        return ["the subject is empty"]
    subject, problems = lines[0], []
    if len(subject) > MAX_SUBJECT:
        problems.append(f"the subject has {len(subject)} characters, at most {MAX_SUBJECT}: "
                        "the detail goes in the body")
    if subject.rstrip().endswith("."):
        problems.append("the subject ends with a full stop")
    if subject[:1].islower():
        problems.append("the subject starts in lower case: an imperative verb, capitalized")
    if len(lines) > 1 and lines[1].strip():
        problems.append("no blank line between the subject and the body")
    return problems


def comment_char(cwd: Path) -> str:
    """git's core.commentChar ("#" unless set; "auto" picks per message, so "#" is the guess)."""
    found = subprocess.run(["git", "config", "--get", "core.commentChar"], cwd=cwd, capture_output=True, text=True)
    value = found.stdout.strip()
    return value if len(value) == 1 else "#"


def commits_since(revision: str, cwd: Path) -> dict[str, str]:
    """The messages of the commits after `revision` on HEAD, by hash."""
    hashes = subprocess.run(["git", "rev-list", f"{revision}..HEAD"], cwd=cwd, capture_output=True, text=True,
                            check=True).stdout.split()
    return {commit: subprocess.run(["git", "log", "-1", "--format=%B", commit], cwd=cwd, capture_output=True,
                                   text=True, check=True).stdout for commit in hashes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m baton.devtools.commits", description=__doc__.split("\n\n")[0])
    parser.add_argument("message_file", nargs="?", help="a commit message to check (the commit-msg hook's argument)")
    parser.add_argument("--since", help="check every commit after this revision instead")
    args = parser.parse_args(argv)
    if args.since is not None:
        messages = commits_since(args.since, Path.cwd())
    elif args.message_file is not None:
        messages = {"this commit": Path(args.message_file).read_text()}
    else:
        parser.error("give a message file or --since REV")
    char = comment_char(Path.cwd())
    failed = {name: problems for name, message in messages.items()
              if (problems := message_problems(message, char if args.since is None else "\0"))}
    for name, problems in failed.items():
        print(f"{name}: {'; '.join(problems)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
