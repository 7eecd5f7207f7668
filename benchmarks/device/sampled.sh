# After restore.sh (carry .dev/b3 .dev/commit): the first exchanges again, every reply sampled by the
# target at TEMP (0.7; no top-k or top-p), the conversations of /tmp/run/$BASE's eval split left out
# and every new example in train; merged after /tmp/run/${BASE:-data-all3} (deeper.sh's second part)
# into /tmp/run/${MERGED:-data-all4} (DATA=$MERGED for train.sh); back as $OUT/$MERGED.tgz.NN.
. benchmarks/device/env.sh
BASE=${BASE:-data-all3} TEMP=${TEMP:-0.7}
[ -d /tmp/run/$BASE ] || { echo "no /tmp/run/$BASE to merge after: run restore.sh (carry .dev/r) first"; exit 3; }
gunzip -c .dev/b3/first-exchanges.json.gz > /tmp/src/first-exchanges.json || exit 1
python3 benchmarks/gpu_session.py data --out $OUT --dataset /tmp/src/first-exchanges.json \
    --conversations ${FIRST:-11000} --data-out /tmp/run/data-t$TEMP --merge-base /tmp/run/$BASE \
    --merged /tmp/run/${MERGED:-data-all4} --pack --device $DEV --regen-batch ${REGEN_BATCH:-128} \
    --regen-temperature $TEMP --eval-fraction 0 --skip-base-eval
