#!/usr/bin/env bash
# The output-metric calibration of kvproxy-18m on the device machine's 16 CPU
# cores (kvcalibrate --metric=output on the default training ids), then the
# prediction check of both tables on four held-out conversations. Run from
# the repository root with device-bundle/cal.tar.xz (bundle.sh of
# kvcalibrate and calibration_validate) and device-data/data.tar.xz carried;
# OUT_DIR gets cal.tar.xz (tables, markdown, logs). docs/client.md.
set -u
OUTD=$1
tar xJf device-bundle/cal.tar.xz -C /tmp
mkdir -p /tmp/cdata /tmp/co && tar xJf device-data/data.tar.xz -C /tmp/cdata
start=$SECONDS
timeout 500 /tmp/cbundle/run /tmp/cbundle/bin/kvcalibrate --data_dir=/tmp/cdata --metric=output --threads=16 \
  --out=/tmp/co/calibration_kvproxy-18m-output.txtpb --markdown_out=/tmp/co/calibration_output.md > /tmp/co/cal.log 2>&1
echo "kvcalibrate rc=$? $((SECONDS-start)) s"
left=$((570-(SECONDS-start)))
if [ -s /tmp/co/calibration_kvproxy-18m-output.txtpb ] && [ $left -gt 60 ]; then
  timeout $left /tmp/cbundle/run /tmp/cbundle/bin/calibration_validate --data_dir=/tmp/cdata \
    --tables=bench/results/calibration_kvproxy-18m.txtpb,/tmp/co/calibration_kvproxy-18m-output.txtpb \
    --validate_ids=multi_turn_base_3,multi_turn_base_8,multi_turn_base_42,multi_turn_base_121 --validate=8 --threads=16 \
    --markdown_out=/tmp/co/validate.md > /tmp/co/validate.log 2>&1
  echo "validate rc=$? $((SECONDS-start)) s"
fi
tail -5 /tmp/co/cal.log
tar cJf $OUTD/cal.tar.xz -C /tmp/co .
