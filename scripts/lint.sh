#!/usr/bin/env bash
# `make lint`: clang-tidy with the checks in .clang-tidy over every C++ source
# the build compiles (compile_commands.json of BUILD_DIR), headers included
# through HeaderFilterRegex. Generated protobuf code is skipped, and so are
# .cu files: clang-tidy 14 cannot take nvcc's command lines; their host code
# lives in .cc files, which are checked.
#
#   scripts/lint.sh BUILD_DIR [FILE.cc ...]
#
# With FILEs (paths from the repository root), only those of them the build
# compiles. Prints each finding and exits 1 when there is any.
set -euo pipefail
build=${1:-build}
shift || true
only=("$@")
cd "$(dirname "$0")/.."
root=$(pwd)
if ! command -v run-clang-tidy > /dev/null; then
  echo "lint: run-clang-tidy not found (Debian: apt-get install clang-tidy)" >&2
  exit 2
fi
if [ ! -f "$build/compile_commands.json" ]; then
  echo "lint: $build/compile_commands.json is missing; configure first" >&2
  exit 2
fi
# The sources include generated protobuf headers.
cmake --build "$build" --target triax_proto -j "$(nproc)" > /dev/null

mapfile -t files < <(python3 - "$build/compile_commands.json" "$root" "${only[@]}" <<'PY'
import json, os, sys
entries = json.load(open(sys.argv[1]))
root = os.path.realpath(sys.argv[2])
only = {os.path.normpath(p) for p in sys.argv[3:]}
seen = set()
for e in entries:
    f = os.path.realpath(os.path.join(e["directory"], e["file"]))
    if not f.startswith(root + "/") or not f.endswith(".cc"):
        continue
    rel = os.path.relpath(f, root)
    if rel.split("/")[0].startswith("build") or rel in seen:
        continue
    if only and rel not in only:
        continue
    seen.add(rel)
    print(rel)
PY
)
echo "lint: clang-tidy on ${#files[@]} files"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
run-clang-tidy -p "$build" -quiet -j "$(nproc)" "${files[@]}" > "$log" 2>&1 || true
# Findings: "path:line:col: warning|error: text [check]", once each.
findings=$(sed 's/\x1b\[[0-9;]*m//g' "$log" | grep -E '^/.*:[0-9]+:[0-9]+: (warning|error):' | sort -u || true)
if [ -n "$findings" ]; then
  echo "$findings"
  echo "lint: $(echo "$findings" | wc -l) findings"
  exit 1
fi
echo "lint: clean"
