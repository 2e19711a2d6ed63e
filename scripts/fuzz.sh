#!/usr/bin/env bash
# Runs a cargo-fuzz target for a bounded time (needs `cargo install cargo-fuzz`; the stable
# toolchain takes the sanitizer flags with RUSTC_BOOTSTRAP=1).
#
#   bash scripts/fuzz.sh                      # request_body for 300 s
#   bash scripts/fuzz.sh request_body 3600    # an hour
#   bash scripts/fuzz.sh gguf_parse 300
#
# request_body is seeded with every body the live-server suite sends (scripts/test-server.sh
# with PAGODA_FUZZ_SEEDS), each behind the selector byte the target reads: 0 chat, 1
# completions, 2 an Authorization header. gguf_parse is seeded with the test GGUF files.
# Crashes land in fuzz/artifacts/TARGET/; reproduce one with
# `RUSTC_BOOTSTRAP=1 cargo fuzz run TARGET FILE`, fix it, and keep it as a regression test.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
TARGET="${1:-request_body}"
SECONDS_TO_RUN="${2:-300}"
CORPUS="fuzz/corpus/$TARGET"
mkdir -p "$CORPUS"

if ! cargo fuzz --help >/dev/null 2>&1; then
    echo "fuzz: cargo-fuzz is missing; run: cargo install cargo-fuzz" >&2
    exit 1
fi

case "$TARGET" in
request_body)
    SEEDS="$(mktemp -d -t pagoda-fuzz-seeds.XXXXXX)"
    trap 'rm -rf "$SEEDS"' EXIT
    PAGODA_FUZZ_SEEDS="$SEEDS/raw" bash scripts/test-server.sh -q >/dev/null
    count=0
    for file in "$SEEDS"/raw/*; do
        case "$(basename "$file")" in
        v1_chat_completions-*) selector='\x00' ;;
        v1_completions-*) selector='\x01' ;;
        *) continue ;;
        esac
        { printf "$selector"; cat "$file"; } >"$CORPUS/seed-$(basename "$file")"
        count=$((count + 1))
    done
    for header in "Bearer fuzz-key" "bearer  fuzz-key " "Basic Zm9vOmJhcg==" "Bearer"; do
        printf '\x02%s' "$header" >"$CORPUS/seed-auth-$(echo "$header" | tr -c 'a-zA-Z0-9' _)"
    done
    echo "fuzz: $count request bodies from the live-server suite seed $CORPUS" >&2
    ;;
gguf_parse)
    cp crates/models/tests/data/gguf/*.gguf "$CORPUS/"
    ;;
esac

started=$(date +%s)
RUSTC_BOOTSTRAP=1 cargo fuzz run "$TARGET" "$CORPUS" -- \
    -max_total_time="$SECONDS_TO_RUN" -max_len=16384 -print_final_stats=1
echo "fuzz: $TARGET ran $(($(date +%s) - started)) s with no crash" >&2
