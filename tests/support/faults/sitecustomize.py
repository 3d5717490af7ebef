"""Fault injection for end-to-end tests: a process started with this directory first on
its PYTHONPATH loads this module at startup (Python's `site` imports any
`sitecustomize`), and it changes nothing unless the test asked for a fault:

    BATON_TEST_STALL_MID_COPY=<path>   an ipc sender copies half of a transfer's blocks
                                       into the receiver's cache, writes its pid to
                                       <path>, and stalls there (until killed)

Production code has no such hook: the patch goes in when kvtransfer.ipc is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time


def _stall_mid_copy(module) -> None:
    marker = os.environ["BATON_TEST_STALL_MID_COPY"]

    def copy(self, rows, prepared, tag):
        half = max(1, len(prepared.src_ids) // 2)
        self._peer_rows[prepared.dst_ids[:half]] = rows[prepared.src_ids[:half]]  # half of the blocks land
        with open(marker, "w") as file:
            file.write(str(os.getpid()))
        time.sleep(3600)

    module.IpcChannel._copy = copy


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs `patch(module)` right after `name` is first imported."""

    def __init__(self, name: str, patch) -> None:
        self.name = name
        self.patch = patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None:
            return None
        exec_module, patch = spec.loader.exec_module, self.patch

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if os.environ.get("BATON_TEST_STALL_MID_COPY"):
    sys.meta_path.insert(0, _PatchOnImport("kvtransfer.ipc", _stall_mid_copy))
