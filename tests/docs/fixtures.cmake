# Runs scripts/check-docs on one fixture of this folder and checks its exit
# status and report (the CASEs are below). Called by tests/docs/CMakeLists.txt
# with CASE, CHECK_DOCS, FIXTURES (this folder) and BUILD_DIR.

# line_of(FILE TEXT OUT): OUT = the number of the first line of FILE holding
# TEXT, so that the expected report follows an edit of the fixture.
function(line_of file text out)
  file(READ ${file} content)
  string(FIND "${content}" "${text}" at)
  if(at LESS 0)
    message(FATAL_ERROR "${file} lacks \"${text}\"")
  endif()
  string(SUBSTRING "${content}" 0 ${at} before)
  string(REGEX MATCHALL "\n" newlines "${before}")
  list(LENGTH newlines count)
  math(EXPR line "${count} + 1")
  set(${out} ${line} PARENT_SCOPE)
endfunction()

set(build_dir ${BUILD_DIR})
set(args)
if(CASE STREQUAL "passing")
  # Every command passes, the plain sh block and the inline ``` are skipped.
  set(file passing.md)
  set(expected_status 0)
  set(expected "check-docs: 7 command[(]s[)] in 3 block[(]s[)], 0 failed")
elseif(CASE STREQUAL "broken")
  # The failing and the hanging lines are named (one hangs through a
  # background job that holds the output after bash ends); the passing one is not.
  set(file broken.md)
  set(args --timeout 5)
  set(expected_status 1)
  line_of(${FIXTURES}/${file} "mnist --help" ok_line)
  line_of(${FIXTURES}/${file} "--no-such-flag" failed_line)
  line_of(${FIXTURES}/${file} "sleep 60" hung_line)
  line_of(${FIXTURES}/${file} "(sleep 60 &)" background_line)
  line_of(${FIXTURES}/${file} "there](no-such-page.md)" page_line)
  set(expected
      "docs: tests/docs/broken.md:${ok_line}: ok [(]"
      "docs: tests/docs/broken.md:${failed_line}: FAILED [(]exit [0-9]+[)]"
      "not expected: --no-such-flag"  # the end of the command's own output
      "docs: tests/docs/broken.md:${hung_line}: timed out after 5 s"
      "docs: tests/docs/broken.md:${background_line}: timed out after 5 s"
      "docs: tests/docs/broken.md:${page_line}: broken link no-such-page.md [(]no such file[)]"
      "docs: tests/docs/broken.md:${page_line}: broken link passing.md#no-such-heading [(]no such heading[)]"
      "check-docs: 4 command[(]s[)] in 1 block[(]s[)], 5 failed")
elseif(CASE STREQUAL "broken_program")
  # The block is named by its opening fence, the compiler's message follows.
  set(file broken_program.md)
  set(expected_status 1)
  line_of(${FIXTURES}/${file} "```cpp test" fence_line)
  set(expected
      "docs: tests/docs/broken_program.md:${fence_line}: FAILED [(]exit [0-9]+[)]"
      "loom shape error"
      "check-docs: 1 command[(]s[)] in 1 block[(]s[)], 1 failed")
elseif(CASE STREQUAL "no_test_block")
  # Only documentation-only blocks (sh, and "sh tests", a near miss).
  set(file no_test_block.md)
  set(expected_status 1)
  set(expected "no command in a ```sh test block of tests/docs/no_test_block.md")
elseif(CASE STREQUAL "no_build_dir")
  set(file passing.md)
  set(build_dir ${BUILD_DIR}/no-such-folder)
  set(expected_status 2)
  set(expected "build folder .*/no-such-folder does not exist")
else()
  message(FATAL_ERROR "fixtures.cmake: unknown CASE \"${CASE}\"")
endif()

execute_process(COMMAND ${CHECK_DOCS} --build-dir ${build_dir} ${args} ${FIXTURES}/${file}
                RESULT_VARIABLE status OUTPUT_VARIABLE output ERROR_VARIABLE output)
message("${output}")
if(NOT status EQUAL expected_status)
  message(FATAL_ERROR "check-docs exited ${status}, not ${expected_status}, on ${file}")
endif()
foreach(line IN LISTS expected)
  if(NOT output MATCHES "${line}")
    message(FATAL_ERROR "check-docs's output lacks /${line}/")
  endif()
endforeach()
