# End-to-end test of examples/precision_study: a tiny study (two modes, 20 steps of a 1-layer model on a small
# generated text) that must write its tables, logs and plot files, with a row of numbers per mode; and its
# errors. Checks report through check_failed (SEND_ERROR: the script goes on, the test fails at the end).
# Run as: cmake -DPRECISION_STUDY=<exe> -DWORK_DIR=<scratch dir> -P precision_study.cmake
cmake_minimum_required(VERSION 3.25)
foreach(var PRECISION_STUDY WORK_DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "precision_study.cmake: -D${var}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

include(${CMAKE_CURRENT_LIST_DIR}/cli_test_lib.cmake)

write_words_text(${WORK_DIR}/words.txt text)  # the text of examples_cli.cmake
set(tiny --layers 1 --heads 2 --width 32 --block 32 --batch 8 --steps 20 --eval-every 10 --warmup 2 --lr 1e-2
         --min-lr 1e-3)

# ---- a study of fp32 and bf16 ----
execute_process(COMMAND ${PRECISION_STUDY} --data words.txt --modes fp32,bf16 ${tiny} --out study
                WORKING_DIRECTORY ${WORK_DIR} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "precision_study failed (${status}):\nstdout:\n${out}\nstderr:\n${err}")
endif()
foreach(file results.md results.csv fp32.jsonl bf16.jsonl precision_study.dat precision_study.gp)
  if(NOT EXISTS ${WORK_DIR}/study/${file})
    check_failed("precision_study did not write ${file}")
  endif()
endforeach()
file(GLOB leftovers ${WORK_DIR}/study/*.tmp)
if(leftovers)
  check_failed("temporary files left behind: ${leftovers}")
endif()
# The children's progress lines are streamed with the mode as prefix.
foreach(mode fp32 bf16)
  if(NOT out MATCHES "\n\\[${mode}\\] +step +20/20 \\|")
    check_failed("no streamed '[${mode}] step 20/20' progress line:\n${out}")
  endif()
endforeach()
# With gnuplot the PNG exists (a PNG signature); without it the program says so.
find_program(GNUPLOT gnuplot)
if(GNUPLOT)
  file(READ ${WORK_DIR}/study/precision_study.png signature LIMIT 8 HEX)
  if(NOT signature STREQUAL "89504e470d0a1a0a")
    check_failed("precision_study.png is missing or not a PNG (gnuplot at ${GNUPLOT}): '${signature}'")
  endif()
elseif(NOT out MATCHES "gnuplot not found")
  check_failed("without gnuplot the output does not say so:\n${out}")
endif()

# results.csv: the header and one row per mode, in --modes order, every field a number; fp32's diff is 0.
file(STRINGS ${WORK_DIR}/study/results.csv lines)
list(LENGTH lines n)
if(NOT n EQUAL 3)
  check_failed("results.csv has ${n} lines, not a header and 2 rows:\n${lines}")
else()
  list(GET lines 0 header)
  set(expected_header "mode,final_train_loss,final_val_loss,val_diff_vs_fp32,val_diff_vs_fp32_pct,")
  string(APPEND expected_header "tokens_per_s,peak_rss_mib,skipped_steps,final_loss_scale")
  if(NOT header STREQUAL expected_header)
    check_failed("results.csv header is '${header}'")
  endif()
  set(number "^-?[0-9]+(\\.[0-9]+)?(e[-+]?[0-9]+)?$")
  set(index 1)
  foreach(mode fp32 bf16)
    list(GET lines ${index} row)
    math(EXPR index "${index} + 1")
    string(REPLACE "," ";" fields "${row}")
    list(LENGTH fields n)
    list(GET fields 0 name)
    if(NOT n EQUAL 9 OR NOT name STREQUAL mode)
      check_failed("results.csv row is not '${mode}' and 8 fields: '${row}'")
      continue()
    endif()
    list(SUBLIST fields 1 8 values)
    foreach(value IN LISTS values)
      if(NOT value MATCHES "${number}")
        check_failed("results.csv row '${row}': '${value}' is not a number")
      endif()
    endforeach()
    list(GET fields 1 train_loss)
    list(GET fields 2 val_loss)
    list(GET fields 3 diff)
    list(GET fields 6 rss)
    list(GET fields 8 scale)
    # The losses fell below ln(15) = 2.7 (a learning run, not a broken log), the memory is real, and neither
    # mode scales its loss (bf16 runs without a scaler, like PyTorch's bf16 autocast).
    foreach(value train_loss val_loss)
      if(NOT ${value} MATCHES "^[0-2]\\.")
        check_failed("${mode}: ${value} ${${value}} is not below 2.7 (ln 15 is the untrained loss)")
      endif()
    endforeach()
    if(NOT rss MATCHES "^[1-9][0-9]*\\.[0-9]$")
      check_failed("${mode}: peak RSS '${rss}' MiB is not a plausible positive size")
    endif()
    if(NOT scale STREQUAL "1")
      check_failed("${mode}: final loss scale '${scale}', expected 1")
    endif()
    if(mode STREQUAL "fp32" AND NOT diff MATCHES "^[-+]?0\\.0000$")
      check_failed("fp32's val diff vs fp32 is '${diff}', not 0")
    endif()
  endforeach()
endif()

# results.md and the printed table: a Markdown table with a row per mode.
file(READ ${WORK_DIR}/study/results.md md)
foreach(mode fp32 bf16)
  if(NOT md MATCHES "\n\\| ${mode} +\\|" OR NOT out MATCHES "\n\\| ${mode} +\\|")
    check_failed("no '${mode}' row in results.md or in the printed table:\n${md}\n---\n${out}")
  endif()
endforeach()
# Each log has a line per step.
file(STRINGS ${WORK_DIR}/study/bf16.jsonl log_lines)
list(LENGTH log_lines n)
if(NOT n EQUAL 20)
  check_failed("bf16.jsonl has ${n} lines for 20 steps")
endif()

# ---- errors: "error: ..." on stderr naming the problem, a non-zero exit ----
run_fails("unknown mode" ${PRECISION_STUDY} --data words.txt --modes fp32,fp17 ${tiny} --out bad
          MENTIONS "--modes" "fp17")
run_fails("unknown opt level" ${PRECISION_STUDY} --data words.txt --modes fp16_apex:O7 --out bad
          MENTIONS "fp16_apex:O7")
run_fails("missing data" ${PRECISION_STUDY} --data no_such_file.txt --modes fp32 --out bad
          MENTIONS "no_such_file.txt")
run_fails("unknown option" ${PRECISION_STUDY} --data words.txt --frobnicate 3 MENTIONS "--frobnicate")
run_fails("--precision is per mode" ${PRECISION_STUDY} --data words.txt --precision fp16 MENTIONS "--modes")
if(EXISTS ${WORK_DIR}/bad)
  check_failed("a study with invalid arguments created its --out directory")
endif()
# A child that fails (train_gpt rejects --heads 3 for width 32) is reported with train_gpt's own message.
run_fails("failing child" ${PRECISION_STUDY} --data words.txt --modes fp32 --layers 1 --heads 3 --width 32
          --block 32 --steps 2 --out failing
          MENTIONS "train_gpt --precision fp32 failed" "divisible by n_head" "1 of 1 modes failed")
