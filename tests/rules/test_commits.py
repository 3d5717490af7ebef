"""Commit messages people scan (docs/CONTRIBUTING.md): every commit since the rule was made
keeps it, and the commit-msg hook refuses one that does not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from baton.devtools.commits import commits_since, message_problems

REPO_ROOT = Path(__file__).resolve().parents[2]
# The last commit written before the rule: the ones after it keep it.
RULE_SINCE = "96ace14280666fc8a9fc1828092cde7927886fde"


def _since() -> str | None:
    """RULE_SINCE as this clone knows it (a shallow one may not), else None."""
    found = subprocess.run(["git", "rev-parse", "--verify", "--quiet", RULE_SINCE + "^{commit}"], cwd=REPO_ROOT,
                           capture_output=True, text=True)
    return found.stdout.strip() or None


def test_every_commit_since_the_rule_keeps_it():
    since = _since()
    messages = commits_since(since, REPO_ROOT) if since else {
        "HEAD": subprocess.run(["git", "log", "-1", "--format=%B"], cwd=REPO_ROOT, capture_output=True, text=True,
                               check=True).stdout}
    assert messages, "no commit was read"
    assert {commit: problems for commit, message in messages.items() if (problems := message_problems(message))} == {}


@pytest.mark.parametrize(("message", "problem"), [
    ("Fold the norms into the QKV kernel\n\nWhy, and the figures.\n", None),
    ("Fold the norms into the QKV kernel\n", None),
    ("Fold the norms into the QKV kernel, and then also the rotary embedding, and the KV store as well\n",
     "the subject has 96 characters"),
    ("Fold the norms into the QKV kernel.\n", "full stop"),
    ("fold the norms\n", "lower case"),
    ("Fold the norms\nWhy.\n", "no blank line"),
    ("# only git's comments\n\n", "the subject is empty"),
    # git commit -v: git's comments after the subject, the diff below the scissors
    ("Fold the norms into the QKV kernel\n# Please enter the commit message\n"
     "# ------------------------ >8 ------------------------\n# Do not modify\ndiff --git a/x b/x\n", None),
])
def test_a_message_is_checked_line_by_line(message, problem):
    problems = message_problems(message)
    assert (problems == []) if problem is None else any(problem in p for p in problems), problems


def test_the_hook_refuses_a_long_subject_in_one_line(tmp_path):
    message = tmp_path / "COMMIT_EDITMSG"
    message.write_text("A subject " + "that goes on " * 8 + "\n")
    result = subprocess.run([sys.executable, "-m", "baton.devtools.commits", str(message)], cwd=REPO_ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    message.write_text("Fold the norms into the QKV kernel\n")
    assert subprocess.run([sys.executable, "-m", "baton.devtools.commits", str(message)], cwd=REPO_ROOT).returncode == 0
