# Installs seqpar into a scratch prefix, then configures, builds and runs a consumer project that
# finds it with find_package(seqpar CONFIG): the way users consume the library. COMPONENTS (comma-
# separated): the components the calling build has; each must install, be found and build a program.
file(REMOVE_RECURSE ${WORK_DIR})
string(REPLACE "," ";" components "${COMPONENTS}")
set(prefix ${WORK_DIR}/prefix)
foreach(step
    "${CMAKE_COMMAND};-S;${SOURCE_DIR};-B;${WORK_DIR}/seqpar;-G;${GENERATOR};-DCMAKE_CXX_COMPILER=${CXX};-DSEQPAR_BUILD_TESTS=OFF;-DSEQPAR_BUILD_EXAMPLES=OFF;-DSEQPAR_BUILD_BENCH=OFF;-DSEQPAR_BUILD_TOOLS=OFF;-DSEQPAR_INSTALL=ON;-DCMAKE_INSTALL_PREFIX=${prefix}"
    "${CMAKE_COMMAND};--install;${WORK_DIR}/seqpar"
    "${CMAKE_COMMAND};-S;${SOURCE_DIR}/tests/packaging/consumer;-B;${WORK_DIR}/consumer;-G;${GENERATOR};-DCMAKE_CXX_COMPILER=${CXX};-DCMAKE_PREFIX_PATH=${prefix};-DSEQPAR_COMPONENTS=${COMPONENTS}"
    "${CMAKE_COMMAND};--build;${WORK_DIR}/consumer"
    "${WORK_DIR}/consumer/seqpar_consumer")
  execute_process(COMMAND ${step} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "packaging step failed (${rc}): ${step}\n${out}\n${err}")
  endif()
endforeach()
message(STATUS "consumer ran: ${out}")
foreach(component IN LISTS components)
  if(NOT EXISTS ${WORK_DIR}/consumer/seqpar_consumer_${component})
    message(FATAL_ERROR "the consumer of seqpar::${component} was not built")
  endif()
endforeach()
message(STATUS "components built against the installed tree: ${COMPONENTS}")
