# ctest gpu_library_only_configure (cmake -P): configures the torch path's build
# (-DKVQ_GPU_LIBRARY_ONLY=ON, README "From PyTorch") into CHECK_DIR with every package that is not
# CUDA disabled, as on the GPU machine's image, and fails when
#   - the configure fails (a REQUIRED find_package of a disabled package is a CMake error),
#   - the project asked for any of those packages at all (an optional one too): CMake reports
#     every CMAKE_DISABLE_FIND_PACKAGE_<name> that no find_package read as "not used",
#   - the build lacks libkvq_gpu.so or the staged torch_ops.py, or holds a folder of the oracle.
# Configure only (seconds): nothing is compiled, nothing is written outside CHECK_DIR.
# Arguments (-D): SOURCE_DIR, CHECK_DIR, GENERATOR, CUDA_COMPILER, CXX_COMPILER, C_COMPILER.
foreach(arg SOURCE_DIR CHECK_DIR GENERATOR CUDA_COMPILER CXX_COMPILER C_COMPILER)
  if(NOT DEFINED ${arg})
    message(FATAL_ERROR "library_only_configure.cmake: -D${arg}= is missing")
  endif()
endforeach()

# Every package the full build finds, besides CUDAToolkit and Threads (names as the
# find_package calls spell them).
set(packages hwy Eigen3 GTest rapidcheck CLI11 nlohmann_json benchmark pybind11)
set(disable_args)
foreach(package ${packages})
  list(APPEND disable_args -DCMAKE_DISABLE_FIND_PACKAGE_${package}=ON)
endforeach()

file(REMOVE_RECURSE "${CHECK_DIR}")
execute_process(
  COMMAND "${CMAKE_COMMAND}" -S "${SOURCE_DIR}" -B "${CHECK_DIR}" -G "${GENERATOR}"
          -DKVQ_GPU_LIBRARY_ONLY=ON -DCMAKE_CUDA_ARCHITECTURES=90
          "-DCMAKE_CUDA_COMPILER=${CUDA_COMPILER}" "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}"
          "-DCMAKE_C_COMPILER=${C_COMPILER}" ${disable_args}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the KVQ_GPU_LIBRARY_ONLY configure failed (exit ${rc}) with "
                      "${packages} disabled:\n${out}\n${err}")
endif()

# CMake lists the -D variables no find_package read after "Manually-specified variables were not
# used by the project:"; each disable switch must be there.
string(FIND "${err}" "Manually-specified variables were not used by the project:" unused_at)
if(unused_at EQUAL -1)
  message(FATAL_ERROR "the KVQ_GPU_LIBRARY_ONLY configure read every CMAKE_DISABLE_FIND_PACKAGE_ "
                      "switch (CMake printed no unused variables): it asked for ${packages}\n${err}")
endif()
string(SUBSTRING "${err}" ${unused_at} -1 unused)
foreach(package ${packages})
  if(NOT unused MATCHES "CMAKE_DISABLE_FIND_PACKAGE_${package}[\r\n]")
    message(FATAL_ERROR "the KVQ_GPU_LIBRARY_ONLY configure called find_package(${package}) "
                        "(CMAKE_DISABLE_FIND_PACKAGE_${package} was read):\n${out}\n${err}")
  endif()
endforeach()

foreach(needed gpu/CMakeFiles/kvq_gpu.dir tools/python/kvq/torch_ops.py tools/python/kvq/hf.py)
  if(NOT EXISTS "${CHECK_DIR}/${needed}")
    message(FATAL_ERROR "the KVQ_GPU_LIBRARY_ONLY build lacks ${needed}")
  endif()
endforeach()
foreach(folder cpu_ref calib conformance fuzz bench tools/CMakeFiles)
  if(EXISTS "${CHECK_DIR}/${folder}")
    message(FATAL_ERROR "the KVQ_GPU_LIBRARY_ONLY build configures ${folder}/")
  endif()
endforeach()
file(REMOVE_RECURSE "${CHECK_DIR}")
message(STATUS "KVQ_GPU_LIBRARY_ONLY configures with ${packages} disabled and asks for none")
