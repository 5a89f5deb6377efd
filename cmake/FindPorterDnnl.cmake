# Finds oneDNN as the imported target porter::dnnl. Debian's dnnl-config.cmake insists on the
# OpenCL development files (it was built with an OpenCL GPU runtime that porter never uses),
# so porter locates the header and library directly instead.
if(NOT TARGET porter::dnnl)
  find_path(PORTER_DNNL_INCLUDE_DIR oneapi/dnnl/dnnl.hpp)
  find_library(PORTER_DNNL_LIBRARY NAMES dnnl)
  if(NOT PORTER_DNNL_INCLUDE_DIR OR NOT PORTER_DNNL_LIBRARY)
    message(FATAL_ERROR "oneDNN not found: install libdnnl-dev (scripts/install-deps.sh)")
  endif()
  add_library(porter::dnnl UNKNOWN IMPORTED)
  set_target_properties(porter::dnnl PROPERTIES
    IMPORTED_LOCATION ${PORTER_DNNL_LIBRARY}
    INTERFACE_INCLUDE_DIRECTORIES ${PORTER_DNNL_INCLUDE_DIR})
endif()
