# Run with cmake -P at every build: writes OUT, a header defining
# TRIAX_GIT_COMMIT as the short commit of the git tree at SRC ("unknown"
# without git or outside a checkout). The file is only rewritten when the
# commit changed, so an unchanged tree recompiles nothing.
execute_process(
  COMMAND git -C "${SRC}" rev-parse --short=12 HEAD
  OUTPUT_VARIABLE commit
  OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE rc
  ERROR_QUIET)
if(NOT rc EQUAL 0 OR commit STREQUAL "")
  set(commit "unknown")
endif()
set(text "#define TRIAX_GIT_COMMIT \"${commit}\"\n")
set(old "")
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
endif()
if(NOT old STREQUAL text)
  file(WRITE "${OUT}" "${text}")
endif()
