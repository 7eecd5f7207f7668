# Regenerates the first exchanges (and the later ones, when unpacked) with the target; the data
# comes back as $OUT/data.tgz.NN (and $OUT/later/data-all.tgz.NN, merged), so that a released
# machine loses nothing (restore.sh puts it back). REGEN_BATCH: requests per engine batch (128).
. benchmarks/device/env.sh
python3 benchmarks/gpu_session.py data --out $OUT --dataset /tmp/src/first-exchanges.json \
    --conversations ${FIRST:-11000} --data-out /tmp/run/data --pack --device $DEV \
    --regen-batch ${REGEN_BATCH:-128} || exit 1
if [ -f /tmp/src/later-exchanges.json ]; then
    mkdir -p $OUT/later
    python3 benchmarks/gpu_session.py data --out $OUT/later --dataset /tmp/src/later-exchanges.json \
        --conversations ${LATER:-12000} --data-out /tmp/run/data2 --merge-base /tmp/run/data \
        --merged /tmp/run/data-all --pack --device $DEV --regen-batch ${REGEN_BATCH:-128} || exit 1
fi
