# End-to-end tests of the train_gpt and generate command lines: real runs on small generated data, checking
# what the programs print and write. Every check reports through check_failed (SEND_ERROR: the script goes on
# and the test fails at the end); a command that exits with an unexpected status stops the script.
# Run as: cmake -DTRAIN_GPT=<exe> -DGENERATE=<exe> -DPLOT_LOSS=<exe> -DWORK_DIR=<scratch dir>
#        -P examples_cli.cmake
cmake_minimum_required(VERSION 3.25)
foreach(var TRAIN_GPT GENERATE PLOT_LOSS WORK_DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "examples_cli.cmake: -D${var}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

include(${CMAKE_CURRENT_LIST_DIR}/cli_test_lib.cmake)

# The generate output for a .bin model: exactly `count` space-separated ids, each in [0, vocab).
function(check_ids what text count vocab)
  string(STRIP "${text}" text)
  if(NOT text MATCHES "^[0-9]+( [0-9]+)*$")
    check_failed("${what}: not space-separated integers: '${text}'")
    return()
  endif()
  string(REPLACE " " ";" ids "${text}")
  list(LENGTH ids n)
  if(NOT n EQUAL count)
    check_failed("${what}: ${n} ids instead of ${count}: '${text}'")
  endif()
  foreach(id IN LISTS ids)
    if(id GREATER_EQUAL vocab)
      check_failed("${what}: id ${id} is not below ${vocab}: '${text}'")
    endif()
  endforeach()
endfunction()

# ================================================================ character-level data (.txt)
write_words_text(${WORK_DIR}/words.txt text)
set(vocab_size 15)
set(ln_vocab_micro 2708050)  # ln(15) = 2.708050
set(tiny --layers 1 --heads 2 --width 32 --block 32 --batch 8)

# --steps 0 --save: a fresh model; evaluated through --init ... --eval-only its loss is about ln(vocab), since
# the initial logits are small (wte ~ N(0, 0.02^2), so logit std ~ 0.02 * sqrt(32) ~ 0.1 after ln_f).
run(out ${TRAIN_GPT} --data words.txt ${tiny} --steps 0 --save fresh.safetensors)
if(NOT out MATCHES "vocab ${vocab_size} \\|")
  check_failed("the header line does not say 'vocab ${vocab_size}': ${out}")
endif()
if(NOT out MATCHES "saved fresh.safetensors at step 0")
  check_failed("--steps 0 --save did not report the save: ${out}")
endif()
run(out ${TRAIN_GPT} --data words.txt --init fresh.safetensors --eval-only)
if(NOT out MATCHES "^val_loss ([0-9]+\\.[0-9]+)\n$")
  check_failed("--eval-only printed '${out}', not one line 'val_loss <x>'")
else()
  message(STATUS "fresh model: val_loss ${CMAKE_MATCH_1} (ln ${vocab_size} = 2.708050)")
  to_micro(loss ${CMAKE_MATCH_1})
  math(EXPR diff "${loss} - ${ln_vocab_micro}")
  if(diff LESS -100000 OR diff GREATER 100000)
    check_failed("fresh model: val_loss ${CMAKE_MATCH_1} is not within 0.1 of ln(${vocab_size}) = 2.708")
  endif()
endif()

# 30 steps with --log-json: one JSON line per step, in order, with every field.
run(out ${TRAIN_GPT} --data words.txt ${tiny} --steps 30 --eval-every 0 --log-json log.jsonl)
file(STRINGS ${WORK_DIR}/log.jsonl lines)
list(LENGTH lines n)
if(NOT n EQUAL 30)
  check_failed("--log-json wrote ${n} lines for 30 steps")
endif()
set(expected_step 0)
set(number "-?[0-9]+(\\.[0-9]+)?(e[-+][0-9]+)?")
foreach(line IN LISTS lines)
  foreach(field step loss lr grad_norm tokens_per_s threads)
    if(NOT line MATCHES "\"${field}\":${number}[,}]")
      check_failed("log line lacks a numeric \"${field}\": ${line}")
    endif()
  endforeach()
  if(NOT line MATCHES "\"step\":${expected_step}[,}]")
    check_failed("log line ${expected_step} has another step: ${line}")
  endif()
  math(EXPR expected_step "${expected_step} + 1")
endforeach()
# Without --no-final-eval the last step is evaluated (this is also the control for the check below).
string(REGEX MATCHALL "val loss" evals "${out}")
list(LENGTH evals n)
if(NOT n EQUAL 1 OR NOT out MATCHES "step    30/30 \\| [^\n]* \\| val loss [0-9.]+\n")
  check_failed("a 30-step run with --eval-every 0 should evaluate once, at step 30: ${out}")
endif()

# --no-final-eval --sample 50: a longer run (the model for the generate checks below) that prints no
# validation loss, still prints its last progress line, then "sample:" and 50 characters of the file's byte
# set.
run(out ${TRAIN_GPT} --data words.txt ${tiny} --steps 150 --lr 1e-2 --eval-every 0 --no-final-eval
    --save words.safetensors --sample 50)
if(out MATCHES "val loss")
  check_failed("--no-final-eval still printed a validation loss: ${out}")
endif()
string(CONCAT progress "step   150/150 \\| loss [0-9.]+ \\| lr [0-9.e+-]+ \\| grad norm [0-9.]+ \\| "
                       "[0-9]+ tok/s \\| [0-9]+:[0-9][0-9] elapsed \\| ETA [0-9]+:[0-9][0-9]\n")
if(NOT out MATCHES "${progress}")
  check_failed("no progress line for the last step in the documented format: ${out}")
endif()
set(sample_text "")
string(FIND "${out}" "saved words.safetensors at step 150\nsample:\n" at)
if(at EQUAL -1)
  check_failed("no 'sample:' line right after the final save: ${out}")
else()
  string(FIND "${out}" "sample:\n" at)
  math(EXPR at "${at} + 8")
  string(SUBSTRING "${out}" ${at} -1 rest)
  string(LENGTH "${rest}" n)
  string(SUBSTRING "${rest}" 0 50 sample_text)
  string(SUBSTRING "${rest}" 50 -1 after)
  if(NOT n EQUAL 51 OR NOT after STREQUAL "\n")
    check_failed("--sample 50 printed ${n} bytes after 'sample:' (50 and a newline expected): '${rest}'")
  endif()
  foreach(i RANGE 0 49)
    string(SUBSTRING "${sample_text}" ${i} 1 c)
    string(FIND "${text}" "${c}" known)
    if(known EQUAL -1)
      check_failed("sample character ${i} ('${c}') is not a byte of the training text: '${sample_text}'")
    endif()
  endforeach()
endif()
# The sample is generate's sampler at the training seed (1337 by default), --temperature 0.8 and all tokens,
# from a newline: generate with the same settings prints the same text.
run(gen ${GENERATE} --model words.safetensors --tokens 50 --temperature 0.8 --seed 1337)
if(NOT gen STREQUAL "${sample_text}\n")
  check_failed("train_gpt --sample differs from generate at the same seed:\n'${sample_text}'\nvs\n'${gen}'")
endif()

# tok/s counts training time only. With --batch 1 and --eval-every 1 each evaluation (18 validation windows)
# costs several training steps, so a rate that counted it would be several times lower. The log's per-step
# tokens_per_s (tokens / step seconds) gives the training time independently: sum(tokens / rate).
run(out ${TRAIN_GPT} --data words.txt --layers 1 --heads 2 --width 32 --block 32 --batch 1 --steps 10
    --eval-every 1 --log-json rate.jsonl)
file(STRINGS ${WORK_DIR}/rate.jsonl lines)
set(train_us 0)
foreach(line IN LISTS lines)
  if(line MATCHES "\"tokens_per_s\":([0-9]+)[.,}]")
    math(EXPR train_us "${train_us} + 32 * 1000000 / ${CMAKE_MATCH_1}")
  endif()
endforeach()
if(NOT out MATCHES "step    10/10 \\|[^\n]*\\| ([0-9]+) tok/s \\|" OR train_us EQUAL 0)
  check_failed("no step-10 progress line with tok/s, or no rates in the log: ${out}")
else()
  math(EXPR expected "10 * 32 * 1000000 / ${train_us}")
  message(STATUS "tok/s at step 10: ${CMAKE_MATCH_1}; from the log's step times: ${expected}")
  math(EXPR low "${expected} * 9 / 10")
  math(EXPR high "${expected} * 11 / 10")
  if(CMAKE_MATCH_1 LESS low OR CMAKE_MATCH_1 GREATER high)
    check_failed("progress tok/s ${CMAKE_MATCH_1} is not the training-only rate ${expected} from the log")
  endif()
endif()

# Option errors.
run_fails("--temperature 0" ${TRAIN_GPT} --data words.txt --temperature 0
          MENTIONS "--temperature" "> 0" "'0'")
run_fails("--temperature nan" ${TRAIN_GPT} --data words.txt --temperature nan
          MENTIONS "--temperature" "'nan'")
# A device as an input file never ends (reading /dev/zero would fill the memory): refused by name.
run_fails("--amp-config /dev/zero" ${TRAIN_GPT} --data words.txt --amp-config /dev/zero
          MENTIONS "--amp-config file '/dev/zero' is a device")
run_fails("--data /dev/zero" ${TRAIN_GPT} --data /dev/zero MENTIONS "data file '/dev/zero' is a device")
# The model's flags are named as flags, not as GPTConfig's fields.
run_fails("--width not divisible by --heads" ${TRAIN_GPT} --data words.txt --heads 3 --width 16
          MENTIONS "--width 16 must be divisible by --heads 3")
run_fails("--dropout 1" ${TRAIN_GPT} --data words.txt --dropout 1 MENTIONS "--dropout must be in [0, 1), got 1")
# Read as decimal text, as every other number (strtod took hexadecimal and a leading space).
run_fails("--temperature hexadecimal" ${TRAIN_GPT} --data words.txt --temperature 0x1p-1
          MENTIONS "--temperature" "decimal" "'0x1p-1'")
run_fails("--top-k -1" ${TRAIN_GPT} --data words.txt --top-k -1 MENTIONS "--top-k" "'-1'")
run_fails("--sample x" ${TRAIN_GPT} --data words.txt --sample x MENTIONS "--sample" "'x'")
run_fails("--vocab-size with .txt" ${TRAIN_GPT} --data words.txt --vocab-size 50
          MENTIONS "--vocab-size" ".bin")
run_fails("--device gpu" ${TRAIN_GPT} --data words.txt --device gpu
          MENTIONS "'gpu' is not a device" "cpu, cuda or cuda:N")
# A GPU index this machine cannot have: the error names the device whether or not there are GPUs (no
# build, no driver, or fewer GPUs each say so).
run_fails("--device cuda:999" ${TRAIN_GPT} --data words.txt --device cuda:999 MENTIONS "Device::cuda(999)")

# ================================================================ generate
# Same seed, same text; another seed, other text (the trained model's next-word choices stay uncertain, so
# 200 tokens at temperature 1 differ); --top-k 1 is greedy: one text whatever the seed or temperature.
run(a ${GENERATE} --model words.safetensors --tokens 200 --temperature 1 --seed 5)
run(b ${GENERATE} --model words.safetensors --tokens 200 --temperature 1 --seed 5)
run(c ${GENERATE} --model words.safetensors --tokens 200 --temperature 1 --seed 6)
string(LENGTH "${a}" n)
if(NOT n EQUAL 201)
  check_failed("generate --tokens 200 printed ${n} bytes (200 and a newline expected)")
endif()
if(NOT a STREQUAL b)
  check_failed("generate with the same --seed printed different text:\n${a}\nvs\n${b}")
endif()
if(a STREQUAL c)
  check_failed("generate with --seed 5 and --seed 6 printed the same text:\n${a}")
endif()
run(g1 ${GENERATE} --model words.safetensors --tokens 100 --top-k 1 --seed 1)
run(g2 ${GENERATE} --model words.safetensors --tokens 100 --top-k 1 --seed 2 --temperature 3)
if(NOT g1 STREQUAL g2)
  check_failed("--top-k 1 depends on the seed or temperature:\n${g1}\nvs\n${g2}")
endif()
run(p ${GENERATE} --model words.safetensors --prompt "the cat" --tokens 10 --seed 3)
string(LENGTH "${p}" n)
if(NOT p MATCHES "^the cat" OR NOT n EQUAL 18)  # the prompt, 10 characters, a newline
  check_failed("generate --prompt 'the cat' --tokens 10 printed '${p}'")
endif()
run_fails("prompt byte outside the vocabulary" ${GENERATE} --model words.safetensors --prompt "the Zebra"
          MENTIONS "byte 90" "'Z'" "vocabulary")
run_fails("generate: an unknown option last" ${GENERATE} --model words.safetensors --bogus
          MENTIONS "unknown option '--bogus'")
run_fails("generate: an option twice" ${GENERATE} --model words.safetensors --tokens 5 --tokens 6
          MENTIONS "--tokens is given twice")
run_fails("generate: two models" ${GENERATE} --model words.safetensors --init words.safetensors
          MENTIONS "--init names the model a second time")
run_fails("generate --temperature 0" ${GENERATE} --model words.safetensors --temperature 0
          MENTIONS "--temperature" "> 0" "'0'")
run_fails("generate --temperature with a leading space" ${GENERATE} --model words.safetensors --temperature " 0.5"
          MENTIONS "--temperature" "decimal" "' 0.5'")

# A file's vocabulary and settings are checked where they are read. words.safetensors lists the 15 bytes of
# words.txt in ascending order, "[10,32,46,...]"; a list out of order or with a byte twice would map token ids
# to other characters, and an optimizer setting the command line refuses must be refused in a file too.
patch_file(words.safetensors unsorted.safetensors "\"vocab\":\"[10,32," "\"vocab\":\"[32,10,")
run_fails("generate: a vocabulary out of order" ${GENERATE} --model unsorted.safetensors --tokens 5
          MENTIONS "'unsorted.safetensors'" "metadata entry 'vocab': entry 1 is 10, below entry 0 (32)")
patch_file(words.safetensors repeated.safetensors "\"vocab\":\"[10,32," "\"vocab\":\"[10,10,")
run_fails("generate: a vocabulary with a byte twice" ${GENERATE} --model repeated.safetensors --tokens 5
          MENTIONS "'repeated.safetensors'" "entry 1 is 10, the same byte as entry 0")
run_fails("--init: a vocabulary with a byte twice" ${TRAIN_GPT} --data words.txt --init repeated.safetensors
          --steps 1 MENTIONS "--init 'repeated.safetensors'" "the same byte as entry 0")
patch_file(words.safetensors beta.safetensors "\"optimizer.beta1\":\"0.9\"" "\"optimizer.beta1\":\"0.5\"")
run_fails("--resume: an optimizer setting the options do not make" ${TRAIN_GPT} --data words.txt
          --resume beta.safetensors --steps 152 MENTIONS "--resume 'beta.safetensors'"
          "metadata entry 'optimizer.beta1' is 0.5, expected 0.9")
# The loss scaler's state is checked by the scaler where it is read; the error names the file.
patch_file(words.safetensors scale.safetensors
           "\"optimizer.scaler.0.scale\":\"1\"" "\"optimizer.scaler.0.scale\":\"0\"")
run_fails("--resume: a loss scale the configuration does not give" ${TRAIN_GPT} --data words.txt
          --resume scale.safetensors --steps 152 MENTIONS "train_gpt: --resume 'scale.safetensors': "
          "saved with scale 0, this scaler has scale 1")
patch_file(words.safetensors layers.safetensors "\"n_layer\":\"1\"" "\"n_layer\":\"x\"")
run_fails("generate: a config value that is no number" ${GENERATE} --model layers.safetensors --tokens 5
          MENTIONS "'layers.safetensors'" "'n_layer' = 'x' is not an integer")
# Values compare as values: "True" is the "true" the run writes.
patch_file(words.safetensors bias.safetensors "\"bias\":\"true\"" "\"bias\":\"True\"")
run(out ${TRAIN_GPT} --data words.txt --resume bias.safetensors --steps 151 --eval-every 0 --no-final-eval)
if(NOT out MATCHES "resumed at step 150")
  check_failed("--resume of a file with bias \"True\" did not resume: ${out}")
endif()
# --threads: a fixed count (the tests run with OMP_NUM_THREADS=1, which keeps train_gpt's thread tuner off
# too) is the count every step runs with; anything but auto or a count in [1, 4096] is refused up front.
run(out ${TRAIN_GPT} --data words.txt ${tiny} --steps 3 --eval-every 0 --threads 2 --log-json threads.jsonl)
file(STRINGS ${WORK_DIR}/threads.jsonl lines)
foreach(line IN LISTS lines)
  if(NOT line MATCHES "\"threads\":2[,}]")
    check_failed("--threads 2 ran a step at another count: ${line}")
  endif()
endforeach()
run_fails("--threads 0" ${TRAIN_GPT} --data words.txt ${tiny} --steps 1 --threads 0
          MENTIONS "--threads expects an integer in [1, 4096], got '0'")
run_fails("--threads many" ${TRAIN_GPT} --data words.txt ${tiny} --steps 1 --threads many
          MENTIONS "--threads expects an integer in [1, 4096], got 'many'")
run_fails("--log-json in a missing directory" ${TRAIN_GPT} --data words.txt ${tiny} --steps 1
          --log-json no/such/dir/log.jsonl MENTIONS "cannot open --log-json file 'no/such/dir/log.jsonl': No such file")

# ================================================================ token ids (.bin)
# A period of 50: t_j = 17 j mod 50 (17 is coprime to 50, so every id 0..49 once per period), repeated 40
# times (2000 tokens, 4000 bytes), written as little-endian uint16 by printf's octal escapes. Each token
# determines the next, so the pattern is memorised and the loss can fall far below ln(50) = 3.9.
find_program(PRINTF printf REQUIRED)
set(period "")
set(period_hex "")
set(ids_of_period "")
foreach(j RANGE 0 49)
  math(EXPR id "17 * ${j} % 50")
  math(EXPR octal "(${id} / 8) * 10 + ${id} % 8")  # ids < 64: two octal digits
  math(EXPR hex "${id}" OUTPUT_FORMAT HEXADECIMAL)
  string(REGEX REPLACE "^0x(.)$" "0x0\\1" hex "${hex}")
  string(SUBSTRING "${hex}" 2 2 hex)
  string(APPEND period "\\${octal}\\000")
  string(APPEND period_hex "${hex}00")
  list(APPEND ids_of_period ${id})
endforeach()
string(REPEAT "${period}" 40 pattern)
string(REPEAT "${period_hex}" 40 pattern_hex)
execute_process(COMMAND ${PRINTF} "${pattern}" OUTPUT_FILE ${WORK_DIR}/pattern.bin RESULT_VARIABLE status)
file(READ ${WORK_DIR}/pattern.bin bytes HEX)
if(NOT status EQUAL 0 OR NOT bytes STREQUAL pattern_hex)
  message(FATAL_ERROR "printf did not write the intended pattern.bin (status ${status}): ${bytes}")
endif()

run(out ${TRAIN_GPT} --data pattern.bin --vocab-size 50 --layers 1 --heads 2 --width 32 --block 16 --batch 8
    --steps 120 --lr 1e-2 --eval-every 0 --save pattern.safetensors --sample 20)
if(NOT out MATCHES "vocab 50 \\|")
  check_failed("the .bin header line does not say 'vocab 50': ${out}")
endif()
if(NOT out MATCHES "step   120/120 \\|[^\n]* \\| val loss ([0-9]+\\.[0-9]+)\n")
  check_failed("no final validation loss for the .bin run: ${out}")
else()
  message(STATUS ".bin pattern: val loss ${CMAKE_MATCH_1} after 120 steps")
  to_micro(loss ${CMAKE_MATCH_1})
  if(loss GREATER 200000)
    check_failed("the memorisable pattern's val loss is ${CMAKE_MATCH_1}, not below 0.2")
  endif()
endif()
if(NOT out MATCHES "\nsample:\n([^\n]*)\n$")
  check_failed("no 'sample:' line and ids at the end of the .bin run: ${out}")
else()
  check_ids("train_gpt --sample 20 (.bin)" "${CMAKE_MATCH_1}" 20 50)
endif()
run(out ${GENERATE} --model pattern.safetensors --tokens 20)
check_ids("generate --tokens 20 (.bin)" "${out}" 20 50)
# Greedy continuation of "0 17" is the pattern itself: 34 1 18 ... (t_2 .. t_11).
run(out ${GENERATE} --model pattern.safetensors --prompt "0 17" --tokens 10 --top-k 1)
list(SUBLIST ids_of_period 2 10 expected)
string(REPLACE ";" " " expected "${expected}")
string(STRIP "${out}" out)
if(NOT out STREQUAL expected)
  check_failed("greedy continuation of '0 17' is '${out}', not the pattern '${expected}'")
endif()
run_fails("generate: a prompt id >= vocab_size" ${GENERATE} --model pattern.safetensors --prompt "3 50"
          MENTIONS "prompt token 50" "[0, 50)")

# .bin errors: the flag is missing, an id is out of range (t_2 = 34 >= 30), the byte count is odd.
run_fails(".bin without --vocab-size" ${TRAIN_GPT} --data pattern.bin MENTIONS "pattern.bin" "--vocab-size")
run_fails(".bin token >= --vocab-size" ${TRAIN_GPT} --data pattern.bin --vocab-size 30
          MENTIONS "token 2 of" "is 34, not below --vocab-size 30")
execute_process(COMMAND ${PRINTF} "\\001\\000\\002" OUTPUT_FILE ${WORK_DIR}/odd.bin)
run_fails(".bin with an odd byte count" ${TRAIN_GPT} --data odd.bin --vocab-size 50
          MENTIONS "odd.bin" "odd byte count (3)")
# A token model (no character vocabulary, vocab_size 50) on text of 15 bytes: its checkpoint would list 15
# characters for 50 ids (generate refuses it), and --sample would draw ids that are no byte of the text.
run_fails("a token model on text" ${TRAIN_GPT} --data words.txt --init pattern.safetensors --steps 2
          MENTIONS "'words.txt' is text of 15 distinct bytes" "has vocab_size 50")

# ================================================================ precision modes (--precision, --amp-config)
# Every mode trains (the progress line names the mode, shows the loss scale), a JSON file sets a mode's
# options, a checkpoint resumes in its own mode only, its weights are fp32 so generate reads them, and bad
# values are errors naming them.
foreach(mode fp32 tf32 fp16 bf16 fp16_apex:O0 fp16_apex:O1 fp16_apex:O2 fp16_apex:O3 fp16_naive bf16_naive)
  run(out ${TRAIN_GPT} --data words.txt ${tiny} --steps 6 --eval-every 0 --precision ${mode})
  if(NOT out MATCHES "precision ${mode}\n")
    check_failed("--precision ${mode}: the header line does not name the mode: ${out}")
  endif()
  if(NOT out MATCHES "step     6/6 \\| loss [0-9.]+ [^\n]*\\| val loss [0-9.]+\n")
    check_failed("--precision ${mode}: no final step with a finite loss: ${out}")
  endif()
endforeach()
file(WRITE ${WORK_DIR}/naive.json
     "{\"mixed_precision\": \"fp16_naive\", \"initial_scale\": 1024, \"hysteresis\": 3}")
run(out ${TRAIN_GPT} --data words.txt ${tiny} --steps 4 --eval-every 0 --amp-config naive.json
    --save amp.safetensors)
if(NOT out MATCHES "precision fp16_naive\n" OR NOT out MATCHES "\\| scale 1024 \\|")
  check_failed("--amp-config naive.json: expected fp16_naive at scale 1024: ${out}")
endif()
# log_num_zeros_in_grad: the count is on the progress line ("zeros N") and in the JSON log ("num_zeros"); the
# run above, which did not ask for it, shows none.
if(out MATCHES "\\| zeros ")
  check_failed("a run without log_num_zeros_in_grad printed a zero count: ${out}")
endif()
run(out ${GENERATE} --model amp.safetensors --tokens 5)
file(WRITE ${WORK_DIR}/zeros.json
     "{\"mixed_precision\": \"fp16_naive\", \"initial_scale\": 1024, \"log_num_zeros_in_grad\": true}")
run(out ${TRAIN_GPT} --data words.txt ${tiny} --steps 2 --eval-every 0 --amp-config zeros.json
    --log-json zeros.jsonl)
if(NOT out MATCHES "step     2/2 [^\n]*\\| zeros [0-9]+")
  check_failed("log_num_zeros_in_grad: no zero count on the progress line: ${out}")
endif()
file(STRINGS ${WORK_DIR}/zeros.jsonl lines)
foreach(line IN LISTS lines)
  if(NOT line MATCHES "\"num_zeros\":[0-9]+[,}]")
    check_failed("log_num_zeros_in_grad: a log line lacks \"num_zeros\": ${line}")
  endif()
endforeach()
run_fails("resume in another mode" ${TRAIN_GPT} --data words.txt --resume amp.safetensors --steps 8
          --precision bf16 MENTIONS "--precision" "checkpoint")
run(out ${TRAIN_GPT} --data words.txt --resume amp.safetensors --steps 6 --eval-every 0)
if(NOT out MATCHES "resumed at step 4" OR NOT out MATCHES "precision fp16_naive")
  check_failed("resuming an fp16_naive checkpoint: ${out}")
endif()
run_fails("unknown mode" ${TRAIN_GPT} --data words.txt --precision fp6 MENTIONS "--precision 'fp6'" "fp16_naive" "nvfp4")
run_fails("unknown opt level" ${TRAIN_GPT} --data words.txt --precision fp16_apex:O5
          MENTIONS "O5" "opt_level")
file(WRITE ${WORK_DIR}/bad.json "{\"hysteresis\": 0}")
run_fails("hysteresis 0" ${TRAIN_GPT} --data words.txt --precision fp16_naive --amp-config bad.json
          MENTIONS "hysteresis" ">= 1")
file(WRITE ${WORK_DIR}/typo.json "{\"growth_intervall\": 10}")
run_fails("unknown key" ${TRAIN_GPT} --data words.txt --precision fp16 --amp-config typo.json
          MENTIONS "growth_intervall" "growth_interval")
run_fails("missing --amp-config file" ${TRAIN_GPT} --data words.txt --amp-config nothere.json
          MENTIONS "nothere.json")
file(WRITE ${WORK_DIR}/naive_options.json "{\"hysteresis\": 3}")
run_fails("--amp-config without a mode" ${TRAIN_GPT} --data words.txt --amp-config naive_options.json
          MENTIONS "naive_options.json" "names no mode" "--precision")
run_fails("--amp-config directory" ${TRAIN_GPT} --data words.txt --amp-config . MENTIONS "directory")
file(WRITE ${WORK_DIR}/broken.json "{\"hysteresis\": ")
run_fails("malformed --amp-config" ${TRAIN_GPT} --data words.txt --precision fp16_naive
          --amp-config broken.json MENTIONS "broken.json" "json:")
file(WRITE ${WORK_DIR}/clip.json "{\"mixed_precision\": \"fp16_naive\", \"clip_grad\": 5}")
run_fails("--grad-clip beside a naive clip_grad" ${TRAIN_GPT} --data words.txt --amp-config clip.json
          --grad-clip 0.5 MENTIONS "--grad-clip 0.5" "clip_grad 5")
run_fails("--save into a missing directory" ${TRAIN_GPT} --data words.txt ${tiny} --steps 2
          --save no/such/dir/x.safetensors MENTIONS "no/such/dir" "does not exist")
# Outputs that would overwrite an input or each other, and values that would be dropped or cut: errors before
# any training (the runs would otherwise exit 0 with a file lost or an option ignored).
file(COPY_FILE ${WORK_DIR}/words.txt ${WORK_DIR}/words_copy.txt)
run_fails("--log-json onto the data" ${TRAIN_GPT} --data words_copy.txt ${tiny} --steps 2 --log-json words_copy.txt
          MENTIONS "--log-json 'words_copy.txt' is the --data file")
run_fails("--save onto the data" ${TRAIN_GPT} --data words_copy.txt ${tiny} --steps 2 --save ./words_copy.txt
          MENTIONS "--save './words_copy.txt' is the --data file")
file(READ ${WORK_DIR}/words_copy.txt copy_after)
if(NOT copy_after STREQUAL text)
  check_failed("a refused --log-json/--save changed the data file")
endif()
run_fails("--save and --log-json alike" ${TRAIN_GPT} --data words.txt ${tiny} --steps 2 --save same.out
          --log-json same.out MENTIONS "--save and --log-json name the same file")
run_fails("--save onto a device" ${TRAIN_GPT} --data words.txt ${tiny} --steps 2 --save /dev/null
          MENTIONS "--save '/dev/null' exists and is not a regular file")
# Through a dangling link: --save onto a link to the --log-json file (not written yet) would put the
# checkpoint over the log; a link into a missing directory would replace the link. Both refused up front.
file(CREATE_LINK lg.jsonl ${WORK_DIR}/to_log.safetensors SYMBOLIC)
run_fails("--save through a link onto --log-json" ${TRAIN_GPT} --data words.txt ${tiny} --steps 2
          --save to_log.safetensors --log-json lg.jsonl MENTIONS "--save and --log-json name the same file")
file(CREATE_LINK no/such/dir/x.safetensors ${WORK_DIR}/nowhere.safetensors SYMBOLIC)
run_fails("--save through a link into a missing directory" ${TRAIN_GPT} --data words.txt ${tiny} --steps 2
          --save nowhere.safetensors MENTIONS "--save 'nowhere.safetensors' cannot be written")
# A regular file in a directory that takes no new file: refused before training, not at the first save.
if(EXISTS /proc/version)
  run_fails("--save into /proc" ${TRAIN_GPT} --data words.txt ${tiny} --steps 2 --save /proc/version
            MENTIONS "--save '/proc/version' cannot be written: cannot create a file there")
endif()
run_fails("a flag twice" ${TRAIN_GPT} --data words.txt --lr 0.1 --lr 0.2 MENTIONS "--lr is given twice")
run_fails("an unknown option last" ${TRAIN_GPT} --data words.txt --bogus MENTIONS "unknown option '--bogus'")
run_fails("a switch with a value" ${TRAIN_GPT} --data words.txt --eval-only=false
          MENTIONS "unknown option '--eval-only=false'")
run_fails("a value that does not read whole" ${TRAIN_GPT} --data words.txt --steps 10x
          MENTIONS "--steps expects an integer" "'10x'")
run_fails("an option without its value, last" ${TRAIN_GPT} --data words.txt --lr MENTIONS "train_gpt: --lr needs a value")
# A required option without its value lacks the value, whatever the rules: "needs a value", not "is required".
run_fails("--data without its value" ${TRAIN_GPT} --data MENTIONS "train_gpt: --data needs a value")
run_fails("an option without its value, no --data" ${TRAIN_GPT} --steps MENTIONS "train_gpt: --steps needs a value")
run_fails("generate --init without its value" ${GENERATE} --init MENTIONS "generate: --init needs a value")
# "--name=" gives no value either (CLI11 would take the next argument as the value).
run_fails("--steps=" ${TRAIN_GPT} --data words.txt --steps= MENTIONS "train_gpt: --steps needs a value")
run_fails("--save= before another option" ${TRAIN_GPT} --save= --data words.txt
          MENTIONS "train_gpt: --save needs a value")
run_fails("generate --checkpoint=" ${GENERATE} --checkpoint= --tokens 3 MENTIONS "generate: --checkpoint needs a value")
run_fails("generate --seed= last" ${GENERATE} --model words.safetensors --seed= MENTIONS "generate: --seed needs a value")
run_fails("no --data" ${TRAIN_GPT} --steps 3 MENTIONS "--data FILE is required")
run_fails("--init with --resume" ${TRAIN_GPT} --data words.txt --init words.safetensors --resume words.safetensors
          MENTIONS "--init and --resume exclude each other")
run_fails("--save-every without --save" ${TRAIN_GPT} --data words.txt --save-every 5
          MENTIONS "--save-every needs --save FILE")
run_fails("--temperature without --sample" ${TRAIN_GPT} --data words.txt --temperature 0.5
          MENTIONS "--temperature shapes --sample's tokens: give --sample N too")
# --help documents every option, and exits 0 without the required ones.
run(help ${TRAIN_GPT} --help)
foreach(option --data --vocab-size --layers --heads --width --block --dropout --batch --steps --lr --min-lr --warmup
               --optimizer --weight-decay --beta1 --beta2 --momentum --schedule --grad-clip --seed --sequential
               --precision --amp-config --device --tp --pp --dp --zero --micro-batches --pp-schedule --bucket-mb
               --init --save --save-every --resume --stop-at --eval-every --eval-only --log-json --no-final-eval
               --sample --temperature --top-k --show-amp-policy)
  if(NOT help MATCHES "\n  ${option} ")
    check_failed("train_gpt --help does not document ${option}:\n${help}")
  endif()
endforeach()
# --show-amp-policy prints the --precision mode's autocast table (or the line saying the mode autocasts
# nothing) and exits 0 without --data; it takes no training option.
run(policy ${TRAIN_GPT} --precision fp16_apex --show-amp-policy)
if(NOT policy MATCHES "^Autocast policy of fp16_apex:O1: NVIDIA Apex amp O1"
   OR NOT policy MATCHES "\n\\| `var` \\| f32 \\| torch FP32_FUNCS \\|")
  check_failed("train_gpt --precision fp16_apex --show-amp-policy does not print Apex O1's table:\n${policy}")
endif()
run(policy ${TRAIN_GPT} --show-amp-policy --precision bf16_naive)
if(NOT policy STREQUAL "bf16_naive casts no ops: no autocast; the whole model is cast to bf16\n")
  check_failed("train_gpt --show-amp-policy --precision bf16_naive printed:\n${policy}")
endif()
run_fails("--show-amp-policy with --data" ${TRAIN_GPT} --show-amp-policy --data words.txt
          MENTIONS "train_gpt: --show-amp-policy takes only --precision, got '--data'")
# The help says each rule once, in words, at the option that carries it; no CLI11 "Needs:"/"Excludes:" lists.
if(help MATCHES "Needs:|Excludes:")
  check_failed("train_gpt --help lists CLI11's needs/excludes:\n${help}")
endif()
foreach(rule "\n  --resume FILE [^\n]*not with --init" "\n  --eval-only [^\n]*--micro-batches[^\n]*--log-json"
             "\n  --temperature X [^\n]*needs --sample" "\n  --top-k N [^\n]*needs --sample")
  if(NOT help MATCHES "${rule}")
    check_failed("train_gpt --help does not say the rule '${rule}':\n${help}")
  endif()
endforeach()
# --help wins over a value that is refused, a missing value, a broken rule and an unknown option: help, exit 0.
foreach(args "--help;--steps;10x" "--steps;10x;--help" "--help;--steps" "--temperature;0;-h" "--help;--bogus"
             "--data;words.txt;--eval-only;--lr;5;--help")
  run(help ${TRAIN_GPT} ${args})
  if(NOT help MATCHES "\n  --steps N ")
    check_failed("train_gpt ${args} does not print the help:\n${help}")
  endif()
endforeach()
run(help ${GENERATE} --temperature 0 --help)
if(NOT help MATCHES "\n  --temperature X ")
  check_failed("generate --temperature 0 --help does not print the help:\n${help}")
endif()
run(help ${GENERATE} --help)
foreach(option --model --init --checkpoint --prompt --tokens --temperature --top-k --seed --device)
  if(NOT help MATCHES "[ ,]${option}[ ,]")
    check_failed("generate --help does not document ${option}:\n${help}")
  endif()
endforeach()
run(help ${PLOT_LOSS} -h)
if(NOT help MATCHES "LOG.jsonl" OR NOT help MATCHES "OUT.png" OR NOT help MATCHES "TITLE")
  check_failed("plot_loss --help does not document its arguments:\n${help}")
endif()
# An empty value (run_fails' argument list would drop the empty argument: execute_process keeps it).
execute_process(COMMAND ${TRAIN_GPT} --data words.txt --save "" WORKING_DIRECTORY ${WORK_DIR}
                RESULT_VARIABLE status ERROR_VARIABLE err OUTPUT_QUIET)
if(status EQUAL 0 OR NOT err MATCHES "--save needs a value, got ''")
  check_failed("an empty --save: exit ${status}, stderr '${err}' (expected an error naming --save)")
endif()
run_fails("--tp beyond int" ${TRAIN_GPT} --data words.txt --tp 4294967296
          MENTIONS "--tp expects an integer in [1, 2147483647]" "'4294967296'")
run_fails("--lr that rounds to 0" ${TRAIN_GPT} --data words.txt --lr 1e-400 MENTIONS "--lr" "round to 0" "'1e-400'")
run_fails("--lr in hexadecimal" ${TRAIN_GPT} --data words.txt --lr 0x1p-8 MENTIONS "--lr" "decimal" "'0x1p-8'")
run_fails("--eval-only --save" ${TRAIN_GPT} --data words.txt --eval-only --save e.safetensors
          MENTIONS "--eval-only only evaluates: --save")
run_fails("--eval-only --lr" ${TRAIN_GPT} --data words.txt --eval-only --lr 5
          MENTIONS "--eval-only only evaluates: --lr has nothing to act on")
# Parallel options with nothing to act on in one process (one stage, one data-parallel rank).
run_fails("--pp-schedule in one process" ${TRAIN_GPT} --data words.txt --pp-schedule gpipe
          MENTIONS "--pp-schedule orders a pipeline's micro-batches, and this run has one stage")
run_fails("--bucket-mb in one process" ${TRAIN_GPT} --data words.txt --bucket-mb 5
          MENTIONS "--bucket-mb sizes the buckets" "has one data-parallel rank")
run_fails("--schedule constant --warmup" ${TRAIN_GPT} --data words.txt --schedule constant --warmup 5
          MENTIONS "--warmup 5 shapes the cosine schedule")
run_fails("--top-k without --sample" ${TRAIN_GPT} --data words.txt --top-k 3 MENTIONS "--top-k" "--sample N")
run_fails("--momentum with adamw" ${TRAIN_GPT} --data words.txt --momentum 0.9 MENTIONS "--momentum is SGD's"
          "adamw")
run_fails("--beta1 with sgd" ${TRAIN_GPT} --data words.txt --optimizer sgd --beta1 0.8
          MENTIONS "--beta1 is Adam's and AdamW's")
run_fails("--stop-at beyond --steps" ${TRAIN_GPT} --data words.txt --steps 2 --stop-at 10
          MENTIONS "--stop-at 10 is beyond --steps 2")
run_fails("a validation split shorter than a block" ${TRAIN_GPT} --data words.txt --layers 1 --heads 2 --width 32
          --block 4000 --steps 1 MENTIONS "validation split of 'words.txt'" "block + 1 = 4001")
file(WRITE ${WORK_DIR}/not_a_checkpoint.safetensors "0123456789abcdef")
run_fails("--resume of a corrupt file" ${TRAIN_GPT} --data words.txt --resume not_a_checkpoint.safetensors
          MENTIONS "not_a_checkpoint.safetensors" "header length")

# The skipped-step count of the progress line is the run's since step 1: a resumed run continues it. At
# 2^32, fp16_naive's first steps overflow (and are skipped: no gradient norm, null in the log).
run(out ${TRAIN_GPT} --data words.txt ${tiny} --steps 6 --eval-every 0 --precision fp16_naive
    --log-json naive.jsonl)
if(NOT out MATCHES "step     6/6 [^\n]*\\| skipped ([0-9]+)")
  check_failed("fp16_naive: no skipped count at step 6: ${out}")
endif()
set(skipped_whole ${CMAKE_MATCH_1})
if(skipped_whole LESS 2 OR NOT out MATCHES "step     1/6 [^\n]*\\| grad norm n/a \\(skipped\\) \\|")
  check_failed("fp16_naive at 2^32: expected skipped first steps shown without a gradient norm: ${out}")
endif()
file(STRINGS ${WORK_DIR}/naive.jsonl lines)
list(GET lines 0 first)
if(NOT first MATCHES "\"grad_norm\":null,.*\"skipped\":true")
  check_failed("a skipped step's log line should have grad_norm null: ${first}")
endif()
run(out ${TRAIN_GPT} --data words.txt ${tiny} --steps 6 --stop-at 3 --eval-every 0 --precision fp16_naive
    --save naive3.safetensors)
# Resuming may change what is printed (verbose), not how it trains (hysteresis), and names what differs; a
# file that names no mode takes the checkpoint's.
file(WRITE ${WORK_DIR}/verbose.json "{\"verbose\": true}")
run(out ${TRAIN_GPT} --data words.txt --resume naive3.safetensors --steps 6 --eval-every 0
    --amp-config verbose.json)
if(NOT out MATCHES "step     6/6 [^\n]*\\| skipped ${skipped_whole}[ \n]")
  check_failed("the resumed run's skipped count at step 6 is not the whole run's ${skipped_whole}: ${out}")
endif()
file(WRITE ${WORK_DIR}/hyst.json "{\"mixed_precision\": \"fp16_naive\", \"hysteresis\": 3}")
run_fails("resume with another hysteresis" ${TRAIN_GPT} --data words.txt --resume naive3.safetensors --steps 6
          --amp-config hyst.json MENTIONS "hysteresis 3 (the checkpoint's 2)")
run(out ${TRAIN_GPT} --data words.txt --resume naive3.safetensors --steps 3)
if(NOT out MATCHES "nothing to train: the checkpoint is at step 3 and --steps is 3")
  check_failed("resuming at the final step should say there is nothing to train: ${out}")
endif()
# --stop-at on a resumed run: before its step (it trained nothing, rewrote the checkpoint, said nothing) and
# beyond the checkpoint's --steps (6) are errors.
run_fails("--stop-at before the resumed step" ${TRAIN_GPT} --data words.txt --resume naive3.safetensors --stop-at 1
          --save naive3.safetensors MENTIONS "--stop-at 1 is before step 3")
run_fails("--stop-at beyond a resumed run's steps" ${TRAIN_GPT} --data words.txt --resume naive3.safetensors
          --stop-at 9 MENTIONS "--stop-at 9 is beyond the run's 6 steps (the checkpoint's --steps)")

# A loss that overflows is said once and logged as null (JSON has no NaN); the run goes on. (No weight decay:
# lr x weight_decay must be at most 1.)
run(out ${TRAIN_GPT} --data words.txt ${tiny} --steps 4 --eval-every 0 --precision fp16 --lr 1e6 --weight-decay 0
    --warmup 0 --min-lr 1e5 --grad-clip 0 --log-json nan.jsonl)
if(NOT out MATCHES "warning: step [0-9]+: the loss is nan" OR NOT out MATCHES "step     4/4 \\| loss nan \\|")
  check_failed("an overflowing fp16 run: expected one warning and 'loss nan': ${out}")
endif()
file(STRINGS ${WORK_DIR}/nan.jsonl lines)
list(LENGTH lines n)
list(GET lines -1 last)
if(NOT n EQUAL 4 OR NOT last MATCHES "\"loss\":null,")
  check_failed("an overflowing fp16 run: expected 4 log lines, the last with loss null: ${lines}")
endif()

# plot_loss draws a log as a 900 x 540 PNG (its pixels and encoding: the Plot* unit tests), a log with null
# losses too, and replaces the steps a resumed run repeated (a log of steps 0-29, then 10-29 again).
run(out ${PLOT_LOSS} log.jsonl loss.png "a title")
check_png_header(${WORK_DIR}/loss.png 900 540)
if(NOT out MATCHES "plot_loss: wrote loss.png")
  check_failed("plot_loss does not say what it wrote: ${out}")
endif()
run(out ${PLOT_LOSS} nan.jsonl nan.png)
check_png_header(${WORK_DIR}/nan.png 900 540)
file(READ ${WORK_DIR}/log.jsonl log_text)
string(REGEX MATCH "{\"step\":10,.*$" tail "${log_text}")
file(WRITE ${WORK_DIR}/resumed.jsonl "${log_text}${tail}")
run(out ${PLOT_LOSS} resumed.jsonl resumed.png "a title")
file(READ ${WORK_DIR}/loss.png first HEX)
file(READ ${WORK_DIR}/resumed.png second HEX)
if(NOT first STREQUAL second)
  check_failed("plot_loss: a log with steps 10-29 repeated does not draw the plot of the log without them")
endif()
file(WRITE ${WORK_DIR}/empty.jsonl "")
run_fails("plot_loss: missing log" ${PLOT_LOSS} missing.jsonl x.png MENTIONS "cannot read the log 'missing.jsonl'")
run_fails("plot_loss: empty log" ${PLOT_LOSS} empty.jsonl x.png MENTIONS "no training steps in 'empty.jsonl'")
run_fails("plot_loss: not a log" ${PLOT_LOSS} words.txt x.png MENTIONS "words.txt line 1:" "--log-json file")
run_fails("plot_loss: arguments" ${PLOT_LOSS} log.jsonl MENTIONS "expected LOG.jsonl OUT.png [TITLE]")
# After "--" every argument is positional: a title that starts with '-', even one that reads as an option.
run(out ${PLOT_LOSS} log.jsonl dash.png -- -run-1)
check_png_header(${WORK_DIR}/dash.png 900 540)
run(out ${PLOT_LOSS} log.jsonl dash2.png -- --help)
check_png_header(${WORK_DIR}/dash2.png 900 540)
file(READ ${WORK_DIR}/dash.png dash HEX)
if(dash STREQUAL first)
  check_failed("plot_loss: the title after '--' is not drawn (the same PNG as the title 'a title')")
endif()
run(out ${PLOT_LOSS} log.jsonl -- dash3.png)
check_png_header(${WORK_DIR}/dash3.png 900 540)
run_fails("plot_loss: an option-like title without --" ${PLOT_LOSS} log.jsonl x.png -run-1
          MENTIONS "plot_loss: unknown option '-run-1'")
run_fails("plot_loss: missing directory" ${PLOT_LOSS} log.jsonl no/such/dir/x.png MENTIONS "no/such/dir/x.png")
file(GLOB leftovers ${WORK_DIR}/*.tmp ${WORK_DIR}/x.png)
if(leftovers)
  check_failed("plot_loss left files behind: ${leftovers}")
endif()
