#!/usr/bin/env bash
# The GPU checks of issue 18, in one run (~10 minutes on one H200; nothing here was run
# yet: no GPU was at hand when this was written).
#
# The GPU machine has PyTorch (with Triton) and transformers, no network and not our web
# stack. The engine needs none of the server's packages (it imports torch, transformers,
# safetensors, numpy, tqdm; gguf only for .gguf models, xgrammar only for
# response_format, redis only for a Redis tier). Bring as wheels what the GPU machine
# lacks: pytest with iniconfig and pluggy. Install them with
#   pip install --no-index --find-links WHEELS_DIR pytest
#
# Before, on a machine with the default model: save its tokenizer (about 3 MB):
#   python bench/gpu_check.py tokenizer bench/results/tokenizer
# then on the GPU machine, from the repository root:
#   bash bench/gpu_check.sh bench/results/tokenizer
set -uo pipefail
TOK=${1:?usage: bench/gpu_check.sh TOKENIZER_DIR}
cd "$(dirname "$0")/.."
mkdir -p bench/results
export PARLEY_TEST_TOKENIZER=$TOK
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

echo "== 1. the engine suites on CUDA (tests/gpu), ~3 min"
timeout 300 python -m pytest -p no:cacheprovider -q -x tests/gpu -rs || status=1

echo "== 2. logits and greedy tokens against transformers, bf16, ~1 min"
timeout 180 python bench/gpu_check.py logits --tokenizer "$TOK" \
  | tee bench/results/gpu_logits.json || status=1

echo "== 3. throughput against HF generate: 1 and 256 requests, ~4 min"
timeout 300 python bench/gpu_check.py throughput --tokenizer "$TOK" \
  | tee bench/results/gpu_throughput.json || status=1
exit $status
