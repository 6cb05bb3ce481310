#!/usr/bin/env bash
# The kvpool CLI refuses flags it cannot honour before it connects or takes a lease: exit status
# 2 and a message naming the flag (no server is running; a check that passed would fail to
# connect instead, with status 1); --help lists its flags.
# usage: cli_flags_test.sh <kvpool CLI binary>
set -uo pipefail
cli_bin=${1:?kvpool CLI binary}
status=0
# expect_refused <message part> <flags...>
expect_refused() {
  local want=$1
  shift
  local out rc
  out=$("$cli_bin" --target=127.0.0.1:1 --wait_for_ready=false "$@" stats 2>&1)
  rc=$?
  if [[ $rc -ne 2 || $out != *"$want"* ]]; then
    echo "FAIL: kvpool $* stats: exit $rc, output: $out" >&2
    status=1
  fi
}
expect_refused "--q_heads_per_kv_head" --q_heads_per_kv_head=0
expect_refused "--session_deadline_ms" --session_deadline_ms=0
expect_refused "--session_deadline_ms" --session_deadline_ms=-1
expect_refused "--deadline_ms" --deadline_ms=0
# --help lists the CLI's own flags (the usage text names some, but not as "--flag (help)").
help=$("$cli_bin" --help 2>&1)
if [[ $help != *"--deadline_ms ("* || $help != *"--decode_steps ("* ]]; then
  echo "FAIL: kvpool --help does not list --deadline_ms" >&2
  status=1
fi
# Valid flags get as far as the connection, which fails (nothing listens on port 1).
out=$("$cli_bin" --target=127.0.0.1:1 --wait_for_ready=false --deadline_ms=2000 stats 2>&1)
rc=$?
if [[ $rc -ne 1 ]]; then
  echo "FAIL: kvpool stats against no server: exit $rc (want 1), output: $out" >&2
  status=1
fi
[[ $status -eq 0 ]] && echo "PASS"
exit "$status"
