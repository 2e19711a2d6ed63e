#!/usr/bin/env bash
# Runs the live-server tests (tests/server/) against `target/debug/pagoda serve` with the
# default model, using the official `openai` Python package.
#
#   bash scripts/test-server.sh            # all tests
#   bash scripts/test-server.sh -k stop    # extra arguments go to pytest
#
# Environment: PAGODA_BIN (default target/debug/pagoda; built with `cargo build -p pagoda-cli`
# when missing), PAGODA_TEST_VENV (default target/server-test-venv), PYTHON (default python3),
# PAGODA_WHEELS (install the Python clients offline from this folder of wheels),
# PAGODA_SERVE_ARGS (extra `pagoda serve` flags), PAGODA_SERVER_LOG (keep the server log here).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

MODEL="models/SmolLM2-135M-Instruct.Q4_1.gguf"
if [[ ! -f "$MODEL" ]]; then
    echo "test-server: $MODEL is missing; run scripts/fetch-model.sh first" >&2
    exit 1
fi

BIN="${PAGODA_BIN:-target/debug/pagoda}"
if [[ ! -x "$BIN" ]]; then
    echo "test-server: building pagoda-cli" >&2
    cargo build -p pagoda-cli
fi

VENV="${PAGODA_TEST_VENV:-target/server-test-venv}"
PYTHON="${PYTHON:-python3}"
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import openai, requests, pytest" 2>/dev/null; then
    if [[ -n "${PAGODA_WHEELS:-}" ]]; then
        # Offline machines (the GPU machine): wheels downloaded beforehand.
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-index \
            --find-links "$PAGODA_WHEELS" openai requests pytest
    else
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir openai requests pytest
    fi
fi

# A free port (bound then released).
PORT="$("$VENV/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')"
API_KEY="test-key-$$"
LOG="$(mktemp -t pagoda-serve.XXXXXX.log)"

# Small pool sizes keep the test fast; -np 8 lets eight clients run together.
# PAGODA_SERVE_ARGS adds flags (e.g. `--device cuda` on the GPU machine).
# shellcheck disable=SC2086
"$BIN" serve --port "$PORT" -c 1024 -np 8 --max-queue 16 --api-key "$API_KEY" \
    --max-body-bytes 1048576 ${PAGODA_SERVE_ARGS:-} >"$LOG" 2>&1 &
SERVER_PID=$!
cleanup() {
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
}
trap cleanup EXIT

for _ in $(seq 1 120); do
    if curl -fsS "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then
        break
    fi
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
        echo "test-server: the server exited during start-up:" >&2
        cat "$LOG" >&2
        exit 1
    fi
    sleep 0.5
done
if ! curl -fsS "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then
    echo "test-server: the server did not answer /health within 60 s:" >&2
    cat "$LOG" >&2
    exit 1
fi

status=0
PAGODA_URL="http://127.0.0.1:$PORT" PAGODA_API_KEY="$API_KEY" \
    "$VENV/bin/python" -m pytest -q tests/server "$@" || status=$?
if [[ $status -ne 0 ]]; then
    echo "test-server: failed; server log:" >&2
    tail -n 50 "$LOG" >&2
fi
if [[ -n "${PAGODA_SERVER_LOG:-}" ]]; then
    cp "$LOG" "$PAGODA_SERVER_LOG"
fi
rm -f "$LOG"
exit $status
