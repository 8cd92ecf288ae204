# SPDX-License-Identifier: Apache-2.0
# seqpar::kokkos (SEQPAR_ENABLE_KOKKOS AUTO|ON|OFF): the attention kernel on any Kokkos execution
# space (attention::KokkosFlash, kernels/seqpar/kokkos), its context kokkos::KokkosExec with the
# executor's DataOps, and the Kokkos::View adapters. AUTO builds it when find_package(Kokkos) succeeds
# (Debian: libtrilinos-kokkos-dev, Kokkos 3.4.01, Serial backend). Header-only like the rest.
# (A STRING, not option(): option() would turn AUTO into OFF.)
set(SEQPAR_ENABLE_KOKKOS AUTO CACHE STRING "Build the Kokkos kernels seqpar::kokkos: AUTO|ON|OFF")
set_property(CACHE SEQPAR_ENABLE_KOKKOS PROPERTY STRINGS AUTO ON OFF)
string(TOUPPER "${SEQPAR_ENABLE_KOKKOS}" _seqpar_kokkos_mode)
set(SEQPAR_WITH_KOKKOS OFF)
if(NOT _seqpar_kokkos_mode STREQUAL "OFF")
  if(_seqpar_kokkos_mode STREQUAL "ON")
    find_package(Kokkos REQUIRED)
  else()
    find_package(Kokkos QUIET)
  endif()
  if(Kokkos_FOUND AND TARGET Kokkos::kokkos)
    # Debian's Trilinos 13.2 exports Kokkos::kokkos with INTERFACE_INCLUDE_DIRECTORIES=/usr/lib/include,
    # which does not exist (generation fails); point it at the real folder. A correct install is left
    # alone (deps.md section 2).
    get_target_property(_seqpar_kokkos_inc Kokkos::kokkos INTERFACE_INCLUDE_DIRECTORIES)
    if(_seqpar_kokkos_inc AND NOT EXISTS "${_seqpar_kokkos_inc}" AND Kokkos_INCLUDE_DIRS)
      get_filename_component(_seqpar_kokkos_inc "${Kokkos_INCLUDE_DIRS}" REALPATH)
      set_property(TARGET Kokkos::kokkos PROPERTY INTERFACE_INCLUDE_DIRECTORIES "${_seqpar_kokkos_inc}")
    endif()
    set(SEQPAR_WITH_KOKKOS ON)
  elseif(_seqpar_kokkos_mode STREQUAL "ON")
    message(FATAL_ERROR "SEQPAR_ENABLE_KOKKOS=ON but no Kokkos::kokkos target (Debian: libtrilinos-kokkos-dev)")
  endif()
endif()
if(SEQPAR_WITH_KOKKOS)
  add_library(seqpar_kokkos INTERFACE)
  add_library(seqpar::kokkos ALIAS seqpar_kokkos)
  set_target_properties(seqpar_kokkos PROPERTIES EXPORT_NAME kokkos)
  file(GLOB_RECURSE SEQPAR_KOKKOS_HEADERS CONFIGURE_DEPENDS ${CMAKE_CURRENT_LIST_DIR}/seqpar/kokkos.hpp
       ${CMAKE_CURRENT_LIST_DIR}/seqpar/kokkos/*.hpp)
  target_sources(seqpar_kokkos INTERFACE FILE_SET HEADERS BASE_DIRS ${CMAKE_CURRENT_LIST_DIR}
                 FILES ${SEQPAR_KOKKOS_HEADERS})
  set_target_properties(seqpar_kokkos PROPERTIES VERIFY_INTERFACE_HEADER_SETS ${SEQPAR_VERIFY_HEADERS})
  target_link_libraries(seqpar_kokkos INTERFACE seqpar::seqpar Kokkos::kokkos)
  target_compile_definitions(seqpar_kokkos INTERFACE SEQPAR_ENABLE_KOKKOS=1)
endif()
message(STATUS "seqpar: Kokkos kernels (seqpar::kokkos): ${SEQPAR_WITH_KOKKOS} (SEQPAR_ENABLE_KOKKOS=${SEQPAR_ENABLE_KOKKOS})")
