#!/usr/bin/env python3
"""The layers_libterse_exports_the_public_api_only test: libterse's dynamic symbol table holds the
API of include/terse/ (a sample of each header is looked for) and nothing of the layers'
internal namespaces.

    exports_test.py LIBTERSE
"""

import subprocess
import sys

# Internal namespaces of src/. terse::wire:: and terse::sparse:: are not among them: codec_kit.h
# makes their payload helpers public for codecs written outside the tree.
INTERNAL = ["terse::planner::", "terse::kit::", "terse::codecs::",
            "terse::transport::", "terse::tags::", "terse::collectives::", "terse::engine::",
            "terse::HandleAccess"]

# One or more declarations of each public header, as nm -C spells them.
PUBLIC = [
    "typeinfo for terse::Error", "typeinfo for terse::TimeoutError",  # error.h
    "terse::to_string(terse::DType)",  # dtype.h
    "terse::Communicator::create(", "terse::Request::wait(", "terse::make_tcp_store(",  # communicator.h
    "terse::make_codec(", "terse::registered_codecs()", "terse::Codec::decode(",  # codec.h
    "terse::SpecReader::SpecReader(", "terse::fnv1a64(",  # spec.h
    "terse::TraceRecorder::write_chrome_json(", "terse::measure_clock_offset(",  # trace.h
    "terse::parse_strategy(", "terse::to_string(terse::Strategy)",  # plan.h
    "terse::Engine::Engine(", "terse::Handle::wait()",  # engine.h
    "terse::Channel::Channel(",  # channel.h
    "terse::wire::Reader::need(", "terse::sparse::write(",  # codec_kit.h
]


def main():
    nm = subprocess.run(["nm", "-DC", "--defined-only", sys.argv[1]], capture_output=True,
                        text=True, check=True)
    symbols = [line.split(" ", 2)[2] for line in nm.stdout.splitlines() if line.count(" ") >= 2]
    leaked = [s for s in symbols if any(ns in s for ns in INTERNAL)]
    missing = [p for p in PUBLIC if not any(s.startswith(p) for s in symbols)]
    for s in leaked[:20]:
        print(f"exported but internal: {s}")
    for p in missing:
        print(f"public but not exported: {p}")
    print(f"libterse exports {len(symbols)} symbols; {len(leaked)} internal, {len(missing)} of "
          f"{len(PUBLIC)} public ones missing")
    sys.exit(1 if leaked or missing else 0)


if __name__ == "__main__":
    main()
