"""`python -m engine.kernels` (`make kernels`): build the native CPU kernels now, so that
the first test or request does not wait for the compiler. Where they cannot build (no C++
compiler) it says so and exits 0: the engine serves on the plain-torch path instead."""

from __future__ import annotations

import logging

from engine.kernels import cpu_kernels_available

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if cpu_kernels_available():
        print("Baton's CPU kernels are built")
    else:
        print("Baton's CPU kernels are not built: Baton serves on the plain-torch path (see the warning above)")
