#!/usr/bin/env bash
# Used by docs/bench.md "policy_bench: run, shard, merge": run on the device
# machine from the repository root with device-bundle/pbench.tar.xz and
# device-data/data.tar.xz carried; OUT_DIR gets pbench.tar.xz.
# One policy_bench per (held-out conversation, half of the configurations), then the merge.
set -u
OUTD=$1
tar xJf device-bundle/pbench.tar.xz -C /tmp
mkdir -p /tmp/pdata /tmp/po && tar xJf device-data/data.tar.xz -C /tmp/pdata
A=bf16,fp8,int8,int4,int4-g64,int4-g128,int2,kivi2,tq4,tq3,tq2
B=bf16,tri-2.5,tri-3,tri-3.5,tri-4,tri-4.5,tri-5,tri-5.5,tri-6,tri-3.5-no-temporal,tri-3.5-no-role
for id in 3 8 15 17 42 46 50 59 121 177 181; do
  for half in A B; do
    cfg=$A; [ $half = B ] && cfg=$B
    ( timeout 560 /tmp/pbundle/run /tmp/pbundle/bin/policy_bench --data_dir=/tmp/pdata \
        --bfcl_ids=multi_turn_base_$id --configs=$cfg --threads=1 --attention_error=false \
        --raw_out=/tmp/po/s$id$half.tsv --out=/tmp/po/r$id$half.md > /tmp/po/log$id$half.txt 2>&1
      echo "$id$half rc=$? $SECONDS s" >> /tmp/po/summary.txt ) &
  done
done
wait
cat /tmp/po/summary.txt
shards=$(ls /tmp/po/s*.tsv | paste -sd, -)
/tmp/pbundle/run /tmp/pbundle/bin/policy_bench --merge=$shards --out=/tmp/po/policy.md > /tmp/po/merge.txt 2>&1; echo "merge rc=$?"
tar cJf $OUTD/pbench.tar.xz -C /tmp/po .
