"""`python -m engine.kernels` (`make kernels`): build the native CPU kernels now, so that
the first test or request does not wait for the compiler. Where they cannot build (no C++
compiler) it says so and exits 0: the engine serves on the plain-torch path instead.
`--require` (the images' build) exits 1 then: an image must not ship without them."""

from __future__ import annotations

import argparse
import logging
import sys

from engine.kernels import cpu_kernels_available

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m engine.kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--require", action="store_true", help="exit 1 if the kernels do not build")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if cpu_kernels_available():
        print("Baton's CPU kernels are built")
    else:
        print("Baton's CPU kernels are not built: Baton serves on the plain-torch path (see the warning above)")
        sys.exit(1 if args.require else 0)
