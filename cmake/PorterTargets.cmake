# porter_add_library(<name> SOURCES ... [DEPS ...] [PRIVATE_DEPS ...])
# One folder = one library target porter_<name>, exported as porter::<name>.
set(PORTER_WARNINGS -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wno-unused-parameter)

set(PORTER_SANITIZE_FLAGS "")
if(PORTER_SANITIZE)
  string(REPLACE ";" "," _san "${PORTER_SANITIZE}")
  set(PORTER_SANITIZE_FLAGS -fsanitize=${_san} -fno-omit-frame-pointer -fno-sanitize-recover=all)
endif()

function(porter_target_defaults target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${PORTER_WARNINGS}>)
  if(PORTER_SANITIZE_FLAGS)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${PORTER_SANITIZE_FLAGS}>)
    target_link_options(${target} PRIVATE ${PORTER_SANITIZE_FLAGS})
  endif()
endfunction()

function(porter_add_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(porter_${name} ${ARG_SOURCES})
  add_library(porter::${name} ALIAS porter_${name})
  set_target_properties(porter_${name} PROPERTIES EXPORT_NAME ${name} OUTPUT_NAME porter_${name})
  target_include_directories(porter_${name} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}>
    $<BUILD_INTERFACE:${PROJECT_BINARY_DIR}/generated>
    $<INSTALL_INTERFACE:include/porter>
    $<INSTALL_INTERFACE:include>)
  target_compile_features(porter_${name} PUBLIC cxx_std_20)
  target_link_libraries(porter_${name} PUBLIC ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  porter_target_defaults(porter_${name})
  if(PORTER_SANITIZE_FLAGS)
    # Consumers of a sanitized library must link the sanitizer runtime too.
    target_link_options(porter_${name} INTERFACE ${PORTER_SANITIZE_FLAGS})
  endif()
  install(TARGETS porter_${name} EXPORT porterTargets)
  install(DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}/ DESTINATION include/porter/${name}
          FILES_MATCHING PATTERN "*.h")
endfunction()
