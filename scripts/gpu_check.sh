#!/usr/bin/env bash
# The prepared GPU check (issue 21), for a machine with an NVIDIA GPU and PyTorch CUDA
# (TensorRT and onnxruntime-gpu are not needed): at most 8 minutes, writes out/gpu/gpu.json.
#   1. the batched-tail scaling of SD 1.5's UNet architecture at N = 1, 8, 32 in PyTorch (fp16,
#      resident inputs, eager and one CUDA graph per N), scripts/gpu_bench.py;
#   2. where cuda-python is installed, the capture/replay path of runtime/cuda.py
#      (scripts/gpu_cuda_check.py), checked against numpy;
#   3. where onnxruntime-gpu reaches the GPU, edit-rt's available_backends() report;
#   4. where TensorRT is installed (pip install 'edit-rt[gpu]'), the real-engine tests: the
#      tests marked gpu (engines built from the test model, their tails against ONNX Runtime);
#   5. what one call of the committed text models costs on the GPU (issue 56: the bounds of
#      make bench-text's batch and tokens/s goals there), scripts/gpu_text_costs.py.
# Run from the repository root: bash scripts/gpu_check.sh   (PYTHON=... to pick the interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=out/gpu
mkdir -p "$OUT"
export PYTHONPATH="$PWD/.gpu-src${PYTHONPATH:+:$PYTHONPATH}"
# edit_rt.* without installing: the package maps edit_rt.export -> export/, edit_rt.runtime -> runtime/
mkdir -p .gpu-src/edit_rt && ln -sfn "$PWD/export" .gpu-src/edit_rt/export && ln -sfn "$PWD/runtime" .gpu-src/edit_rt/runtime
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/nvidia-smi.txt" 2>&1 || true
timeout 360 "$PYTHON" scripts/gpu_bench.py --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench exit $?" >> "$OUT/bench.log"
if "$PYTHON" -c "import cuda.bindings.runtime" 2>/dev/null || "$PYTHON" -c "from cuda import cudart" 2>/dev/null; then
  timeout 60 "$PYTHON" scripts/gpu_cuda_check.py > "$OUT/cuda.json" 2> "$OUT/cuda.log" || echo '{"passed": false}' > "$OUT/cuda.json"
else
  echo '{"skipped": "cuda-python is not installed"}' > "$OUT/cuda.json"
fi
timeout 60 "$PYTHON" -c "import json; from edit_rt.runtime.engine.backend import backend_report; print(json.dumps(backend_report()))" > "$OUT/backends.json" 2> "$OUT/backends.log" || echo '{}' > "$OUT/backends.json"
if "$PYTHON" -c "import tensorrt" 2>/dev/null; then
  timeout 300 "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider tests > "$OUT/trt.log" 2>&1
  echo "{\"exit\": $?}" > "$OUT/trt.json"
else
  echo '{"skipped": "TensorRT is not installed"}' > "$OUT/trt.json"
fi
timeout 90 "$PYTHON" scripts/gpu_text_costs.py --out "$OUT/text_costs.json" > "$OUT/text_costs.log" 2>&1 || echo '{}' > "$OUT/text_costs.json"
"$PYTHON" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / name).read_text())
    except Exception as err:  # a step that did not run says so
        return {"error": f"{name}: {err}"}
report = {"gpu": (out / "nvidia-smi.txt").read_text().strip(), "bench": load("bench.json"), "cuda": load("cuda.json"),
          "backends": load("backends.json"), "trt": load("trt.json"), "text_costs": load("text_costs.json")}
(out / "gpu.json").write_text(json.dumps(report, indent=2))
print(json.dumps({k: v for k, v in report.items() if k != "bench"}, indent=2))
for mode, rows in report["bench"].get("results", {}).items():
    for r in rows:
        print(f"{mode:11} N={r['n']:3d}: {r['edits_per_s']:8.2f} edits/s ({r['ms_per_row_step']:.2f} ms per row-step)")
PY
