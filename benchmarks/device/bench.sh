# Benchmarks the head of run RUN (/tmp/run/${RUN:-run1}/train/head, or HEAD) against our AR decode at
# batch 1 on the held-out prompts (PROMPTS, default /tmp/src/prompts-heldout.json; NUM, NEW tokens each), k in KS, compiled graphs; the first k
# compiles the engines (60 s each in the thirteenth session). Compiled steps specialise on every shape
# (--static-shapes: faster steps, one compilation per k) unless STATIC=0 (dynamic after the first change:
# better for a sweep over many k).
. benchmarks/device/env.sh
SHAPES=; [ "${STATIC:-1}" = 1 ] && SHAPES=--static-shapes
timeout ${LIMIT:-400} python3 benchmarks/gpu_session.py train-bench --out $OUT --head ${HEAD:-/tmp/run/${RUN:-run1}/train/head} \
    --passes ${PASSES:-compiled:eagle3} --ks ${KS:-5,6} --batches 1 --repeats ${REPEATS:-2} --prompts ${PROMPTS:-/tmp/src/prompts-heldout.json} \
    --num-prompts ${NUM:-10} --max-new-tokens ${NEW:-128} --device $DEV $SHAPES
