# Included into llama.cpp's configure (CMAKE_PROJECT_INCLUDE) by `make llamacpp-tools`, which builds
# llama.cpp as a unity build (each target's sources compiled a few to a translation unit: about half
# the compile time on two cores, the same code). Two of its targets do not compile that way (common's
# json.cpp specializes templates its neighbours instantiate; mtmd-helper refuses mtmd's internal
# headers): they build file by file, once every target exists.
cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL set_property TARGET llama-common mtmd PROPERTY UNITY_BUILD OFF)
