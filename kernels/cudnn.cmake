# SPDX-License-Identifier: Apache-2.0
# seqpar::cudnn (SEQPAR_ENABLE_CUDNN AUTO|ON|OFF): attention::CudnnSdpa, cuDNN's fused attention behind
# the kernel protocol (kernels/seqpar/gpu/cudnn_sdpa.hpp). Needs seqpar::cuda, cuDNN 9 (<cudnn.h> and
# libcudnn: CUDNN_ROOT, the CUDA toolkit's folders, or the system's) and cudnn-frontend's headers
# (header-only: CUDNN_FRONTEND_ROOT, or build/cudnn_frontend, where cmake/install_cudnn_frontend.sh puts
# them from PyPI). AUTO builds it when all are found.
# seqpar::cudnn_instances (the project's tests and benchmarks; not installed): CudnnSdpa<__half> and
# CudnnSdpa<__nv_bfloat16> compiled once (kernels/instances_cudnn/), plain C++ over cudnn-frontend.
set(SEQPAR_ENABLE_CUDNN AUTO CACHE STRING "Build attention::CudnnSdpa (seqpar::cudnn): AUTO|ON|OFF")
set_property(CACHE SEQPAR_ENABLE_CUDNN PROPERTY STRINGS AUTO ON OFF)
string(TOUPPER "${SEQPAR_ENABLE_CUDNN}" _seqpar_cudnn_mode)
set(SEQPAR_WITH_CUDNN OFF)
if(SEQPAR_WITH_CUDA AND NOT _seqpar_cudnn_mode STREQUAL "OFF")
  find_path(SEQPAR_CUDNN_INCLUDE_DIR cudnn.h HINTS ${CUDNN_ROOT} $ENV{CUDNN_ROOT} ${CUDAToolkit_INCLUDE_DIRS}
            PATH_SUFFIXES include)
  find_library(SEQPAR_CUDNN_LIBRARY NAMES cudnn libcudnn.so.9 HINTS ${CUDNN_ROOT} $ENV{CUDNN_ROOT}
               ${CUDAToolkit_LIBRARY_DIR} PATH_SUFFIXES lib lib64)
  find_path(SEQPAR_CUDNN_FRONTEND_INCLUDE_DIR cudnn_frontend.h
            HINTS ${CUDNN_FRONTEND_ROOT} $ENV{CUDNN_FRONTEND_ROOT} ${PROJECT_SOURCE_DIR}/build/cudnn_frontend
            PATH_SUFFIXES include)
  if(SEQPAR_CUDNN_INCLUDE_DIR AND SEQPAR_CUDNN_LIBRARY AND SEQPAR_CUDNN_FRONTEND_INCLUDE_DIR)
    set(SEQPAR_WITH_CUDNN ON)
  endif()
endif()
if(_seqpar_cudnn_mode STREQUAL "ON" AND NOT SEQPAR_WITH_CUDNN)
  message(FATAL_ERROR "SEQPAR_ENABLE_CUDNN=ON but seqpar::cuda (${SEQPAR_WITH_CUDA}), cudnn.h "
                      "(${SEQPAR_CUDNN_INCLUDE_DIR}), libcudnn (${SEQPAR_CUDNN_LIBRARY}) or cudnn_frontend.h "
                      "(${SEQPAR_CUDNN_FRONTEND_INCLUDE_DIR}) is missing: run cmake/install_cudnn_frontend.sh, "
                      "or set CUDNN_ROOT / CUDNN_FRONTEND_ROOT")
endif()
if(SEQPAR_WITH_CUDNN)
  add_library(seqpar_cudnn INTERFACE)
  add_library(seqpar::cudnn ALIAS seqpar_cudnn)
  set_target_properties(seqpar_cudnn PROPERTIES EXPORT_NAME cudnn)
  # SYSTEM: cudnn-frontend's headers are not held to the project's -Werror.
  # Installed: the config finds both again (the frontend may live in this source tree's build/).
  target_include_directories(seqpar_cudnn SYSTEM INTERFACE $<BUILD_INTERFACE:${SEQPAR_CUDNN_FRONTEND_INCLUDE_DIR}>
                                                           $<BUILD_INTERFACE:${SEQPAR_CUDNN_INCLUDE_DIR}>)
  # cudnn-frontend compiles some engines at run time (NVRTC) and loads them through the driver API.
  target_link_libraries(seqpar_cudnn INTERFACE seqpar::cuda $<BUILD_INTERFACE:${SEQPAR_CUDNN_LIBRARY}> CUDA::nvrtc
                                               CUDA::cuda_driver)
  target_compile_definitions(seqpar_cudnn INTERFACE SEQPAR_ENABLE_CUDNN=1)
  file(GLOB SEQPAR_CUDNN_INSTANCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_LIST_DIR}/instances_cudnn/*.cpp)
  add_library(seqpar_cudnn_instances STATIC ${SEQPAR_CUDNN_INSTANCES})
  add_library(seqpar::cudnn_instances ALIAS seqpar_cudnn_instances)
  target_link_libraries(seqpar_cudnn_instances PUBLIC seqpar::cudnn seqpar::cuda_instances
                                               PRIVATE seqpar_project_options)
endif()
message(STATUS "seqpar: cuDNN SDPA kernel (seqpar::cudnn): ${SEQPAR_WITH_CUDNN} (SEQPAR_ENABLE_CUDNN=${SEQPAR_ENABLE_CUDNN})")
