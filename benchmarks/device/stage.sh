# Call 1 (carry .dev/b1 .whl .dev/commit): the GGUF's first part and the prompts into /tmp/src.
. benchmarks/device/env.sh
cp .dev/b1/* /tmp/src/ && ls -la /tmp/src && python3 -c "import torch, transformers, gguf; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
