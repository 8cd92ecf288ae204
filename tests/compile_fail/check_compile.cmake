# SPDX-License-Identifier: Apache-2.0
# Compiles one file of tests/compile_fail (a CTest of tests/CMakeLists.txt, label compile_fail):
#   cmake -DCXX=<compiler> -DFLAGS=<flags joined by '|'> -DSOURCE=<file.cpp> -P check_compile.cmake
# A *_fail*.cpp passes when the compiler rejects it AND the first error it reports is the failed
# static assertion whose sentence the file names on its "// expect: <sentence>" line (another error,
# or the right sentence only after another error, fails). Any other file must compile.
string(REPLACE "|" ";" flags "${FLAGS}")
get_filename_component(name "${SOURCE}" NAME)
execute_process(COMMAND "${CXX}" ${flags} "${SOURCE}" RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(context "${CXX} ${flags} ${SOURCE}\n--- exit code: ${code}\n--- output:\n${out}${err}")

if(NOT name MATCHES "_fail")
  if(NOT code EQUAL 0)
    message(FATAL_ERROR "${name} must compile\n${context}")
  endif()
  return()
endif()

file(READ "${SOURCE}" text)
# "// expect: <sentence>", continued on following lines "//<two or more spaces><more of the sentence>".
string(REGEX MATCH "// expect: [^\n]+(\n//  +[^\n]+)*" expect "${text}")
string(REGEX REPLACE "\n//  +" " " expect "${expect}")
string(REGEX REPLACE "^// expect: " "" expect "${expect}")
if(expect STREQUAL "")
  message(FATAL_ERROR "${name} names no expected sentence (a line '// expect: <static_assert message>')")
endif()
if(code EQUAL 0)
  message(FATAL_ERROR "${name} compiled; it must fail with \"${expect}\"\n${context}")
endif()
string(REGEX MATCH "[^\n]*error: [^\n]*" first_error "${out}${err}")
string(FIND "${first_error}" "static assertion failed" is_static_assert)
string(FIND "${first_error}" "${expect}" has_sentence)
if(is_static_assert EQUAL -1 OR has_sentence EQUAL -1)
  message(FATAL_ERROR "${name}: the first error is not the static assertion \"${expect}\":\n  ${first_error}\n${context}")
endif()
message(STATUS "${name}: rejected with \"${expect}\"")
