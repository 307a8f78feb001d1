# Writes OUT with LOOM_GIT_DESCRIBE (`git describe --always --dirty` of SRC, "unknown" without
# git or outside a clone), touching OUT only when it changes. Run at every build (CMakeLists.txt).
execute_process(COMMAND git describe --always --dirty
                WORKING_DIRECTORY ${SRC}
                OUTPUT_VARIABLE describe OUTPUT_STRIP_TRAILING_WHITESPACE
                RESULT_VARIABLE rc ERROR_QUIET)
if(NOT rc EQUAL 0 OR describe STREQUAL "")
  set(describe "unknown")
endif()
file(WRITE ${OUT}.tmp "#define LOOM_GIT_DESCRIBE \"${describe}\"\n")
execute_process(COMMAND ${CMAKE_COMMAND} -E copy_if_different ${OUT}.tmp ${OUT})
file(REMOVE ${OUT}.tmp)
