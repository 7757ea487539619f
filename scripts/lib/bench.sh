# Helpers the benchmark scripts share (sourced).

# wait_socket PATH: waits (up to 60 s) for a server's socket to appear.
wait_socket() {
  for _ in $(seq 1200); do [ -S "$1" ] && return 0; sleep 0.05; done
  echo "no socket $1" >&2; return 1
}

# drop_cache DIR [all]: the page cache of every .qcow2 image in DIR
# dropped (written back first); with `all`, of every file in DIR (index
# and other side files too).
drop_cache() {
  python3 - "$1" "${2:-}" <<'PY'
import os, sys
for name in os.listdir(sys.argv[1]):
    path = os.path.join(sys.argv[1], name)
    if os.path.isfile(path) and (sys.argv[2] == "all" or name.endswith(".qcow2")):
        fd = os.open(os.path.join(sys.argv[1], name), os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
PY
}
