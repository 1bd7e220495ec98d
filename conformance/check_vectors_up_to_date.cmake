# ctest conformance_vectors_up_to_date: regenerates the golden vectors into SCRATCH with the
# kvq binary KVQ and fails unless every file equals the committed one in COMMITTED (same file
# list, same bytes). Usage: cmake -DKVQ=... -DCOMMITTED=... -DSCRATCH=... -P <this file>
cmake_policy(VERSION 3.25)

foreach(var KVQ COMMITTED SCRATCH)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_vectors_up_to_date: -D${var}=... is required")
  endif()
endforeach()

# Relative paths are taken from the working directory.
foreach(var KVQ COMMITTED SCRATCH)
  get_filename_component(${var} "${${var}}" ABSOLUTE BASE_DIR "$ENV{PWD}")
endforeach()
if(NOT IS_DIRECTORY "${COMMITTED}")
  message(FATAL_ERROR "check_vectors_up_to_date: ${COMMITTED} is not a folder")
endif()

file(REMOVE_RECURSE "${SCRATCH}")
execute_process(COMMAND "${KVQ}" vectors generate --out "${SCRATCH}"
                RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "kvq vectors generate failed (${status}):\n${out}${err}")
endif()

file(GLOB_RECURSE committed RELATIVE "${COMMITTED}" "${COMMITTED}/*.safetensors"
     "${COMMITTED}/manifest.json")
file(GLOB_RECURSE regenerated RELATIVE "${SCRATCH}" "${SCRATCH}/*.safetensors"
     "${SCRATCH}/manifest.json")
list(SORT committed)
list(SORT regenerated)

set(problems "")
set(count_problems 0)
macro(report line)
  math(EXPR count_problems "${count_problems} + 1")
  if(count_problems LESS_EQUAL 40)
    string(APPEND problems "  ${line}\n")
  endif()
endmacro()
foreach(path IN LISTS regenerated)
  if(NOT path IN_LIST committed)
    report("new file not committed: ${path}")
  endif()
endforeach()
foreach(path IN LISTS committed)
  if(NOT path IN_LIST regenerated)
    report("committed file no longer generated: ${path}")
    continue()
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} -E compare_files "${COMMITTED}/${path}"
                          "${SCRATCH}/${path}" RESULT_VARIABLE differs)
  if(NOT differs EQUAL 0)
    report("differs: ${path}")
  endif()
endforeach()
if(count_problems GREATER 40)
  math(EXPR more "${count_problems} - 40")
  string(APPEND problems "  ... and ${more} more\n")
endif()

if(problems)
  message(FATAL_ERROR
          "The golden vectors changed on regeneration (committed: ${COMMITTED}, regenerated: "
          "${SCRATCH}):\n${problems}If the spec changed on purpose, bump spec/README.md, run "
          "`kvq vectors generate --out conformance/vectors` and commit the result.")
endif()
list(LENGTH committed count)
message(STATUS "golden vectors up to date: ${count} files identical")
