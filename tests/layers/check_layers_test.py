#!/usr/bin/env python3
"""The layers_check_* tests: cmake/check_layers.py refuses exactly the includes of
tests/layers/fixture that break the layers, and passes on the source tree.

    check_layers_test.py CHECKER CONFIG SOURCE_DIR fixture|tree
"""

import re
import subprocess
import sys

# FILE:LINE of every include in the fixture that breaks a rule, and the rule's words.
EXPECTED = {
    "src/collectives/upward.cpp:2": "engine/tags.h is in engine, above collectives",
    "src/kit/public_upward.cpp:3": "terse/communicator.h belongs to transport, above kit",
    "src/codecs/relative.cpp:2": "no ../ or absolute includes",
    "include/terse/error.h:3": "terse/communicator.h belongs to transport, above kit",
    "include/terse/stray.h:1": "belongs to no layer",
    "tools/internal.cpp:2": "only with a one-line reason",
    "python/src/module.cpp:3": "the bindings use the public API only",
}


def main():
    checker, config, source_dir, which = sys.argv[1:5]
    root = f"{source_dir}/tests/layers/fixture" if which == "fixture" else source_dir
    run = subprocess.run([sys.executable, checker, "--config", config, "--root", root],
                         capture_output=True, text=True)
    print(run.stderr, end="")
    if which == "tree":
        assert run.returncode == 0, "the source tree breaks the layers"
        return
    assert run.returncode == 1, f"the check exited {run.returncode} on the fixture, not 1"
    found = {}
    for line in run.stderr.splitlines():
        m = re.match(r"^(\S+:\d+): (.*)$", line)
        if m:
            found[m.group(1)] = m.group(2)
    assert set(found) == set(EXPECTED), (
        f"refused {sorted(found)}, expected {sorted(EXPECTED)}")
    for where, words in EXPECTED.items():
        assert words in found[where], f"{where}: '{found[where]}' does not say '{words}'"
    print(f"check_layers_test: the check refused the {len(EXPECTED)} bad includes, and only them")


if __name__ == "__main__":
    main()
