# Copies include/loom, plants two violations in a backend header and checks
# that scripts/check-layering names both and exits 1.
file(REMOVE_RECURSE ${WORK_DIR})
file(COPY ${SOURCE_DIR}/include DESTINATION ${WORK_DIR})
file(APPEND ${WORK_DIR}/include/loom/backend/cpu/sgd.hpp
     "#include \"../../optim/sgd.hpp\"\n#include \"no_such_header.hpp\"\n")
execute_process(COMMAND ${CMAKE_COMMAND} -E env LOOM_LAYERING_ROOT=${WORK_DIR}
                        ${SOURCE_DIR}/scripts/check-layering
                RESULT_VARIABLE status OUTPUT_VARIABLE output ERROR_VARIABLE output)
message("${output}")
if(NOT status EQUAL 1)
  message(FATAL_ERROR "check-layering exited ${status}, not 1, on a planted violation")
endif()
foreach(expected
        "backend/cpu/sgd.hpp:[0-9]+: backend/ includes optim/sgd.hpp; backend/ may include only core"
        "backend/cpu/sgd.hpp:[0-9]+: includes \"no_such_header.hpp\", which does not exist"
        "check-layering: 2 violation[(]s[)]")
  if(NOT output MATCHES "${expected}")
    message(FATAL_ERROR "check-layering's output lacks /${expected}/")
  endif()
endforeach()
