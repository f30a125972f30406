#!/usr/bin/env bash
# Run HERE (no GPU, with PyPI), from the repo root, before `bash benchmarks/gpu/run.sh` goes to the GPU machine.
# It fills two git-ignored folders that the device call must name in `carry`:
#   .whl/     wheels (Python 3.12, manylinux x86_64) of the peers and their needs missing on the GPU machine
#   .devdata/ what the run reads from ../shared (which does not travel)
# Idempotent: existing files are kept. Never downloads torch or nvidia-* (the GPU machine has its own).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PY=${PY:-/work/main/.venv/bin/python}
SHARED=${SHARED:-$(cd .. && pwd)/shared}
[ -d "$SHARED/data" ] || SHARED=/work/shared

# (a) keep both folders out of git (info/exclude is shared by every worktree of the repo)
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for d in /.whl/ /.devdata/; do
  grep -qxF "$d" "$exclude" 2>/dev/null || echo "$d" >> "$exclude"
done

# (b) wheels. Versions: trl and lhotse as padfree's bench extra pins them; the others as installed in the
# project's venv (so the GPU run sees what the CPU runs saw). Needs of these four that the GPU image lacks
# (its list: /work/.library/device/KINDS.md): dill + multiprocess (datasets), audioread, soundfile (+ cffi,
# pycparser), cytoolz, intervaltree (lhotse). pyarrow, pandas, fsspec, xxhash, huggingface-hub, accelerate,
# requests, click, tabulate, toolz, sortedcontainers, jinja2, psutil are in the image already.
ver() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
mkdir -p .whl
want=(
  "trl==1.16.0"
  "lhotse==1.33.0"
  "datasets==$(ver datasets)"
  "torchdata==$(ver torchdata)"
  "dill==$(ver dill)"
  "multiprocess==$(ver multiprocess)"
  "audioread==$(ver audioread)"
  "soundfile==$(ver soundfile)"
  "cffi==$(ver cffi)"
  "pycparser==$(ver pycparser)"
  "cytoolz==$(ver cytoolz)"
  "intervaltree==$(ver intervaltree)"
)
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64)
for spec in "${want[@]}"; do
  name=${spec%%==*}; v=${spec#*==}
  norm=$(echo "$name" | tr '[:upper:]-' '[:lower:]_')
  if ls .whl 2>/dev/null | tr '[:upper:]' '[:lower:]' | grep -q "^${norm}-${v}-"; then continue; fi
  "$PY" -m pip download -q --no-deps "${plat[@]}" -d .whl "$spec"
done
# flash-linear-attention (pure Python + Triton): the gated delta-net kernel the family sweep checks on the GPU
ls .whl | grep -qi '^flash_linear_attention-' || "$PY" -m pip download -q --no-deps "${plat[@]}" -d .whl \
  flash-linear-attention fla-core || echo "prepare.sh: no flash-linear-attention wheel (the sweep goes per document)"
if ls .whl | grep -iE '^(torch-|nvidia)'; then echo "prepare.sh: torch/nvidia wheel in .whl: remove it" >&2; exit 1; fi
# one version per package (two stop the whole install there)
dups=$(ls .whl/*.whl | xargs -n1 basename | cut -d- -f1 | tr '[:upper:]' '[:lower:]' | sort | uniq -d)
if [ -n "$dups" ]; then echo "prepare.sh: several versions of: $dups (clean .whl and rerun)" >&2; exit 1; fi

# (c) data from ../shared that the run reads
mkdir -p .devdata/samples
cp -u "$SHARED/data/lengths/seed_mix.mistral_v1.npy" .devdata/
cp -u "$SHARED/tokenizers/llama_sp32k.model" .devdata/
for f in gpteacher_codegen hh_rlhf_harmless_test llamafactory_c4_wiki_docs; do
  cp -u "$SHARED/data/samples/$f.jsonl.gz" .devdata/samples/
done

du -sh .whl .devdata
echo "travels besides the repo: .whl .devdata (carry both)"
