# Runs the porter binary and checks its exit code and output; used by tests/cli/CMakeLists.txt.
#   cmake -DPORTER=<exe> -DARGS=<a;b;c> -DEXPECT_RC=<n> -DEXPECT_REGEX=<re> -P run_porter.cmake
execute_process(COMMAND ${PORTER} ${ARGS}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(all "${out}${err}")
if(NOT rc EQUAL EXPECT_RC)
  message(FATAL_ERROR "porter ${ARGS}: exit code ${rc}, expected ${EXPECT_RC}\n${all}")
endif()
if(NOT all MATCHES "${EXPECT_REGEX}")
  message(FATAL_ERROR "porter ${ARGS}: output does not match '${EXPECT_REGEX}'\n${all}")
endif()
