#!/usr/bin/env bash
# The README's run command. Installs dependencies, builds kvpool-server and kvpool into build/,
# starts kvpool-server --backend=auto in the background (its output in a log file, whose path is
# printed), waits until it says it listens (every port and socket open: a port held by another
# process makes it exit, and the demo is not run against that process), runs
# `kvpool demo` against it (extra arguments go to the demo; its decode steps go over the
# AttendSocket's Unix socket, in a shared-memory region), stops the server with SIGTERM and exits
# with the demo's status; SIGTERM or SIGINT to the script stops the demo and the server.
# KVPOOL_PORT / KVPOOL_METRICS_PORT / KVPOOL_ATTEND_SOCKET_PORT override the ports,
# KVPOOL_ATTEND_UNIX_SOCKET the Unix socket's path.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${KVPOOL_BUILD_DIR:-$root/build}
port=${KVPOOL_PORT:-50051}
metrics_port=${KVPOOL_METRICS_PORT:-9464}
attend_socket_port=${KVPOOL_ATTEND_SOCKET_PORT:-50052}
attend_unix_socket=${KVPOOL_ATTEND_UNIX_SOCKET:-${TMPDIR:-/tmp}/kvpool-attend-$$.sock}
log=${TMPDIR:-/tmp}/kvpool-server-$$.log

"$root/deploy/local/install_deps.sh"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build "$build" --target kvpool-server kvpool -j"$(nproc)"

"$build/kvpool-server" --backend=auto --port="$port" --metrics_port="$metrics_port" \
  --attend_socket_port="$attend_socket_port" --attend_unix_socket="$attend_unix_socket" \
  >"$log" 2>&1 &
server=$!
echo "kvpool-server log: $log"
stop_server() {
  kill -TERM "$server" 2>/dev/null || true
  wait "$server" 2>/dev/null || true
}
trap stop_server EXIT
# A signal ends the script through its EXIT trap, the server stopped.
trap 'exit 143' TERM
trap 'exit 130' INT

# Ready when its start-up line is logged; give up after 60 s or if the server exits.
deadline=$((SECONDS + 60))
until grep -q " listening: " "$log"; do
  kill -0 "$server" 2>/dev/null || {
    cat "$log" >&2
    echo "kvpool-server exited before serving" >&2
    exit 1
  }
  ((SECONDS < deadline)) || { echo "kvpool-server not serving after 60 s" >&2; exit 1; }
  sleep 0.2
done
grep " listening: " "$log"

status=0
# In the background, so that a signal to the script reaches the demo as well as the server.
"$build/kvpool" --target="127.0.0.1:$port" --attend_unix_socket="$attend_unix_socket" demo "$@" &
demo=$!
trap 'kill -TERM "$demo" 2>/dev/null; wait "$demo"; exit 143' TERM
trap 'kill -TERM "$demo" 2>/dev/null; wait "$demo"; exit 130' INT
wait "$demo" || status=$?
trap - EXIT TERM INT
stop_server
exit "$status"
