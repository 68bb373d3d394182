# The install_codec test (cmake -P): installs this build with `cmake --install` into a fresh
# prefix, then builds tests/install/codec, a codec written outside terse's tree, against the
# installed headers and library only, and runs its contract tests and a 2-rank allreduce started
# by the installed `terse run`.
#   -DBUILD_DIR=... -DPROJECT_DIR=... -DWORK_DIR=... -DGENERATOR=... -DCXX=...
include(${CMAKE_CURRENT_LIST_DIR}/install_and_build.cmake)
run(${WORK_DIR}/build/stc_test)
run(${CMAKE_COMMAND} -E env TERSE_TIMEOUT=60
    ${prefix}/bin/terse run -n 2 -- ${WORK_DIR}/build/stc_allreduce)
