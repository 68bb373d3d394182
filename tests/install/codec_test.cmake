# The install_codec test (cmake -P): installs this build with `cmake --install` into a fresh
# prefix, then builds tests/install/codec, a codec written outside terse's tree, against the
# installed headers and library only, and runs its contract tests and a 2-rank allreduce started
# by the installed `terse run`.
#   -DBUILD_DIR=... -DCODEC_DIR=... -DWORK_DIR=... -DGENERATOR=... -DCXX=...
foreach(var BUILD_DIR CODEC_DIR WORK_DIR GENERATOR CXX)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "codec_test.cmake: ${var} not set")
  endif()
endforeach()

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE status)
  if(NOT status EQUAL 0)
    string(REPLACE ";" " " command "${ARGN}")
    message(FATAL_ERROR "failed (${status}): ${command}")
  endif()
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
run(${CMAKE_COMMAND} -S ${CODEC_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
    -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=${prefix})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/stc_test)
run(${CMAKE_COMMAND} -E env TERSE_TIMEOUT=60
    ${prefix}/bin/terse run -n 2 -- ${WORK_DIR}/build/stc_allreduce)
