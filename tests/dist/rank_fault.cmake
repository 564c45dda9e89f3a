# Runs rank_fault under mpiexec -np RANKS with the last rank killed
# (FAULT=kill) or frozen (FAULT=stop), and passes only if every other rank
# raised the collective's timeout error within TIMEOUT (+ slack for a loaded
# machine) and the job ended. Run as:
#   cmake -DMPIEXEC=... -DPROGRAM=... -DRANKS=n -DFAULT=kill|stop
#         -DTIMEOUT=seconds -DREPORT=prefix -P this file
math(EXPR last_survivor "${RANKS} - 2")
foreach(rank RANGE ${last_survivor})
  file(REMOVE "${REPORT}.${rank}")
endforeach()
set(launch ${MPIEXEC} -np ${RANKS} --oversubscribe)
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
  message(FATAL_ERROR "the job did not end within 90 s (a survivor hangs?):\n${out}")
endif()
# The wait runs from the end of a survivor's step 3: it computes its share
# of step 4, then waits TIMEOUT for the lost rank.
math(EXPR most "${TIMEOUT} + 10")
foreach(rank RANGE ${last_survivor})
  if(NOT EXISTS "${REPORT}.${rank}")
    message(FATAL_ERROR "rank ${rank} wrote no report (exit status ${status}):\n${out}")
  endif()
  file(READ "${REPORT}.${rank}" report)
  if(NOT report MATCHES "^raised after ([0-9.e+-]+) s\n")
    message(FATAL_ERROR "rank ${rank} did not raise:\n${report}\nmpiexec said:\n${out}")
  endif()
  set(waited ${CMAKE_MATCH_1})
  set(expect "MPI_Allreduce of [0-9]+ (float|double|uint64) value\\(s\\) timed out on rank ${rank} of ${RANKS} after [0-9.]+ s \\(timeout ${TIMEOUT} s\\): another rank died, hangs or made a different call")
  if(NOT report MATCHES "${expect}")
    message(FATAL_ERROR "rank ${rank} raised, but not the timeout error\nexpected (regex): "
                        "${expect}\nreport:\n${report}")
  endif()
  if(waited LESS ${TIMEOUT} OR waited GREATER ${most})
    message(FATAL_ERROR "rank ${rank} raised ${waited} s after its last step; expected ${TIMEOUT} "
                        "to ${most} s")
  endif()
  message(STATUS "rank ${rank} raised ${waited} s after its last step:\n${report}")
endforeach()
if(FAULT STREQUAL "stop" AND status EQUAL 0)
  message(FATAL_ERROR "the job ended with status 0; a survivor's MPI_Abort should end it with 1:\n${out}")
endif()
message(STATUS "the job ended in ${took} s (status ${status})")
