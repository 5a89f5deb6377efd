# Shared by the bench scripts that time `porter train` on a shared machine: waiting for an
# idle machine and counting the CPU time others use. Source it after setting idle_wait (the
# longest wait, seconds) and, optionally, idle_indent (the prefix of the line wait_idle prints).

# The machine is shared: wait (up to idle_wait seconds) until one second of /proc/stat shows
# the cores at least 90% idle, and print what the wait ended on.
wait_idle() {
  local deadline=$((SECONDS + idle_wait)) idle
  while :; do
    idle=$(
      # cpu user nice system idle iowait irq softirq steal ...
      read -r _ a b c d e f g h _ < /proc/stat
      sleep 1
      read -r _ A B C D E F G H _ < /proc/stat
      busy=$(((A - a) + (B - b) + (C - c) + (F - f) + (G - g) + (H - h)))
      idle=$(((D - d) + (E - e)))
      echo $((100 * idle / (busy + idle)))
    )
    if ((idle >= 90 || SECONDS >= deadline)); then
      echo "${idle_indent:-  }[idle ${idle}% over 1 s; load average $(cut -d' ' -f1-3 /proc/loadavg)]"
      return
    fi
  done
}

# The CPU ticks (1/100 s) all processes have used so far.
cpu_busy_ticks() {
  local _ a b c d e f g h
  read -r _ a b c d e f g h _ < /proc/stat
  echo $((a + b + c + f + g + h))
}
