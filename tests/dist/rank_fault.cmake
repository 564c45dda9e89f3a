# Runs rank_fault under mpiexec -np RANKS with the last rank killed
# (FAULT=kill) or frozen (FAULT=stop), and passes only if every other rank
# raised the collective's timeout error within TIMEOUT (+ slack for a loaded
# machine) and the job ended. With LOOM_COLLECTIVE_REPORT set (below
# TIMEOUT), every other rank must also have printed, once and before its
# error, the line that names the lost rank as the only one missing and the
# other survivors as waiting too. Run as:
#   cmake -DMPIEXEC=... -DPROGRAM=... -DRANKS=n -DFAULT=kill|stop
#         -DTIMEOUT=seconds -DREPORT=prefix -P this file
math(EXPR last_survivor "${RANKS} - 2")
math(EXPR lost "${RANKS} - 1")

# The line `rank` printed in the collective it timed out in (the last one
# it printed before its error, "rank N: loom: MPI_Allreduce ... timed out").
function(check_late_line rank)
  set(report_after $ENV{LOOM_COLLECTIVE_REPORT})
  set(line "loom: rank ${rank} of ${RANKS} has waited ([0-9.]+) s in MPI_Allreduce \\(collective #([0-9]+)\\)([^\n]*); the timeout is ${TIMEOUT} s \\(LOOM_COLLECTIVE_TIMEOUT\\)")
  string(FIND "${out}" "rank ${rank}: loom: MPI_Allreduce" error_at)
  if(error_at LESS 0)
    message(FATAL_ERROR "rank ${rank}'s timeout error is not in mpiexec's output:\n${out}")
  endif()
  string(SUBSTRING "${out}" 0 ${error_at} before_error)
  # (Found, not matched whole: the line holds a ';', a list separator here.)
  string(FIND "${before_error}" "loom: rank ${rank} of ${RANKS} has waited" line_at REVERSE)
  if(line_at LESS 0)
    message(FATAL_ERROR "rank ${rank} printed no line naming the ranks it waited for before its "
                        "error (LOOM_COLLECTIVE_REPORT=${report_after}); mpiexec said:\n${out}")
  endif()
  string(SUBSTRING "${before_error}" ${line_at} -1 last)
  string(FIND "${last}" "\n" line_end)
  string(SUBSTRING "${last}" 0 ${line_end} last)
  if(NOT last MATCHES "^${line}$")
    message(FATAL_ERROR "rank ${rank}'s line is not in the expected form (regex):\n${line}\n"
                        "it printed:\n${last}")
  endif()
  set(waited ${CMAKE_MATCH_1})
  set(collective ${CMAKE_MATCH_2})
  set(whom "${CMAKE_MATCH_3}")
  set(expect " for rank(s) ${lost}, which have not arrived")
  set(others "")
  foreach(other RANGE ${last_survivor})
    if(NOT other EQUAL rank)
      list(APPEND others ${other})
    endif()
  endforeach()
  list(LENGTH others waiting)
  if(waiting EQUAL 1)
    string(APPEND expect " (rank ${others} is waiting too)")
  elseif(waiting GREATER 1)
    list(JOIN others ", " others)
    string(APPEND expect " (ranks ${others} are waiting too)")
  endif()
  if(NOT whom STREQUAL expect)
    message(FATAL_ERROR "rank ${rank}'s line names the wrong ranks:\n${last}\nexpected"
                        "\"${expect}\" after the collective's number")
  endif()
  if(waited LESS report_after OR waited GREATER TIMEOUT)
    message(FATAL_ERROR "rank ${rank} printed its line after ${waited} s; expected "
                        "${report_after} to ${TIMEOUT} s:\n${last}")
  endif()
  string(REGEX MATCHALL "loom: rank ${rank} of [0-9]+ has waited [^\n;]*\\(collective #${collective}\\)"
         same "${out}")
  list(LENGTH same count)
  if(NOT count EQUAL 1)
    message(FATAL_ERROR "rank ${rank} printed ${count} lines for collective #${collective}, not "
                        "one:\n${out}")
  endif()
  message(STATUS "rank ${rank} printed before its error:\n${last}")
endfunction()
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
  if(DEFINED ENV{LOOM_COLLECTIVE_REPORT})
    check_late_line(${rank})
  endif()
endforeach()
if(FAULT STREQUAL "stop" AND status EQUAL 0)
  message(FATAL_ERROR "the job ended with status 0; a survivor's MPI_Abort should end it with 1:\n${out}")
endif()
message(STATUS "the job ended in ${took} s (status ${status})")
