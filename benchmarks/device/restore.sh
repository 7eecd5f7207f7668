# After a released machine, once stage.sh and model.sh ran again (carry .dev/r): what earlier calls
# sent back, put back in place: the parts of each .dev/r/<name>.tgz.NN (data folders) into /tmp/run,
# .dev/r/head.tar.* into /tmp/run/${RUN:-run1}/train (the head bench.sh and INIT use).
. benchmarks/device/env.sh
for first in .dev/r/*.tgz.00; do [ -f "$first" ] && cat "${first%.00}".* | tar xz -C /tmp/run; done
if ls .dev/r/head.tar.* >/dev/null 2>&1; then
    mkdir -p /tmp/run/${RUN:-run1}/train && cat .dev/r/head.tar.* | tar x -C /tmp/run/${RUN:-run1}/train
fi
ls /tmp/run; ls /tmp/run/${RUN:-run1}/train 2>/dev/null; true  # no head restored is not a failure
