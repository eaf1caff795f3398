# train_gpt under mpirun end to end: a run started at TP2 x PP2 is saved, resumed at DP2 + ZeRO-1
# and on one process, and both end where the uninterrupted one-process run ends; rank 0 alone prints; an error
# on one rank ends the whole job with its message instead of leaving the others waiting.
# Run as: cmake -DTRAIN_GPT=<exe> -DMPIEXEC=<mpiexec> -DWORK_DIR=<scratch dir> -P train_gpt_mpi.cmake
cmake_minimum_required(VERSION 3.25)
foreach(var TRAIN_GPT MPIEXEC WORK_DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "train_gpt_mpi.cmake: -D${var}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
include(${CMAKE_CURRENT_LIST_DIR}/cli_test_lib.cmake)

write_words_text(${WORK_DIR}/words.txt text)  # 15 distinct bytes: a vocabulary tp = 2 does not divide
set(tiny --layers 2 --heads 2 --width 16 --block 16 --batch 8 --eval-every 0 --no-final-eval)
set(mpi4 ${MPIEXEC} -np 4 --oversubscribe --bind-to none)
set(mpi2 ${MPIEXEC} -np 2 --oversubscribe --bind-to none)

# "val_loss x.xxxxxx" of a weights file, in millionths; the extra arguments go to train_gpt.
function(val_loss out file)
  run(printed ${launcher} ${TRAIN_GPT} --data words.txt --init ${file} --eval-only ${ARGN})
  if(NOT printed MATCHES "val_loss ([0-9]+\\.[0-9]+)\n$")
    message(FATAL_ERROR "--eval-only of ${file} printed '${printed}'")
  endif()
  to_micro(value ${CMAKE_MATCH_1})
  set(${out} ${value} PARENT_SCOPE)
endfunction()

function(expect_near what a b tolerance)
  math(EXPR diff "${a} - ${b}")
  if(diff LESS -${tolerance} OR diff GREATER ${tolerance})
    check_failed("${what}: ${a} vs ${b} millionths (tolerance ${tolerance})")
  endif()
endfunction()

# The uninterrupted run: 6 steps on one process.
run(out ${TRAIN_GPT} --data words.txt ${tiny} --steps 6 --save one.safetensors)

# Steps 0-2 at TP2 x PP2 (1F1B, 2 micro-batches), saved.
run(out ${mpi4} ${TRAIN_GPT} --data words.txt ${tiny} --steps 6 --stop-at 3 --tp 2 --pp 2 --micro-batches 2
    --save mid.safetensors)
if(NOT out MATCHES "\\| 4 processes: tp 2, pp 2 \\(1f1b\\), 2 micro-batches per dp rank\n")
  check_failed("the header does not describe the layout: ${out}")
endif()
string(REGEX MATCHALL "step +1/6 " firsts "${out}")
list(LENGTH firsts n)
if(NOT n EQUAL 1)
  check_failed("the first step's line was printed ${n} times (rank 0 alone prints): ${out}")
endif()
if(NOT out MATCHES "saved mid.safetensors at step 3\n")
  check_failed("TP2 x PP2 did not report its save: ${out}")
endif()

# Steps 3-5 at DP2 with ZeRO-1, and on one process, from the same file.
run(out ${mpi2} ${TRAIN_GPT} --data words.txt --resume mid.safetensors --steps 6 --dp 2 --zero 1
    --save dp.safetensors)
if(NOT out MATCHES "resumed at step 3\n" OR NOT out MATCHES "dp 2, ZeRO-1")
  check_failed("DP2 + ZeRO-1 did not resume at step 3: ${out}")
endif()
run(out ${TRAIN_GPT} --data words.txt --resume mid.safetensors --steps 6 --save resumed.safetensors)
# And at plain DP2 with buckets of 1 KiB: their all-reduces start during the backward.
run(out ${mpi2} ${TRAIN_GPT} --data words.txt --resume mid.safetensors --steps 6 --dp 2 --bucket-mb 0.0009765625
    --save dp_buckets.safetensors)
if(NOT out MATCHES "\| 2 processes: dp 2 \(0.000976562 MiB gradient buckets\)
")
  check_failed("the header does not show the buckets: ${out}")
endif()

# All three end at the same weights: their validation losses agree to fp32 rounding (2e-5).
set(launcher "")
val_loss(one one.safetensors)
val_loss(dp dp.safetensors)
val_loss(resumed resumed.safetensors)
expect_near("TP2xPP2 then DP2+ZeRO-1 vs one process" ${dp} ${one} 20)
expect_near("TP2xPP2 then one process vs one process" ${resumed} ${one} 20)
val_loss(dp_buckets dp_buckets.safetensors)
expect_near("TP2xPP2 then DP2 with 1 KiB buckets vs one process" ${dp_buckets} ${one} 20)
# And evaluating at TP2 (the vocabulary of 15 split 8 + 7) gives the one-process value.
set(launcher ${mpi2})
val_loss(tp2 one.safetensors --tp 2)
expect_near("--eval-only at TP2 vs one process" ${tp2} ${one} 20)

# Errors. A layout the job does not fit: every rank meets it, rank 0 says so, once (the others wait before
# reporting and are ended by rank 0's abort); the same for an option error found before MPI starts.
execute_process(COMMAND ${mpi2} ${TRAIN_GPT} --data words.txt ${tiny} --steps 2 --tp 2 --pp 2
                WORKING_DIRECTORY ${WORK_DIR} RESULT_VARIABLE status OUTPUT_VARIABLE stdout ERROR_VARIABLE stderr
                TIMEOUT 120)
string(REGEX MATCHALL "does not divide" said "${stderr}")
list(LENGTH said n)
set(expected "rank 0 of 2: error: train_gpt: --tp 2 x --pp 2 = 4 does not divide the job's 2 processes")
if(status EQUAL 0 OR NOT n EQUAL 1 OR NOT stderr MATCHES "${expected}")
  check_failed("a layout larger than the job: status ${status}, said ${n} times (once expected): ${stderr}")
endif()
execute_process(COMMAND ${mpi2} ${TRAIN_GPT} --data words.txt ${tiny} --steps 2 --dp 2 --precision fp6
                WORKING_DIRECTORY ${WORK_DIR} RESULT_VARIABLE status OUTPUT_VARIABLE stdout
                ERROR_VARIABLE stderr TIMEOUT 120)
string(REGEX MATCHALL "unknown mixed_precision" said "${stderr}")
list(LENGTH said n)
if(status EQUAL 0 OR NOT n EQUAL 1)
  check_failed("an unknown mode under mpirun: status ${status}, said ${n} times (once expected): ${stderr}")
endif()
# fp8 trains in a layout (its tensorwise scales reduced over the ranks), and so does mxfp8, here with its
# gradients averaged through fp8 payloads (fp8_communication).
execute_process(COMMAND ${mpi2} ${TRAIN_GPT} --data words.txt ${tiny} --steps 2 --dp 2 --precision fp8
                WORKING_DIRECTORY ${WORK_DIR} RESULT_VARIABLE status OUTPUT_VARIABLE stdout
                ERROR_VARIABLE stderr TIMEOUT 120)
if(NOT status EQUAL 0 OR NOT stdout MATCHES "step +2/2")
  check_failed("fp8 under mpirun --dp 2: status ${status}: ${stdout} ${stderr}")
endif()
file(WRITE ${WORK_DIR}/fp8_communication.json "{\"fp8_communication\": true}")
execute_process(COMMAND ${mpi2} ${TRAIN_GPT} --data words.txt ${tiny} --steps 2 --dp 2 --precision mxfp8
                        --amp-config fp8_communication.json
                WORKING_DIRECTORY ${WORK_DIR} RESULT_VARIABLE status OUTPUT_VARIABLE stdout
                ERROR_VARIABLE stderr TIMEOUT 120)
if(NOT status EQUAL 0 OR NOT stdout MATCHES "step +2/2")
  check_failed("mxfp8 with fp8_communication under mpirun --dp 2: status ${status}: ${stdout} ${stderr}")
endif()
# One rank fails (rank 0 cannot open its log) while the other waits for it in the first step: the job ends
# (MPI_Abort) with rank 0's message instead of hanging (the timeout would catch a hang).
execute_process(COMMAND ${mpi2} ${TRAIN_GPT} --data words.txt ${tiny} --steps 2 --dp 2
                        --log-json ${WORK_DIR}/no/such/dir/log.jsonl
                WORKING_DIRECTORY ${WORK_DIR} RESULT_VARIABLE status OUTPUT_VARIABLE stdout ERROR_VARIABLE stderr
                TIMEOUT 120)
if(status EQUAL 0 OR NOT stderr MATCHES "rank 0 of 2: error: train_gpt: cannot open --log-json file")
  check_failed("one failing rank: status ${status}, stderr: ${stderr}")
endif()

# An error found before MPI starts (the --resume file is read before the job's layout is known) ends the job
# the same way: "rank 0 of 2: error: ...", with no ORTE_ERROR_LOG lines from Open MPI. Only the abort path
# prints the rank: a job that ended through mpirun's exit policy would say "error: ..." alone.
file(WRITE ${WORK_DIR}/not_a_checkpoint.safetensors "a text file, not a checkpoint\n")
execute_process(COMMAND ${mpi2} ${TRAIN_GPT} --data words.txt ${tiny} --steps 2 --resume not_a_checkpoint.safetensors
                WORKING_DIRECTORY ${WORK_DIR} RESULT_VARIABLE status OUTPUT_VARIABLE stdout ERROR_VARIABLE stderr
                TIMEOUT 120)
if(status EQUAL 0 OR NOT stderr MATCHES "rank [01] of 2: error: [^\n]*not_a_checkpoint.safetensors"
   OR stderr MATCHES "ORTE_ERROR_LOG")
  check_failed("a corrupt --resume under mpirun: status ${status}, expected the ranked error and no "
               "ORTE_ERROR_LOG:\n${stderr}")
endif()

# ---- AMP across processes ----
# Naive AMP's verbose lines (each scale backoff and growth) are printed once per job, by rank 0, in every
# layout and under ZeRO-1 too (its optimizer steps outside MixedPrecisionOptimizer): one process's lines.
# The scale also overflows naturally here, at steps that a layout's rounding can move; the lines are compared
# as text, and with lr_schedule_on_skip "advance" these layouts print one process's lines ("hold" moves the
# learning rates, and with them the natural overflows, differently at --dp 2 --zero 1).
file(WRITE ${WORK_DIR}/verbose.json "{\"initial_scale\": 16777216, \"hysteresis\": 1, \"verbose\": true, ")
file(APPEND ${WORK_DIR}/verbose.json "\"growth_interval\": 3, \"lr_schedule_on_skip\": \"advance\"}")
set(verbose_run --data words.txt ${tiny} --steps 12 --precision fp16_naive --amp-config verbose.json)
execute_process(COMMAND ${TRAIN_GPT} ${verbose_run} WORKING_DIRECTORY ${WORK_DIR} RESULT_VARIABLE status
                OUTPUT_VARIABLE stdout ERROR_VARIABLE one_lines TIMEOUT 120)
string(REGEX MATCHALL "[^\n]*the loss scale is adjusted to [0-9]+" one_lines "${one_lines}")
list(LENGTH one_lines n_one)
if(NOT status EQUAL 0 OR n_one LESS 2)
  check_failed("one process, verbose fp16_naive: status ${status}, ${n_one} scale lines (expected several)")
endif()
foreach(layout "--dp;2;--zero;1" "--tp;2")
  execute_process(COMMAND ${mpi2} ${TRAIN_GPT} ${verbose_run} ${layout} WORKING_DIRECTORY ${WORK_DIR}
                  RESULT_VARIABLE status OUTPUT_VARIABLE stdout ERROR_VARIABLE err TIMEOUT 120)
  string(REGEX MATCHALL "[^\n]*the loss scale is adjusted to [0-9]+" lines "${err}")
  if(NOT status EQUAL 0 OR NOT lines STREQUAL one_lines)
    check_failed("verbose fp16_naive at ${layout}: status ${status}; its scale lines are not one process's "
                 "(once each):\n${lines}\n---\n${one_lines}")
  endif()
endforeach()
# ZeRO-1 with Apex: O1 keeps fp32 parameters (as fp16 does); O3 has no master weights, so the shard holds pieces
# of its fp16 parameters; O2 with num_losses 2 keeps a scaler per loss. Each trains.
file(WRITE ${WORK_DIR}/two_losses.json "{\"num_losses\": 2}")
foreach(apex "fp16_apex:O1" "fp16_apex:O3" "fp16_apex:O2;--amp-config;two_losses.json")
  execute_process(COMMAND ${mpi2} ${TRAIN_GPT} --data words.txt ${tiny} --steps 3 --dp 2 --zero 1
                          --precision ${apex}
                  WORKING_DIRECTORY ${WORK_DIR} RESULT_VARIABLE status OUTPUT_VARIABLE stdout ERROR_VARIABLE err
                  TIMEOUT 120)
  if(NOT status EQUAL 0 OR NOT stdout MATCHES "step +3/3 \\| loss [0-9.]+ ")
    check_failed("${apex} with --zero 1: status ${status}:\n${stdout}\n${err}")
  endif()
endforeach()
