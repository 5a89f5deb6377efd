# CUDA detection. PORTER_CUDA=AUTO builds the cuda device when nvcc is found, ON requires it,
# OFF never looks. Sets PORTER_WITH_CUDA (0/1) for build_config.h.
set(PORTER_WITH_CUDA 0)
if(NOT PORTER_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    enable_language(CUDA)
    # CMake < 3.26 has no CUDA20 flags for nvcc (it would refuse the dialect); nvcc >= 12
    # takes -std=c++20, so tell CMake the flag.
    if(NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION
       AND CMAKE_CUDA_COMPILER_ID STREQUAL "NVIDIA"
       AND CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL 12.0)
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    endif()
    set(CMAKE_CUDA_STANDARD 20)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    find_package(CUDAToolkit REQUIRED)
    set(PORTER_WITH_CUDA 1)
  elseif(PORTER_CUDA STREQUAL "ON")
    message(FATAL_ERROR "PORTER_CUDA=ON but no CUDA compiler was found (is nvcc on PATH?)")
  endif()
endif()
message(STATUS "porter: CUDA device ${PORTER_WITH_CUDA} (PORTER_CUDA=${PORTER_CUDA})")
