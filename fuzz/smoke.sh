#!/usr/bin/env bash
# CI's fuzz smoke test: builds the three targets in one cargo invocation with
# the instrumentation `cargo fuzz build --dev` uses, and runs each for
# SECONDS (default 10). The flags are cargo-fuzz 0.13.2's
# (src/project.rs, `Project::cargo`): SanitizerCoverage level 4 with inline
# 8-bit counters, PC table, compare tracing and stack depth, `--cfg fuzzing`,
# branch folding off, AddressSanitizer, debug assertions. Building them
# here saves CI the install of cargo-fuzz, and an unoptimised build (cargo-fuzz's
# release build uses one codegen unit per crate) takes a fraction of the
# time: enough for a smoke test. For real fuzzing use `cargo fuzz run -O`
# (README.md).
# `smoke.sh build` only builds them (CI builds them in the background while
# its tests run, then runs `smoke.sh 10`, whose build is then a no-op).
set -euo pipefail
cd "$(dirname "$0")"
seconds="${1:-10}"
triple="$(rustc -vV | sed -n 's/^host: //p')"
flags="-Cpasses=sancov-module"
for arg in -sanitizer-coverage-level=4 -sanitizer-coverage-inline-8bit-counters \
  -sanitizer-coverage-pc-table -sanitizer-coverage-trace-compares \
  -simplifycfg-branch-fold-threshold=0 -sanitizer-coverage-stack-depth; do
  flags="$flags -Cllvm-args=$arg"
done
flags="$flags --cfg fuzzing -Zsanitizer=address -Cdebug-assertions"

# Nightly flags on the stable toolchain, as README.md explains.
RUSTC_BOOTSTRAP=1 RUSTFLAGS="$flags" cargo build --target "$triple" \
  --config 'profile.dev.debug="line-tables-only"' --features model --bins

[ "$seconds" = build ] && exit 0

mkdir -p corpus/mil_parse corpus/npy_parse corpus/model_load
cp ../crates/mil/tests/data/small.mil corpus/mil_parse/ 2>/dev/null || true
# The three run side by side (each is one thread, and its time limit is
# wall time); a crash in any fails the script.
targets=(mil_parse npy_parse model_load)
pids=()
for target in "${targets[@]}"; do
  # ASAN_OPTIONS as cargo-fuzz sets them for AddressSanitizer.
  ASAN_OPTIONS=detect_odr_violation=0 "target/$triple/debug/$target" \
    -max_total_time="$seconds" -rss_limit_mb=4096 "corpus/$target" > "target/smoke-$target.log" 2>&1 &
  pids+=($!)
done
rc=0
for i in "${!targets[@]}"; do
  status=0
  wait "${pids[$i]}" || status=$?
  echo "${targets[$i]}: $(tail -1 "target/smoke-${targets[$i]}.log")"
  if [ "$status" != 0 ]; then
    echo "${targets[$i]} exited with status $status:"
    tail -30 "target/smoke-${targets[$i]}.log"
    rc=1
  fi
done
exit "$rc"
