# Trains a head on /tmp/run/${DATA:-data-all} for BUDGET seconds with the `full` preset changed by
# SETTINGS (JSON members, e.g. '"max_length": 512'), from INIT if set, in its own folder
# /tmp/run/${RUN:-run1} (a second run on a warm machine takes another RUN); the head comes back in
# parts ($OUT/head.tar.*: `cat head.tar.* | tar x`), with the metrics and the config.
. benchmarks/device/env.sh
echo "{\"time_budget_s\": ${BUDGET:-450}${SETTINGS:+, $SETTINGS}}" > $OUT/config.json && cat $OUT/config.json
python3 benchmarks/gpu_session.py train-bench --out $OUT --data /tmp/run/${DATA:-data-all} --work /tmp/run/${RUN:-run1} \
    --config $OUT/config.json --ks "" --pack-head ${INIT:+--init $INIT} --device $DEV
