#!/usr/bin/env bash
# A throwaway PostgreSQL cluster on loopback, for the tests of the PostgreSQL
# journal: `cluster.sh start DIR` makes it in DIR (created, empty) and starts
# it, printing its URL (also written to DIR/url); `cluster.sh stop DIR` stops
# it. PostgreSQL refuses to run as root: as root it runs as nobody.
set -euo pipefail

cmd=${1:?usage: cluster.sh start|stop DIR}
dir=${2:?usage: cluster.sh start|stop DIR}
dir=$(realpath -m "$dir")

bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
if [ -z "$bin" ] || [ ! -x "$bin/initdb" ]; then
  echo "cluster.sh: no PostgreSQL server (Debian's postgresql package) is installed" >&2
  exit 1
fi

as_owner() {
  if [ "$(id -u)" = 0 ]; then
    # From a folder nobody may enter, PostgreSQL's tools complain.
    (cd / && setpriv --reuid=65534 --regid=65534 --clear-groups "$@")
  else
    "$@"
  fi
}

case "$cmd" in
start)
  mkdir -p "$dir"
  [ "$(id -u)" = 0 ] && chown 65534:65534 "$dir"
  as_owner "$bin/initdb" -D "$dir/data" -U arbor -A trust --no-sync -E UTF8 >"$dir/initdb.log" 2>&1 || {
    cat "$dir/initdb.log" >&2
    exit 1
  }
  # A free loopback port, asked of the kernel.
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
    -o "-c listen_addresses=127.0.0.1 -p $port -k $dir -c max_connections=300 -c fsync=on" start >/dev/null || {
    cat "$dir/server.log" >&2
    exit 1
  }
  as_owner "$bin/createdb" -h 127.0.0.1 -p "$port" -U arbor arbor
  url="postgres://arbor@127.0.0.1:$port/arbor"
  echo "$url" >"$dir/url"
  echo "$url"
  ;;
stop)
  [ -d "$dir/data" ] && as_owner "$bin/pg_ctl" -D "$dir/data" -m immediate -w stop >/dev/null
  ;;
*)
  echo "cluster.sh: unknown command $cmd (start or stop)" >&2
  exit 2
  ;;
esac
