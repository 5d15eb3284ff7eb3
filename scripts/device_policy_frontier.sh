#!/usr/bin/env bash
# Used by docs/bench.md "policy_bench: run, shard, merge": run on the device
# machine from the repository root with device-bundle/pbench.tar.xz and
# device-data/data.tar.xz carried; OUT_DIR gets pbench.tar.xz.
# One policy_bench per (held-out conversation, group of configurations), then
# the merge. CAL: the calibration table (default policy_bench's);
# GROUPS_RUN: configuration groups (A uniform, B triaxial with the dnll
# objective and the ablations, C triaxial with the kl objective; default
# "A B C"); AW: answer weight of a further dnll sweep, group D; EXTRA:
# configurations of a further group E (e.g. bf16,tri-3.6,tri-3.8). With
# device-bundle/cal.tar.xz carried too, VALIDATE_TABLES (comma-separated)
# get calibration_validate's prediction check on the held-out conversations.
set -u
OUTD=$1
CAL=${CAL:-}
AW=${AW:-}
tar xJf device-bundle/pbench.tar.xz -C /tmp
mkdir -p /tmp/pdata /tmp/po && tar xJf device-data/data.tar.xz -C /tmp/pdata
cal_flag=()
[ -n "$CAL" ] && cal_flag=(--calibration="$CAL")
A=bf16,fp8,int8,int4,int4-g64,int4-g128,int2,kivi2,tq4,tq3,tq2
B=bf16,tri-2.5,tri-3,tri-3.5,tri-4,tri-4.5,tri-5,tri-5.5,tri-6,tri-3.5-no-temporal,tri-3.5-no-role
# C: the same sweep with the KL objective; D: with answer weight AW.
C=bf16; D=bf16
for b in 2.5 3 3.5 4 4.5 5 5.5 6; do C="$C,tri-$b-kl"; D="$D,tri-$b-a$AW"; done
GROUPS_RUN=${GROUPS_RUN:-A B C}
[ -n "$AW" ] && GROUPS_RUN="$GROUPS_RUN D"
E=${EXTRA:-}
[ -n "$E" ] && GROUPS_RUN="$GROUPS_RUN E"
groups=$GROUPS_RUN
start=$SECONDS
for id in 3 8 15 17 42 46 50 59 121 177 181; do
  for g in $groups; do
    cfg=$A; [ $g = B ] && cfg=$B; [ $g = C ] && cfg=$C; [ $g = D ] && cfg=$D; [ $g = E ] && cfg=$E
    ( timeout 560 /tmp/pbundle/run /tmp/pbundle/bin/policy_bench --data_dir=/tmp/pdata "${cal_flag[@]}" \
        --bfcl_ids=multi_turn_base_$id --configs=$cfg --threads=1 --attention_error=false \
        --answer_weights=0${AW:+,$AW} --objectives=dnll,kl \
        --raw_out=/tmp/po/s$id$g.tsv --out=/tmp/po/r$id$g.md > /tmp/po/log$id$g.txt 2>&1
      echo "$id$g rc=$? $((SECONDS-start)) s" >> /tmp/po/summary.txt ) &
  done
done
wait
cat /tmp/po/summary.txt
shards=$(ls /tmp/po/s*.tsv | paste -sd, -)
/tmp/pbundle/run /tmp/pbundle/bin/policy_bench --merge=$shards --raw_out=/tmp/po/merged.tsv \
  --out=/tmp/po/policy.md > /tmp/po/merge.txt 2>&1; echo "merge rc=$? $((SECONDS-start)) s"
if [ -n "${VALIDATE_TABLES:-}" ] && [ -f device-bundle/cal.tar.xz ]; then
  tar xJf device-bundle/cal.tar.xz -C /tmp
  timeout $((570-(SECONDS-start))) /tmp/cbundle/run /tmp/cbundle/bin/calibration_validate \
    --data_dir=/tmp/pdata --tables="$VALIDATE_TABLES" --validate=8 --threads="$(nproc)" \
    --markdown_out=/tmp/po/validate.md > /tmp/po/validate.log 2>&1
  echo "validate rc=$? $((SECONDS-start)) s"
fi
tar cJf $OUTD/pbench.tar.xz -C /tmp/po .
