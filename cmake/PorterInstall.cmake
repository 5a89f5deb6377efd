# Exports porter's targets so that out-of-tree projects can call find_package(porter).
include(CMakePackageConfigHelpers)
set(PORTER_CMAKE_DIR lib/cmake/porter)
install(FILES ${PROJECT_BINARY_DIR}/generated/base/build_config.h DESTINATION include/porter/base)
install(EXPORT porterTargets NAMESPACE porter:: DESTINATION ${PORTER_CMAKE_DIR})
configure_package_config_file(cmake/porterConfig.cmake.in
  ${PROJECT_BINARY_DIR}/porterConfig.cmake INSTALL_DESTINATION ${PORTER_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/porterConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/porterConfig.cmake ${PROJECT_BINARY_DIR}/porterConfigVersion.cmake
  ${PROJECT_SOURCE_DIR}/cmake/FindPorterDnnl.cmake
  DESTINATION ${PORTER_CMAKE_DIR})
