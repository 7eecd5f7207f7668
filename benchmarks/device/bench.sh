# Benchmarks the head of run RUN (/tmp/run/${RUN:-run1}/train/head, or HEAD) against our AR decode at
# batch 1 on the held-out prompts (NUM, NEW tokens each), k in KS, compiled graphs; the first k
# compiles the engines (more than 170 s in the eleventh session: keep LIMIT at 400); STATIC=1: compiled steps
# specialise on every shape (--static-shapes).
. benchmarks/device/env.sh
timeout ${LIMIT:-400} python3 benchmarks/gpu_session.py train-bench --out $OUT --head ${HEAD:-/tmp/run/${RUN:-run1}/train/head} \
    --passes ${PASSES:-compiled:eagle3} --ks ${KS:-5,6} --batches 1 --repeats ${REPEATS:-2} --prompts /tmp/src/prompts-heldout.json \
    --num-prompts ${NUM:-10} --max-new-tokens ${NEW:-128} --device $DEV ${STATIC:+--static-shapes}
