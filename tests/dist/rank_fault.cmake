# Runs rank_fault under mpiexec -np 2 with rank 1 killed (FAULT=kill) or
# frozen (FAULT=stop), and passes only if rank 0 raised the collective's
# timeout error within TIMEOUT (+ slack for a loaded machine) and the job
# ended. Run as: cmake -DMPIEXEC=... -DPROGRAM=... -DFAULT=kill|stop
#                      -DTIMEOUT=seconds -DREPORT=file -P this file
file(REMOVE "${REPORT}")
set(launch ${MPIEXEC} -np 2 --oversubscribe)
if(FAULT STREQUAL "kill")
  # Without it mpirun would end rank 0 itself as soon as rank 1 dies.
  list(APPEND launch --enable-recovery)
endif()
string(TIMESTAMP began "%s")
execute_process(
  COMMAND ${launch} "${PROGRAM}" ${FAULT} ${TIMEOUT} "${REPORT}"
  RESULT_VARIABLE status
  OUTPUT_VARIABLE out
  ERROR_VARIABLE out
  TIMEOUT 90)
string(TIMESTAMP ended "%s")
math(EXPR took "${ended} - ${began}")
if(status MATCHES "timeout")
  message(FATAL_ERROR "the job did not end within 90 s (rank 0 hangs?):\n${out}")
endif()
if(NOT EXISTS "${REPORT}")
  message(FATAL_ERROR "rank 0 wrote no report (exit status ${status}):\n${out}")
endif()
file(READ "${REPORT}" report)
if(NOT report MATCHES "^raised after ([0-9.e+-]+) s\n")
  message(FATAL_ERROR "rank 0 did not raise:\n${report}\nmpiexec said:\n${out}")
endif()
set(waited ${CMAKE_MATCH_1})
set(expect "MPI_Allreduce of [0-9]+ (float|double|uint64) value\\(s\\) timed out on rank 0 of 2 after [0-9.]+ s \\(timeout ${TIMEOUT} s\\): another rank died, hangs or made a different call")
if(NOT report MATCHES "${expect}")
  message(FATAL_ERROR "rank 0 raised, but not the timeout error\nexpected (regex): ${expect}\n"
                      "report:\n${report}")
endif()
# The wait runs from the end of rank 0's step 3: rank 0 computes its share
# of step 4, then waits TIMEOUT for rank 1.
math(EXPR most "${TIMEOUT} + 10")
if(waited LESS ${TIMEOUT} OR waited GREATER ${most})
  message(FATAL_ERROR "rank 0 raised ${waited} s after its last step; expected ${TIMEOUT} to ${most} s")
endif()
if(FAULT STREQUAL "stop" AND status EQUAL 0)
  message(FATAL_ERROR "the job ended with status 0; rank 0's MPI_Abort should end it with 1:\n${out}")
endif()
message(STATUS "rank 0 raised ${waited} s after its last step; the job ended in ${took} s "
               "(status ${status}):\n${report}")
