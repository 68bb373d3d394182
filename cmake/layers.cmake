# One static library per folder of src/, linked only to the layers below it, so that the build
# refuses an upward include (docs/design.md, "Layers, one folder each"):
#
#   terse_layer(NAME [BELOW layer...] [PUBLIC_HEADERS header...])
#
# makes terse_NAME from src/NAME/**/*.cpp and terse::NAME, what everything else links: the same
# library taken whole (every object file, so that each codec's static registrar is linked and
# runs), with the layers BELOW it. A layer's sources see an include root of their own,
# ${PROJECT_BINARY_DIR}/layers/NAME, holding a link to src/NAME and to each layer below it and
# nothing else: `#include "engine/tags.h"` from src/collectives/ is "file not found".
# include/terse/ is one directory on every path, so which public header belongs to which layer
# (PUBLIC_HEADERS, named from include/terse/: "codec.h", "sub/x.h") is checked by
# cmake/check_layers.py, run before any layer compiles, which also refuses `../` includes and
# internal headers in python/ and tools/.

set(TERSE_LAYERS "")
set(TERSE_LAYER_CONFIG "")
set(TERSE_LAYER_ROOTS ${PROJECT_BINARY_DIR}/layers)
find_package(Python3 REQUIRED COMPONENTS Interpreter)
# Every layer waits for this target; terse_layer_check() gives it the check once all are known.
add_custom_target(terse_layer_check)

# Third-party libraries every layer may use (the layers' own links say what lies below them).
add_library(terse_third_party INTERFACE)
target_link_libraries(terse_third_party INTERFACE Threads::Threads fmt::fmt PkgConfig::HWY
                      nlohmann_json::nlohmann_json)
if(OpenBLAS_FOUND)
  target_link_libraries(terse_third_party INTERFACE ${OpenBLAS_LIBRARIES})
  target_include_directories(terse_third_party INTERFACE ${OpenBLAS_INCLUDE_DIRS})
else()
  find_library(OPENBLAS_LIB openblas REQUIRED)
  target_link_libraries(terse_third_party INTERFACE ${OPENBLAS_LIB})
endif()
find_library(GLOO_LIB gloo)
if(GLOO_LIB)
  target_link_libraries(terse_third_party INTERFACE ${GLOO_LIB})
endif()

function(terse_layer name)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "" "BELOW;PUBLIC_HEADERS")
  # Everything below: the layers named and what lies below each of them.
  set(below "")
  foreach(lower ${arg_BELOW})
    if(NOT lower IN_LIST TERSE_LAYERS)
      message(FATAL_ERROR "terse_layer(${name}): ${lower} is not a layer defined before it")
    endif()
    list(APPEND below ${lower} ${TERSE_LAYER_BELOW_${lower}})
  endforeach()
  list(REMOVE_DUPLICATES below)

  # Links made once and kept, so that a new configure does not touch what the depfiles name.
  set(root ${TERSE_LAYER_ROOTS}/${name})
  file(MAKE_DIRECTORY ${root})
  file(GLOB present RELATIVE ${root} ${root}/*)
  foreach(entry ${present})
    if(NOT entry IN_LIST below AND NOT entry STREQUAL name)
      file(REMOVE ${root}/${entry})
    endif()
  endforeach()
  foreach(folder ${name} ${below})
    set(target "")
    if(IS_SYMLINK ${root}/${folder})
      file(READ_SYMLINK ${root}/${folder} target)
    endif()
    if(NOT target STREQUAL "${PROJECT_SOURCE_DIR}/src/${folder}")
      file(REMOVE ${root}/${folder})
      file(CREATE_LINK ${PROJECT_SOURCE_DIR}/src/${folder} ${root}/${folder} SYMBOLIC)
    endif()
  endforeach()

  file(GLOB_RECURSE sources CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/${name}/*.cpp)
  add_library(terse_${name} STATIC ${sources})
  target_include_directories(terse_${name} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include> $<BUILD_INTERFACE:${root}>)
  target_compile_features(terse_${name} PUBLIC cxx_std_20)
  # No implicit fused multiply-add: GCC contracts a*b+c into FMA on AVX2/AVX-512 but not on
  # SSE4, and results must be the same bits on every instruction set the kit dispatches to, in
  # scalar tails and in the tests' scalar references (DGC's update, TernGrad's clipped variance).
  target_compile_options(terse_${name} PRIVATE ${TERSE_WARNINGS} -ffp-contract=off)
  # The objects also make libterse, which exports only what include/terse/ marks TERSE_API.
  set_target_properties(terse_${name} PROPERTIES CXX_VISIBILITY_PRESET hidden
                        VISIBILITY_INLINES_HIDDEN ON)
  target_link_libraries(terse_${name} PUBLIC terse_third_party)
  foreach(lower ${arg_BELOW})
    target_link_libraries(terse_${name} PUBLIC terse::${lower})
  endforeach()
  add_dependencies(terse_${name} terse_layer_check)

  add_library(terse_${name}_whole INTERFACE)
  target_link_libraries(terse_${name}_whole INTERFACE
                        "$<LINK_LIBRARY:WHOLE_ARCHIVE,terse_${name}>")
  add_library(terse::${name} ALIAS terse_${name}_whole)

  set(TERSE_LAYER_BELOW_${name} ${below} PARENT_SCOPE)
  set(layers ${TERSE_LAYERS} ${name})
  set(TERSE_LAYERS ${layers} PARENT_SCOPE)
  string(REPLACE ";" "," below_list "${below}")
  string(REPLACE ";" "," header_list "${arg_PUBLIC_HEADERS}")
  set(config ${TERSE_LAYER_CONFIG} "layer ${name} below=${below_list} headers=${header_list}")
  set(TERSE_LAYER_CONFIG ${config} PARENT_SCOPE)
endfunction()

# The check of every include in src/, include/terse/, python/src/ and tools/, run once before the
# layers compile and again whenever one of those files changes.
function(terse_layer_check)
  string(REPLACE ";" "\n" config "${TERSE_LAYER_CONFIG}")
  file(CONFIGURE OUTPUT ${TERSE_LAYER_ROOTS}/layers.txt CONTENT "${config}\n")
  file(GLOB_RECURSE checked CONFIGURE_DEPENDS
       ${PROJECT_SOURCE_DIR}/src/*.cpp ${PROJECT_SOURCE_DIR}/src/*.h
       ${PROJECT_SOURCE_DIR}/include/terse/*.h
       ${PROJECT_SOURCE_DIR}/python/src/*.cpp ${PROJECT_SOURCE_DIR}/python/src/*.h
       ${PROJECT_SOURCE_DIR}/tools/*.cpp ${PROJECT_SOURCE_DIR}/tools/*.h)
  set(stamp ${TERSE_LAYER_ROOTS}/check.stamp)
  add_custom_command(OUTPUT ${stamp}
    COMMAND ${Python3_EXECUTABLE} ${PROJECT_SOURCE_DIR}/cmake/check_layers.py
            --config ${TERSE_LAYER_ROOTS}/layers.txt --root ${PROJECT_SOURCE_DIR}
    COMMAND ${CMAKE_COMMAND} -E touch ${stamp}
    DEPENDS ${checked} ${PROJECT_SOURCE_DIR}/cmake/check_layers.py
            ${TERSE_LAYER_ROOTS}/layers.txt
    COMMENT "Checking that includes follow the layers (cmake/check_layers.py)" VERBATIM)
  add_custom_target(terse_layer_check_run DEPENDS ${stamp})
  add_dependencies(terse_layer_check terse_layer_check_run)
endfunction()
