"""Loading the native CPU kernels survives a loader that died while loading: torch's build
lock is a file, and one left behind by a process killed at that moment made every later
Baton process on the machine wait for it forever (engine/kernels/__init__.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from baton.cli.local import REPO_ROOT

LOAD = "from engine.kernels import load_cpu_kernels; load_cpu_kernels(); print('loaded')"


def build_directory() -> Path:
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory("baton_cpu_kernels", verbose=False))


def test_a_lock_left_by_a_killed_loader_does_not_hang_the_next():
    subprocess.run([sys.executable, "-c", LOAD], cwd=REPO_ROOT, check=True, timeout=600)  # built and cached
    stale = build_directory() / "lock"
    stale.touch()  # what a loader killed inside torch's build leaves
    loaded = subprocess.run([sys.executable, "-c", LOAD], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=300)
    assert loaded.returncode == 0 and "loaded" in loaded.stdout, loaded.stderr[-3000:]
    assert "left by a process that died" in loaded.stderr
    assert not stale.exists()
