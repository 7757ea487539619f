# The guest side of the restart loop (crates/sqcow2-cli/tests/guest_restart.rs), sourced by
# the guest kit's init (busybox sh) and run when the kernel command line
# says `sqcow2.loop=WORKERS,AREA,BLOCKS`.
#
# Worker w owns AREA 4 KiB blocks of /dev/vda from (w-1)*AREA. In each
# round it writes BLOCKS blocks at a random place of its area with
# O_DIRECT (odd rounds then fsync: a FLUSH request), reads them back with
# O_DIRECT and compares. Each completed round is one console line,
#   SQCOW2-GUEST-W worker round first_block blocks synced write_cs read_cs
# (the times in 1/100 s, from /proc/uptime), each failure a
# SQCOW2-GUEST-ERR line. The loops stop when a line arrives on the
# console; then the kernel log is searched for block I/O errors.

uptime_cs() {
  read -r up _ < /proc/uptime
  frac=${up#*.}
  frac=${frac#0}
  echo $((${up%.*} * 100 + frac))
}

# Blocks FIRST.. (N of them) as worker W writes them in round R: each
# 4 KiB block repeats a line naming all three (the test computes the same).
loop_pattern() {
  awk -v w="$1" -v r="$2" -v first="$3" -v n="$4" 'BEGIN {
    for (b = first; b < first + n; b++) {
      s = sprintf("sqcow2 w%d r%07d b%09d\n", w, r, b)
      l = s
      while (length(l) < 4096) l = l s
      printf "%s", substr(l, 1, 4096)
    }
  }'
}

loop_worker() {
  w=$1
  area=$2
  nb=$3
  base=$(((w - 1) * area))
  RANDOM=$((w * 7919 + $(uptime_cs)))
  r=0
  errors=0
  while [ ! -e /tmp/stop ]; do
    r=$((r + 1))
    first=$((base + RANDOM % (area - nb + 1)))
    loop_pattern "$w" "$r" "$first" "$nb" > /tmp/w$w.pat
    if [ $((r % 2)) -eq 1 ]; then
      conv=notrunc,fsync
      synced=1
    else
      conv=notrunc
      synced=0
    fi
    t0=$(uptime_cs)
    if ! dd if=/tmp/w$w.pat of=/dev/vda bs=4096 seek=$first oflag=direct conv=$conv 2> /tmp/w$w.err; then
      echo "SQCOW2-GUEST-ERR w$w r$r write $first+$nb: $(tr '\n' ' ' < /tmp/w$w.err)"
      errors=$((errors + 1))
      continue
    fi
    t1=$(uptime_cs)
    if ! dd if=/dev/vda of=/tmp/w$w.back bs=4096 skip=$first count=$nb iflag=direct 2> /tmp/w$w.err; then
      echo "SQCOW2-GUEST-ERR w$w r$r read $first+$nb: $(tr '\n' ' ' < /tmp/w$w.err)"
      errors=$((errors + 1))
    elif ! cmp -s /tmp/w$w.pat /tmp/w$w.back; then
      echo "SQCOW2-GUEST-ERR w$w r$r verify $first+$nb: $(cmp /tmp/w$w.pat /tmp/w$w.back 2>&1 | head -1)"
      errors=$((errors + 1))
    fi
    t2=$(uptime_cs)
    echo "SQCOW2-GUEST-W $w $r $first $nb $synced $((t1 - t0)) $((t2 - t1))"
  done
  echo "SQCOW2-GUEST-WORKER $w rounds=$r errors=$errors"
}

loop_main() {
  workers=$1
  area=$2
  nb=$3
  echo "SQCOW2-GUEST-LOOP-START"
  i=1
  while [ $i -le "$workers" ]; do
    loop_worker $i "$area" "$nb" &
    i=$((i + 1))
  done
  # Any line on the console (the test writes one) stops the loops.
  read -r _line
  touch /tmp/stop
  wait
  pattern='i/o error|blk_update_request|buffer i/o|virtio_blk.*error'
  echo "SQCOW2-GUEST-KERNEL-IO-ERRORS $(dmesg | grep -ciE "$pattern")"
  dmesg | grep -iE "$pattern" | head -20 | sed 's/^/SQCOW2-GUEST-KMSG /'
}
