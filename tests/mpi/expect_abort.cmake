# SPDX-License-Identifier: Apache-2.0
# cmake -DMPIEXEC=... -DNPFLAG=... -DEXE=... -P expect_abort.cmake
# Passes when the MPI job exits non-zero AND its output says "seqpar: rank 1 failed" (ctest's
# PASS_REGULAR_EXPRESSION alone would ignore the exit code).
execute_process(COMMAND ${MPIEXEC} ${NPFLAG} 2 ${EXE}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
message(STATUS "exit: ${rc}\nstdout:\n${out}\nstderr:\n${err}")
if(rc EQUAL 0)
  message(FATAL_ERROR "the job exited 0; a failing rank must end it with a non-zero exit")
endif()
if(NOT "${out}${err}" MATCHES "seqpar: rank 1 failed: injected failure mid-run")
  message(FATAL_ERROR "the job's output does not contain 'seqpar: rank 1 failed: injected failure mid-run'")
endif()
