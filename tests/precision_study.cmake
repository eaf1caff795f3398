# End-to-end test of examples/precision_study: a tiny study (two modes, 20 steps of a 1-layer model on a small
# generated text) that must write its tables, logs and plot files, with a row of numbers per mode; a diverging
# mode; its errors; and, with a stub train_gpt (a shell script next to a copy of precision_study), the
# formatting of its numbers, the peak RSS taken from the child's log, failing modes and an interruption.
# Checks report through check_failed (SEND_ERROR: the script goes on, the test fails at the end).
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
foreach(file results.md results.csv fp32.jsonl bf16.jsonl precision_study.png)
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
# The plot is a PNG 1000 wide and 500 high per panel (its signature, then IHDR's width and height), drawn by
# precision_study itself (train/plot.h; its pixels and encoding are checked by the Plot* unit tests), and the
# output names it. fp32 and bf16: the loss, the loss scale and bf16's loss minus fp32's.
check_png_header(${WORK_DIR}/study/precision_study.png 1000 1500)
if(NOT out MATCHES "\nwrote [^\n]*results.md, [^\n]*results.csv, [^\n]*precision_study.png\n")
  check_failed("the output does not name the files written:\n${out}")
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
      check_failed("${mode}: peak RSS '${rss}' MiB is not a plausible positive size (empty: train_gpt's log "
                   "has no peak_rss_kib)")
    endif()
    if(NOT scale STREQUAL "1")
      check_failed("${mode}: final loss scale '${scale}', expected 1")
    endif()
    if(mode STREQUAL "fp32" AND NOT diff STREQUAL "0.0000")
      check_failed("fp32's val diff vs fp32 is '${diff}', not 0.0000")
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
# fp32's own difference is a signed zero in the Markdown table, and the note says how differences are taken.
if(NOT md MATCHES "\n\\| fp32 +\\| +[0-9.]+ \\| +[0-9.]+ \\| +\\+0\\.0000 \\| +\\+0\\.00 \\|")
  check_failed("fp32's row in results.md does not show +0.0000 and +0.00:\n${md}")
endif()
if(NOT md MATCHES "computed from the unrounded losses")
  check_failed("results.md does not say that the differences come from the unrounded losses:\n${md}")
endif()
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
run_fails("an option twice" ${PRECISION_STUDY} --data words.txt --lr 1e-2 --lr 2e-2 MENTIONS "--lr given twice")
run(help ${PRECISION_STUDY} --help)
foreach(option --data --modes --out --layers --heads --width --block --batch --steps --eval-every --lr --min-lr
               --warmup --seed --dropout --optimizer --weight-decay --beta1 --beta2 --momentum --schedule
               --grad-clip --vocab-size --sequential)
  if(NOT help MATCHES "\n  ${option} ")
    check_failed("precision_study --help does not document ${option}:\n${help}")
  endif()
endforeach()
run_fails("a mode under two names" ${PRECISION_STUDY} --data words.txt --modes fp16_apex,fp16_apex:O1 --out bad
          MENTIONS "names 'fp16_apex:O1' twice (as 'fp16_apex' and 'fp16_apex:O1')")
# The data among the files the study writes (a table, a mode's log, their temporary names, through a link):
# refused before anything runs, and the data is left as it is (not overwritten, and no exit code 0).
file(MAKE_DIRECTORY ${WORK_DIR}/inside)
file(COPY_FILE ${WORK_DIR}/words.txt ${WORK_DIR}/inside/results.csv)
file(COPY_FILE ${WORK_DIR}/words.txt ${WORK_DIR}/inside/bf16.jsonl.tmp)
file(CREATE_LINK bf16.jsonl ${WORK_DIR}/inside/link.txt SYMBOLIC)
run_fails("data is a table of the study" ${PRECISION_STUDY} --data inside/results.csv --modes fp32 ${tiny}
          --out inside MENTIONS "--data 'inside/results.csv' is 'inside/results.csv', a file the study writes")
run_fails("data is a mode's temporary log" ${PRECISION_STUDY} --data inside/bf16.jsonl.tmp --modes fp32,bf16
          ${tiny} --out inside MENTIONS "is 'inside/bf16.jsonl.tmp', a file the study writes")
file(COPY_FILE ${WORK_DIR}/words.txt ${WORK_DIR}/inside/bf16.jsonl)
run_fails("data links to a mode's log" ${PRECISION_STUDY} --data inside/link.txt --modes bf16 ${tiny}
          --out inside MENTIONS "is 'inside/bf16.jsonl', a file the study writes")
foreach(file results.csv bf16.jsonl.tmp bf16.jsonl)
  file(READ ${WORK_DIR}/inside/${file} after)
  if(NOT after STREQUAL text)
    check_failed("a refused study changed its data file inside/${file}")
  endif()
endforeach()
# An empty --data (run_fails' argument list would drop the empty argument: execute_process keeps it).
execute_process(COMMAND ${PRECISION_STUDY} --data "" --modes fp32 --out bad WORKING_DIRECTORY ${WORK_DIR}
                RESULT_VARIABLE status ERROR_VARIABLE err OUTPUT_QUIET)
if(status EQUAL 0 OR NOT err MATCHES "--data needs a file name")
  check_failed("an empty --data: exit ${status}, stderr '${err}' (expected an error naming --data)")
endif()
# Every empty value is refused in one wording: "<option> needs <what the value is>, got ''".
foreach(empty "--out;a directory" "--optimizer;a value" "--schedule;a value")
  list(GET empty 0 option)
  list(GET empty 1 what)
  execute_process(COMMAND ${PRECISION_STUDY} --data words.txt --modes fp32 ${option} "" WORKING_DIRECTORY ${WORK_DIR}
                  RESULT_VARIABLE status ERROR_VARIABLE err OUTPUT_QUIET)
  if(status EQUAL 0 OR NOT err MATCHES "^error: precision_study: ${option} needs ${what}, got ''\n$")
    check_failed("an empty ${option}: exit ${status}, stderr '${err}'")
  endif()
endforeach()
run_fails("--modes=" ${PRECISION_STUDY} --data words.txt --modes= MENTIONS "precision_study: --modes needs a value")
run_fails("--precision is per mode" ${PRECISION_STUDY} --data words.txt --precision fp16 MENTIONS "--modes")
# Pass-through values are checked before anything runs (--steps 0 would leave an empty log behind).
run_fails("--steps 0" ${PRECISION_STUDY} --data words.txt --modes fp32 --steps 0 --out bad
          MENTIONS "--steps expects an integer in" "'0'")
run_fails("--steps -5" ${PRECISION_STUDY} --data words.txt --modes fp32 --steps -5 --out bad
          MENTIONS "--steps" "'-5'")
run_fails("--lr x" ${PRECISION_STUDY} --data words.txt --modes fp32 --lr x --out bad MENTIONS "--lr" "'x'")
if(EXISTS ${WORK_DIR}/bad)
  check_failed("a study with invalid arguments created its --out directory")
endif()

# A mode that diverges (a learning rate of 1e6; fp16_apex:O3 skips the steps whose gradients overflow) is a
# row of nan losses with its skipped steps, not a failure: train_gpt logs the non-finite values as null.
execute_process(COMMAND ${PRECISION_STUDY} --data words.txt --modes fp16_apex:O3 --layers 1 --heads 1
                        --width 16 --block 8 --batch 2 --steps 12 --lr 1e6 --weight-decay 0 --warmup 0 --min-lr 1e5
                        --out diverged
                WORKING_DIRECTORY ${WORK_DIR} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err)
file(STRINGS ${WORK_DIR}/diverged/results.csv lines)
if(NOT status EQUAL 0)
  check_failed("a diverging mode failed the study (${status}):\n${out}\n${err}")
elseif(NOT lines MATCHES ";fp16_apex:O3,nan,nan,,,[0-9]+,[^,]*,([1-9][0-9]*),1$")
  check_failed("the diverged mode's row is not nan losses with its skipped steps: '${lines}'")
endif()

# A child that fails (train_gpt rejects --heads 3 for width 32) is reported with train_gpt's own message; as
# no mode succeeded, nothing is written: the files of an earlier study stay as they were, and no log or
# temporary file is left.
file(MAKE_DIRECTORY ${WORK_DIR}/failing)
file(WRITE ${WORK_DIR}/failing/results.md "an earlier study\n")
run_fails("failing child" ${PRECISION_STUDY} --data words.txt --modes fp32 --layers 1 --heads 3 --width 32
          --block 32 --steps 2 --out failing
          MENTIONS "train_gpt --precision fp32 failed" "--width 32 must be divisible by --heads 3" "the mode failed"
                   "nothing was written")
file(READ ${WORK_DIR}/failing/results.md md)
file(GLOB written RELATIVE ${WORK_DIR}/failing ${WORK_DIR}/failing/*)
if(NOT md STREQUAL "an earlier study\n" OR NOT written STREQUAL "results.md")
  check_failed("a study whose only mode failed wrote to its --out directory: ${written}")
endif()

# ---- a stub train_gpt: a POSIX shell script beside a copy of precision_study, using shell builtins only ----
# It writes --steps log lines (val_loss on the last) with its own VmHWM as peak_rss_kib, and prints
# "stub VmHWM <kib>". STUB_FAIL=<mode>: that mode writes a line, then exits 3. STUB_SHORT=1: a line short,
# exit 0.
# STUB_INTERRUPT=1: writes a line and its pid (stub.pid), sends SIGTERM to precision_study and spins.
# fp32 logs val loss 2.5, scale 1; other modes 2.49999999 (a difference that rounds to zero), scale 2^32.
set(stub_dir ${WORK_DIR}/stub)
file(COPY ${PRECISION_STUDY} DESTINATION ${stub_dir})
cmake_path(GET PRECISION_STUDY FILENAME study_name)
set(STUB ${stub_dir}/${study_name})
file(WRITE ${stub_dir}/train_gpt [=[#!/bin/sh
log= steps= mode=
while [ $# -gt 0 ]; do
  case "$1" in
    --log-json) log=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --precision) mode=$2; shift 2 ;;
    --sequential) shift ;;
    *) shift 2 ;;
  esac
done
kib=0
while read -r key value rest; do [ "$key" = "VmHWM:" ] && kib=$value; done < /proc/$$/status
echo "stub VmHWM $kib"
val=2.49999999 scale=4294967296
[ "$mode" = fp32 ] && val=2.5 scale=1
[ "$STUB_SHORT" = 1 ] && steps=$((steps - 1))
: > "$log"
i=0
while [ $i -lt "$steps" ]; do
  extra=
  [ $i -eq $((steps - 1)) ] && extra=",\"val_loss\":$val"
  line="{\"step\":$i,\"loss\":2.75,\"tokens_per_s\":1000,\"loss_scale\":$scale,\"skipped\":false"
  echo "$line$extra,\"peak_rss_kib\":$kib}" >> "$log"
  i=$((i + 1))
  if [ "$STUB_FAIL" = "$mode" ]; then echo "stub: $mode fails" >&2; exit 3; fi
  if [ "$STUB_INTERRUPT" = 1 ]; then
    echo $$ > stub.pid
    kill -TERM $PPID
    n=0; while [ $n -lt 3000000 ]; do n=$((n + 1)); done
    exit 0
  fi
done
]=])
file(CHMOD ${stub_dir}/train_gpt PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE)

# Numbers: a difference that rounds to zero is 0.0000 (+0.0000 in Markdown), never -0.0000; the loss scale
# is exact; the peak RSS is the stub's own VmHWM from its log (not wait4's ru_maxrss, which is at least
# precision_study's own peak). A precision_study.png of an earlier study is replaced.
file(MAKE_DIRECTORY ${WORK_DIR}/stubbed)
file(WRITE ${WORK_DIR}/stubbed/precision_study.png "an earlier study's plot")
execute_process(COMMAND ${STUB} --data words.txt --modes fp32,bf16 --steps 3 --out stubbed
                WORKING_DIRECTORY ${WORK_DIR} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err)
file(STRINGS ${WORK_DIR}/stubbed/results.csv lines)
if(NOT status EQUAL 0)
  check_failed("the stubbed study failed (${status}):\n${out}\n${err}")
elseif(NOT out MATCHES "\\[bf16\\] +stub VmHWM ([0-9]+)\n")
  check_failed("the stub did not report its VmHWM:\n${out}")
else()
  math(EXPR tenths "${CMAKE_MATCH_1} * 10 / 1024")  # MiB with one decimal, truncated: %.1f may round up
  math(EXPR tenths_up "${tenths} + 1")
  foreach(t ${tenths} ${tenths_up})
    string(REGEX REPLACE "([0-9])$" ".\\1" mib "${t}")
    string(REGEX REPLACE "^\\." "0." mib "${mib}")
    if(lines MATCHES ";bf16,2\\.7500,2\\.5000,0\\.0000,0\\.00,1000,${mib},0,4294967296$")
      set(rss_ok TRUE)
    endif()
  endforeach()
  if(NOT rss_ok)
    check_failed("the stubbed bf16 row is not 2.7500,2.5000,0.0000,0.00,1000,<the stub's VmHWM "
                 "${CMAKE_MATCH_1} KiB in MiB>,0,4294967296: '${lines}'")
  endif()
  file(READ ${WORK_DIR}/stubbed/results.md md)
  if(NOT md MATCHES "\n\\| bf16 +\\| +2\\.7500 \\| +2\\.5000 \\| +\\+0\\.0000 \\| +\\+0\\.00 \\|")
    check_failed("the stubbed bf16 row in results.md does not show +0.0000 and +0.00:\n${md}")
  endif()
  check_png_header(${WORK_DIR}/stubbed/precision_study.png 1000 1500)
endif()

# ---- an fp8 mode beside fp32: its quantization table and its three panels (gradients flushed, values
# saturated, fp8_delayed's scales) ----
execute_process(COMMAND ${PRECISION_STUDY} --data words.txt --modes fp32,fp8_delayed ${tiny} --out fp8study
                WORKING_DIRECTORY ${WORK_DIR} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT status EQUAL 0)
  check_failed("precision_study with fp8_delayed failed (${status}):\nstdout:\n${out}\nstderr:\n${err}")
else()
  file(READ ${WORK_DIR}/fp8study/results.md md)
  if(NOT md MATCHES "Quantization over training" OR
     NOT md MATCHES "\n\\| fp8_delayed \\| [0-9]+\\.[0-9]+ \\| [0-9]+\\.[0-9]+ \\| [0-9]+\\.[0-9]+ \\| [0-9]+\\.[0-9]+ \\| [0-9]+\\.[0-9]+ \\| [0-9]+\\.[0-9]+ \\|\n")
    check_failed("results.md has no quantization row for fp8_delayed:\n${md}")
  endif()
  check_png_header(${WORK_DIR}/fp8study/precision_study.png 1000 3000)
endif()

# A log with a line short is a failure, found before the log is renamed into place; a mode that fails
# leaves neither its log (nor one of an earlier study) nor a temporary file, and the others are still tabled.
set(ENV{STUB_SHORT} 1)
run_fails("short log" ${STUB} --data words.txt --modes fp32 --steps 3 --out short
          MENTIONS "has 2 steps, expected 3 (--steps)")
unset(ENV{STUB_SHORT})
set(ENV{STUB_FAIL} bf16)
file(MAKE_DIRECTORY ${WORK_DIR}/partial)  # with bf16's log of an earlier study, which must not survive
file(WRITE ${WORK_DIR}/partial/bf16.jsonl "an earlier study's log\n")
run_fails("a failing mode" ${STUB} --data words.txt --modes fp32,bf16 --steps 3 --out partial
          MENTIONS "train_gpt --precision bf16 failed (exit status 3)" "stub: bf16 fails"
                   "1 of 2 modes failed")
unset(ENV{STUB_FAIL})
file(GLOB written RELATIVE ${WORK_DIR} ${WORK_DIR}/short/* ${WORK_DIR}/partial/*)
list(FILTER written EXCLUDE REGEX
     "^partial/(fp32.jsonl|results.md|results.csv|precision_study.png)$")
if(written)
  check_failed("failed modes left files behind: ${written}")
endif()
file(STRINGS ${WORK_DIR}/partial/results.csv lines)
if(NOT lines MATCHES "^mode,[^;]*;fp32,[^;]*$")
  check_failed("the partial study's results.csv is not fp32's row alone: '${lines}'")
endif()

# SIGTERM (the stub sends it mid-run): precision_study kills and reaps the child, removes the temporary log
# and exits with 128 + 15.
set(ENV{STUB_INTERRUPT} 1)
execute_process(COMMAND ${STUB} --data words.txt --modes fp32 --steps 3 --out interrupted
                WORKING_DIRECTORY ${WORK_DIR} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err)
unset(ENV{STUB_INTERRUPT})
file(GLOB written RELATIVE ${WORK_DIR} ${WORK_DIR}/interrupted/*)
file(STRINGS ${WORK_DIR}/stub.pid pid)
if(NOT status EQUAL 143 OR NOT err MATCHES "interrupted")
  check_failed("SIGTERM: exit status ${status}, not 143, or no note on stderr:\n${out}\n${err}")
endif()
if(written)
  check_failed("SIGTERM left files behind: ${written}")
endif()
if(NOT pid MATCHES "^[0-9]+$" OR EXISTS /proc/${pid})
  check_failed("SIGTERM: the child (pid '${pid}') was not stopped and reaped")
endif()
