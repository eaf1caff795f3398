# Helpers shared by the command-line tests (examples_cli.cmake, precision_study.cmake); include() after
# WORK_DIR is set. Checks report through check_failed (SEND_ERROR: the script goes on and the test fails at
# the end); a command that exits with an unexpected status stops the script.

function(check_failed what)
  message(SEND_ERROR "CHECK FAILED: ${what}")
endfunction()

# run(<out-var> <command...>): the command must exit 0; <out-var> receives its stdout.
function(run out)
  execute_process(COMMAND ${ARGN} WORKING_DIRECTORY ${WORK_DIR} RESULT_VARIABLE status OUTPUT_VARIABLE stdout
                  ERROR_VARIABLE stderr)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "failed (${status}): ${ARGN}\nstdout:\n${stdout}\nstderr:\n${stderr}")
  endif()
  set(${out} "${stdout}" PARENT_SCOPE)
endfunction()

# run_fails(<what> <command...> MENTIONS <text>...): the command must exit non-zero with an "error:" line on
# stderr that contains every <text>.
function(run_fails what)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "" "MENTIONS")
  execute_process(COMMAND ${arg_UNPARSED_ARGUMENTS} WORKING_DIRECTORY ${WORK_DIR} RESULT_VARIABLE status
                  OUTPUT_VARIABLE stdout ERROR_VARIABLE stderr)
  if(status EQUAL 0)
    check_failed("${what}: expected an error, but it succeeded: ${arg_UNPARSED_ARGUMENTS}\n${stdout}")
    return()
  endif()
  if(NOT stderr MATCHES "^error: ")
    check_failed("${what}: stderr does not start with 'error: ': ${stderr}")
  endif()
  foreach(text IN LISTS arg_MENTIONS)
    string(FIND "${stderr}" "${text}" at)
    if(at EQUAL -1)
      check_failed("${what}: the error does not mention '${text}': ${stderr}")
    endif()
  endforeach()
endfunction()

# patch_file(<src> <dst> <old> <new>): <dst> is a copy of <src> with the first <old> replaced by <new>, of the
# same length (a safetensors header keeps its length prefix and offsets). Paths are relative to WORK_DIR.
function(patch_file src dst old new)
  string(LENGTH "${old}" old_length)
  string(LENGTH "${new}" new_length)
  if(NOT old_length EQUAL new_length)
    message(FATAL_ERROR "patch_file: '${old}' and '${new}' differ in length")
  endif()
  file(READ ${WORK_DIR}/${src} bytes HEX)
  string(HEX "${old}" old_hex)
  string(FIND "${bytes}" "${old_hex}" at)
  math(EXPR odd "${at} % 2")
  if(at EQUAL -1 OR odd EQUAL 1)
    message(FATAL_ERROR "patch_file: '${old}' is not in ${src}")
  endif()
  math(EXPR offset "${at} / 2")
  file(COPY_FILE ${WORK_DIR}/${src} ${WORK_DIR}/${dst})
  find_program(DD dd REQUIRED)
  file(WRITE ${WORK_DIR}/patch.in "${new}")
  execute_process(COMMAND ${DD} of=${WORK_DIR}/${dst} bs=1 seek=${offset} conv=notrunc INPUT_FILE ${WORK_DIR}/patch.in
                  RESULT_VARIABLE status ERROR_QUIET)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "patch_file: dd failed (${status})")
  endif()
endfunction()

# write_words_text(<file> <out-var>): writes words drawn by an LCG (and returns the text): 15 distinct bytes
# ("the cat sat on a mat.\n dog ran"), with real but learnable structure. About 6 KB: train 90 %,
# validation 10 % (~600 tokens, 18 windows of block 32).
function(write_words_text file out)
  set(words "the " "cat " "sat " "on " "a " "mat.\n" "dog " "ran ")
  set(text "")
  set(state 12345)
  foreach(i RANGE 1 1500)
    math(EXPR state "(${state} * 1103515245 + 12345) % 2147483648")
    math(EXPR w "(${state} / 65536) % 8")
    list(GET words ${w} word)
    string(APPEND text "${word}")
  endforeach()
  file(WRITE ${file} "${text}")
  set(${out} "${text}" PARENT_SCOPE)
endfunction()

# "1.234567" -> 1234567 (millionths), for comparisons in CMake's integer arithmetic.
function(to_micro out text)
  if(NOT text MATCHES "^([0-9]+)\\.([0-9]+)$")
    message(FATAL_ERROR "not a decimal number: '${text}'")
  endif()
  set(whole ${CMAKE_MATCH_1})
  string(SUBSTRING "${CMAKE_MATCH_2}000000" 0 6 fraction)
  string(REGEX REPLACE "^0+([0-9])" "\\1" fraction "${fraction}")
  math(EXPR value "${whole} * 1000000 + ${fraction}")
  set(${out} ${value} PARENT_SCOPE)
endfunction()

# check_png_header(FILE WIDTH HEIGHT): FILE starts with the PNG signature and an IHDR chunk of that size.
function(check_png_header file width height)
  if(NOT EXISTS ${file})
    check_failed("${file} was not written")
    return()
  endif()
  file(READ ${file} head LIMIT 24 HEX)
  math(EXPR w "${width}" OUTPUT_FORMAT HEXADECIMAL)
  math(EXPR h "${height}" OUTPUT_FORMAT HEXADECIMAL)
  string(REGEX REPLACE "^0x" "" w "${w}")
  string(REGEX REPLACE "^0x" "" h "${h}")
  string(LENGTH "${w}" wn)
  string(LENGTH "${h}" hn)
  math(EXPR wpad_n "8 - ${wn}")
  math(EXPR hpad_n "8 - ${hn}")
  string(REPEAT "0" ${wpad_n} wpad)
  string(REPEAT "0" ${hpad_n} hpad)
  string(TOLOWER "89504e470d0a1a0a0000000d49484452${wpad}${w}${hpad}${h}" expected)
  if(NOT head STREQUAL expected)
    check_failed("${file} is not a ${width} x ${height} PNG: it starts ${head}, expected ${expected}")
  endif()
endfunction()
