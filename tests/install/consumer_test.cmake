# The install_consumer test (cmake -P): installs this build with `cmake --install` into a fresh
# prefix, then configures, builds and runs tests/install/consumer against it, as a C++ user
# would, and runs the installed `terse` command.
#   -DBUILD_DIR=... -DPROJECT_DIR=... -DWORK_DIR=... -DGENERATOR=... -DCXX=...
include(${CMAKE_CURRENT_LIST_DIR}/install_and_build.cmake)
run(${WORK_DIR}/build/consumer)
run(${prefix}/bin/terse codecs)
