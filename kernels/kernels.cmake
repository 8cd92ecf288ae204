# SPDX-License-Identifier: Apache-2.0
# Device kernels (kernels/seqpar/<backend>/): the design card's top-level kernels/, apart from the
# pure C++20 headers of include/ (as stdexec keeps nvexec/ apart), each behind its own target and option.
#
# seqpar::cuda (SEQPAR_ENABLE_CUDA AUTO|ON|OFF; the C++ namespace and folder are seqpar::gpu,
# kernels/seqpar/gpu/; the target and macros keep the name cuda): CUDA attention kernels over slice tables
# (attention::CudaFlash), the executor's pack / unpack / zero / merge kernels
# (runtime::DataOps<gpu::CudaExec>) and the stream-ordered execution context gpu::CudaExec. AUTO
# builds it when nvcc is found. Header-only like the rest: the .cuh headers are compiled by the
# user's .cu translation units; the .hpp headers (context, memory, errors, and the classes CudaFlash
# and DataOps<CudaExec> with their launches declared) also compile with g++.
# Included by the top-level CMakeLists.txt, not added as a subdirectory: a language must be enabled in
# the highest directory whose targets (tests/, bench/) compile it.
# (A STRING, not option(): option() would turn AUTO into OFF.)
set(SEQPAR_ENABLE_CUDA AUTO CACHE STRING "Build the CUDA kernels seqpar::cuda: AUTO|ON|OFF")
set_property(CACHE SEQPAR_ENABLE_CUDA PROPERTY STRINGS AUTO ON OFF)
string(TOUPPER "${SEQPAR_ENABLE_CUDA}" _seqpar_cuda_mode)
set(SEQPAR_WITH_CUDA OFF)
if(NOT _seqpar_cuda_mode STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    enable_language(CUDA)
    if(CMAKE_VERSION VERSION_LESS 3.26 AND CMAKE_CUDA_COMPILER_ID STREQUAL "NVIDIA")
      # CMake 3.25 knows no CUDA20 flag for nvcc ("...dialect CUDA20 ... not support"): deps.md §4.
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    endif()
    set(CMAKE_CUDA_STANDARD ${SEQPAR_FLAGS_CXX_STANDARD})
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    set(CMAKE_CUDA_EXTENSIONS OFF)
    find_package(CUDAToolkit REQUIRED)
    set(SEQPAR_WITH_CUDA ON)
  elseif(_seqpar_cuda_mode STREQUAL "ON")
    message(FATAL_ERROR "SEQPAR_ENABLE_CUDA=ON but no CUDA compiler (nvcc) was found")
  endif()
endif()
if(SEQPAR_WITH_CUDA)
  add_library(seqpar_cuda INTERFACE)
  add_library(seqpar::cuda ALIAS seqpar_cuda)
  set_target_properties(seqpar_cuda PROPERTIES EXPORT_NAME cuda)
  target_include_directories(seqpar_cuda INTERFACE $<BUILD_INTERFACE:${CMAKE_CURRENT_LIST_DIR}>
                                                   $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  target_link_libraries(seqpar_cuda INTERFACE seqpar::seqpar CUDA::cudart)
  target_compile_definitions(seqpar_cuda INTERFACE ${SEQPAR_FLAGS_CUDA_DEFINITIONS})
  # The host-only headers (.hpp: context, memory, errors, slice upload, tile arithmetic) compile with
  # the C++ compiler too; they are a header set, checked alone by all_verify_interface_header_sets.
  # The .cuh headers need nvcc and are compiled by the CUDA tests and benchmarks.
  file(GLOB_RECURSE SEQPAR_CUDA_HOST_HEADERS CONFIGURE_DEPENDS ${CMAKE_CURRENT_LIST_DIR}/seqpar/gpu/*.hpp)
  # cudnn_sdpa_impl.hpp needs cudnn-frontend: seqpar::cudnn's instance compiles it (kernels/cudnn.cmake).
  list(FILTER SEQPAR_CUDA_HOST_HEADERS EXCLUDE REGEX "cudnn_sdpa_impl\\.hpp$")
  target_sources(seqpar_cuda INTERFACE FILE_SET HEADERS BASE_DIRS ${CMAKE_CURRENT_LIST_DIR}
                 FILES ${SEQPAR_CUDA_HOST_HEADERS})
  set_target_properties(seqpar_cuda PROPERTIES VERIFY_INTERFACE_HEADER_SETS ${SEQPAR_VERIFY_HEADERS})
  # Device lambdas and constexpr host functions (AttnSlice::area, Mask) called from device code
  # (cmake/build_flags.json's cuda_flags, which the torch extension's CUDA build passes too).
  target_compile_options(seqpar_cuda INTERFACE "$<$<COMPILE_LANGUAGE:CUDA>:${SEQPAR_FLAGS_CUDA_FLAGS}>")

  # seqpar::cuda_instances (the project's tests, benchmarks and examples; not installed): CudaFlash<T>
  # and DataOps<CudaExec> compiled once, for T = float, __half, __nv_bfloat16, so that their host code
  # (strategies, engines, transports, doctest cases) is plain C++ that includes the .hpp headers
  # (flash.hpp, data_ops.hpp) and links these. nvcc runs its front end once per architecture, so a
  # .cu that instantiated the strategy matrix paid for it three times over, and every .cu that
  # included flash.cuh compiled the kernels again (CI time: 1632 s of a 30-minute budget, 2026-12-03).
  file(GLOB SEQPAR_CUDA_INSTANCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_LIST_DIR}/instances/*.cu)
  add_library(seqpar_cuda_instances STATIC ${SEQPAR_CUDA_INSTANCES})
  add_library(seqpar::cuda_instances ALIAS seqpar_cuda_instances)
  target_link_libraries(seqpar_cuda_instances PUBLIC seqpar::cuda PRIVATE seqpar_project_options)
endif()
message(STATUS "seqpar: CUDA kernels (seqpar::cuda): ${SEQPAR_WITH_CUDA} (SEQPAR_ENABLE_CUDA=${SEQPAR_ENABLE_CUDA})")
