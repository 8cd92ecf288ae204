# SPDX-License-Identifier: Apache-2.0
# Reads cmake/build_flags.json, the compile settings this build shares with the torch extension
# (python/setup.py reads the same file): SEQPAR_FLAGS_CXX_STANDARD, SEQPAR_FLAGS_ARCH,
# SEQPAR_FLAGS_CUDA_ARCHITECTURES, SEQPAR_FLAGS_CUDA_FLAGS and SEQPAR_FLAGS_CUDA_DEFINITIONS (lists).
# Included before project(): the CUDA architectures must be known before the language is enabled.
set(_seqpar_flags_file ${CMAKE_CURRENT_LIST_DIR}/build_flags.json)
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${_seqpar_flags_file})
file(READ ${_seqpar_flags_file} _seqpar_flags_json)
string(JSON SEQPAR_FLAGS_CXX_STANDARD GET "${_seqpar_flags_json}" cxx_standard)
string(JSON SEQPAR_FLAGS_ARCH GET "${_seqpar_flags_json}" arch)
foreach(_key IN ITEMS cuda_architectures cuda_flags cuda_definitions)
  string(TOUPPER "SEQPAR_FLAGS_${_key}" _var)
  set(${_var} "")
  string(JSON _count LENGTH "${_seqpar_flags_json}" ${_key})
  if(_count GREATER 0)
    math(EXPR _last "${_count} - 1")
    foreach(_i RANGE ${_last})
      string(JSON _item GET "${_seqpar_flags_json}" ${_key} ${_i})
      list(APPEND ${_var} "${_item}")
    endforeach()
  endif()
endforeach()
unset(_seqpar_flags_json)
