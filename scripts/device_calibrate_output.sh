#!/usr/bin/env bash
# The output-metric calibration of kvproxy-18m on the device machine's 16 CPU
# cores: kvcalibrate --metric=output on IDS (default: the default training
# ids), writing the sums after every conversation (--sums_out), so a run the
# time limit stops keeps the conversations it finished; merge shards later
# with kvcalibrate --merge_sums=... --ids=. ENCODINGS: kvcalibrate
# --encodings (default: its defaults); UNION_WITH: a table of the same
# conversations to join the new one with (--union_tables), written as
# union.txtpb. Run from the repository root with
# device-bundle/cal.tar.xz (bundle.sh of kvcalibrate and calibration_validate,
# built with -march=x86-64-v3) and device-data/data.tar.xz carried; OUT_DIR
# gets cal.tar.xz (sums, table, markdown, log). docs/client.md.
set -u
OUTD=$1
IDS=${IDS:-}
LIMIT=${LIMIT:-560}
tar xJf device-bundle/cal.tar.xz -C /tmp
mkdir -p /tmp/cdata /tmp/co && tar xJf device-data/data.tar.xz -C /tmp/cdata
start=$SECONDS
ids_flag=()
[ -n "$IDS" ] && ids_flag=(--ids="$IDS")
enc_flag=()
[ -n "${ENCODINGS:-}" ] && enc_flag=(--encodings="$ENCODINGS")
timeout "$LIMIT" /tmp/cbundle/run /tmp/cbundle/bin/kvcalibrate --data_dir=/tmp/cdata \
  --metric=output --threads="$(nproc)" "${ids_flag[@]}" "${enc_flag[@]}" --sums_out=/tmp/co/device.sums \
  --out=/tmp/co/calibration_kvproxy-18m-output.txtpb --markdown_out=/tmp/co/calibration_output.md \
  > /tmp/co/cal.log 2>&1
echo "kvcalibrate rc=$? $((SECONDS-start)) s on $(nproc) cores"
grep -E "^\[|done in" /tmp/co/cal.log | tail -20
if [ -n "${UNION_WITH:-}" ]; then
  /tmp/cbundle/run /tmp/cbundle/bin/kvcalibrate --union_tables="$UNION_WITH",/tmp/co/calibration_kvproxy-18m-output.txtpb \
    --out=/tmp/co/union.txtpb --markdown_out=/tmp/co/union.md >> /tmp/co/cal.log 2>&1
  echo "union rc=$? $(grep -c '^entries' /tmp/co/union.txtpb) entries"
fi
tar cJf "$OUTD/cal.tar.xz" -C /tmp/co .
