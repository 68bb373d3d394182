#!/usr/bin/env python3
"""Checks that every include in terse's sources follows the layers (docs/design.md).

    check_layers.py --config BUILD/layers/layers.txt --root SOURCE_DIR

The config, written by cmake/layers.cmake from the terse_layer() calls in CMakeLists.txt, has one
line per layer: `layer NAME below=LOWER,... headers=HEADER,...` (the layers NAME may include and
the public headers of include/terse/ that belong to it). The rules:

- src/NAME/ includes its own folder, the folders of the layers below it, and the public headers
  of those layers; a file beside it by its bare name. Nothing by ../ or an absolute path (that
  would get round the include roots the build gives each layer).
- include/terse/H.h includes only public headers of its own layer and the layers below.
- python/src/ (the bindings) includes public headers and its own files only.
- tools/ includes public headers and its own files; an internal header only with a one-line
  reason in a comment on the include's line.

Prints FILE:LINE: what is wrong, for every offending include, and exits 1 if there is any.
"""

import argparse
import os
import re
import sys

# Includes allowed against the rules, each with its reason. None today.
TEMPORARY_EXCEPTIONS: set = set()

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"](.*)$')


def read_config(path):
    below, owner = {}, {}
    with open(path) as f:
        for line in f:
            fields = line.split()
            if not fields or fields[0] != "layer":
                continue
            name = fields[1]
            values = dict(field.split("=", 1) for field in fields[2:])
            below[name] = [x for x in values.get("below", "").split(",") if x]
            for header in [x for x in values.get("headers", "").split(",") if x]:
                owner[header] = name
    return below, owner


class Checker:
    def __init__(self, root, below, owner):
        self.root = root
        self.below = below
        self.owner = owner
        self.problems = []
        self.unowned = set()

    def problem(self, path, line, text):
        self.problems.append(f"{path}:{line}: {text}")

    def allowed(self, layer):
        return [layer] + self.below[layer]

    def may_include(self, layer):
        lower = ", ".join(self.below[layer]) or "no other layer"
        return f"{layer} may include {layer} and {lower}"

    def includes(self, rel):
        with open(os.path.join(self.root, rel), encoding="utf-8", errors="replace") as f:
            for number, text in enumerate(f, 1):
                m = INCLUDE.match(text)
                if m:
                    yield number, m.group(1), m.group(2), m.group(3)

    def public_header(self, rel, number, header, layer):
        """A public header included from a file of `layer` (None: any layer may)."""
        name = header[len("terse/"):]
        if name not in self.owner:
            if name not in self.unowned:  # said once, where it is first included
                self.unowned.add(name)
                self.problem(rel, number, f"include/terse/{name} belongs to no layer: add it to "
                             "the PUBLIC_HEADERS of its terse_layer() in CMakeLists.txt")
            return
        if layer is None or (rel, header) in TEMPORARY_EXCEPTIONS:
            return
        if self.owner[name] not in self.allowed(layer):
            self.problem(rel, number, f"{header} belongs to {self.owner[name]}, above {layer} "
                         f"({self.may_include(layer)})")

    def relative(self, rel, number, header):
        if header.startswith("/") or ".." in header.split("/"):
            self.problem(rel, number, f'"{header}": no ../ or absolute includes; name the header '
                         'by its folder ("kit/basic.h") so that the layers can be checked')
            return True
        return False

    def check_source(self, rel, layer):
        folder = os.path.dirname(rel)
        for number, kind, header, _ in self.includes(rel):
            first = header.split("/")[0]
            if kind == "<" and first != "terse" and first not in self.below:
                continue  # the standard library, Highway, Gloo, fmt, ...
            if self.relative(rel, number, header):
                continue
            if first == "terse":
                self.public_header(rel, number, header, layer)
            elif first in self.below:
                if first not in self.allowed(layer):
                    self.problem(rel, number, f"{header} is in {first}, above {layer} "
                                 f"({self.may_include(layer)})")
            elif "/" not in header:
                if not os.path.exists(os.path.join(self.root, folder, header)):
                    self.problem(rel, number, f'"{header}" is not beside {rel}')
            else:
                self.problem(rel, number, f'"{header}" is in no layer')

    def check_public(self, rel):
        name = os.path.relpath(rel, os.path.join("include", "terse")).replace(os.sep, "/")
        layer = self.owner.get(name)
        if layer is None:
            if name not in self.unowned:
                self.unowned.add(name)
                self.problem(rel, 1, f"{rel} belongs to no layer: add it to the PUBLIC_HEADERS of "
                             "its terse_layer() in CMakeLists.txt")
            return
        for number, kind, header, _ in self.includes(rel):
            first = header.split("/")[0]
            if kind == "<" and first != "terse" and first not in self.below:
                continue
            if first == "terse" and not self.relative(rel, number, header):
                self.public_header(rel, number, header, layer)
            elif kind == '"' or first in self.below:
                self.problem(rel, number, f'"{header}": a public header includes only other '
                             "public headers (terse/...), which users have")

    def check_binding(self, rel, reasons_allowed):
        folder = os.path.dirname(rel)
        for number, kind, header, rest in self.includes(rel):
            first = header.split("/")[0]
            if kind == "<" and first != "terse" and first not in self.below:
                continue
            if self.relative(rel, number, header):
                continue
            if first == "terse":
                self.public_header(rel, number, header, None)
            elif first in self.below:
                reason = rest.strip()
                if not reasons_allowed:
                    self.problem(rel, number, f"{header} is internal: the bindings use the public "
                                 "API only (include/terse/)")
                elif not (reason.startswith("//") and reason[2:].strip()):
                    self.problem(rel, number, f"{header} is internal: a tool includes it only "
                                 "with a one-line reason on the same line "
                                 f'(#include "{header}"  // why)')
            elif "/" in header or not os.path.exists(os.path.join(self.root, folder, header)):
                self.problem(rel, number, f'"{header}" is neither public nor beside {rel}')

    def run(self):
        def files(top, exts):
            base = os.path.join(self.root, top)
            for directory, _, names in sorted(os.walk(base)):
                for name in sorted(names):
                    if name.endswith(exts):
                        yield os.path.relpath(os.path.join(directory, name), self.root)

        for rel in files("src", (".cpp", ".h")):
            parts = rel.split(os.sep)
            if len(parts) < 3 or parts[1] not in self.below:
                self.problem(rel, 1, f"{rel} is in no layer (src/LAYER/...: "
                             f"{', '.join(self.below)})")
                continue
            self.check_source(rel, parts[1])
        for rel in files(os.path.join("include", "terse"), (".h",)):
            self.check_public(rel)
        for rel in files(os.path.join("python", "src"), (".cpp", ".h")):
            self.check_binding(rel, reasons_allowed=False)
        for rel in files("tools", (".cpp", ".h")):
            self.check_binding(rel, reasons_allowed=True)
        return self.problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--root", required=True)
    args = parser.parse_args()
    below, owner = read_config(args.config)
    problems = Checker(args.root, below, owner).run()
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"check_layers: {len(problems)} include(s) break the layers "
              "(docs/design.md, \"Layers, one folder each\")", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
