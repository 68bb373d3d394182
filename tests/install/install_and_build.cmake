# Shared by the install tests (cmake -P scripts): installs the build BUILD_DIR with `cmake --install`
# into a fresh prefix under WORK_DIR, then configures and builds the project PROJECT_DIR against
# that prefix only (find_package(terse CONFIG)). Defines run(COMMAND...), which fails the test
# with the command line when a command fails, and `prefix`.
#   BUILD_DIR, PROJECT_DIR, WORK_DIR, GENERATOR, CXX must be set.
foreach(var BUILD_DIR PROJECT_DIR WORK_DIR GENERATOR CXX)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "${CMAKE_SCRIPT_MODE_FILE}: ${var} not set")
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
run(${CMAKE_COMMAND} -S ${PROJECT_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
    -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=${prefix})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
