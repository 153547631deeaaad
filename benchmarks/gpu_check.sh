#!/usr/bin/env bash
# The GPU check (issue 17), one run of at most 9 minutes on one GPU, no network needed:
#   1. the test suite's device-marked tests (decode loop, EAGLE-3 draft verdicts, rejection
#      sampling, training steps) on CUDA, in bfloat16 and float32;
#   2. the engine benchmark on a random Llama-3.2-1B-shaped verifier in bfloat16: our plain
#      loop vs transformers.generate, step time vs context length, the EAGLE-3 draft step vs a
#      verifier step, eager vs compiled (CUDA graphs);
#   3. the training benchmark for a draft of that shape (bf16 TTT steps vs a bf16 matmul).
# Results: one JSON, $OUT/gpu-check.json (with each part's log beside it).
#
#   OUT=runs/gpu-check bash benchmarks/gpu_check.sh
#
# The machine needs python3 with torch (CUDA), transformers, pytest, numpy, safetensors,
# tqdm and pyyaml. Wheels under .whl/ (e.g. the transformers version pinned in
# requirements.lock) are installed to /tmp/site first, offline.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="src:tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name(0))" \
    || exit 2
t0=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider -m device tests/test_device.py \
    --junitxml "$OUT/device-tests.xml" > "$OUT/device-tests.log" 2>&1
tests_rc=$?
timeout 240 python3 benchmarks/lean_engine.py --verifier random-1b --device cuda --dtype bfloat16 --compile \
    --sections plain context draft --num-prompts 4 --max-new-tokens 128 --repeats 2 --contexts 128 512 1024 2048 \
    --draft-vocab 32000 --out "$OUT/lean-engine-cuda.json" > "$OUT/lean-engine.log" 2>&1
engine_rc=$?
timeout 90 python3 benchmarks/train.py --shape llama-1b --device cuda --precisions bf16 --draft-vocab-size 32000 \
    --pack-tokens 2048 --repeats 5 --out "$OUT/train-cuda.json" > "$OUT/train.log" 2>&1
train_rc=$?
python3 - "$OUT" "$tests_rc" "$engine_rc" "$train_rc" "$(( $(date +%s) - t0 ))" <<'PY'
import json, sys, pathlib, re
out, tests_rc, engine_rc, train_rc, seconds = pathlib.Path(sys.argv[1]), *map(int, sys.argv[2:])
def load(name):
    p = out / name
    return json.loads(p.read_text()) if p.is_file() else None
tests = (out / "device-tests.log").read_text().splitlines()
result = {"seconds": seconds,
          "device_tests": {"exit_code": tests_rc, "summary": next((l for l in reversed(tests) if re.search(r"passed|failed|error", l)), None)},
          "engine": {"exit_code": engine_rc, "results": load("lean-engine-cuda.json")},
          "train": {"exit_code": train_rc, "results": load("train-cuda.json")}}
(out / "gpu-check.json").write_text(json.dumps(result, indent=1) + "\n")
print(json.dumps({k: (v if k == "seconds" else {"exit_code": v["exit_code"]}) for k, v in result.items()}))
PY
exit $(( tests_rc || engine_rc || train_rc ))
