# Sourced by scripts/ensure_*.sh. `ensure_tools WHAT "COMMANDS" "PACKAGES"` returns 0 when every
# command is on PATH, or after installing the packages with apt-get when we are root on
# Debian/Ubuntu; non-zero otherwise, for the caller to say where to get them.
ensure_tools() {
  local what=$1 commands=$2 packages=$3 tool
  local missing=0
  for tool in $commands; do
    command -v "$tool" >/dev/null 2>&1 || missing=1
  done
  if [ "$missing" = 0 ]; then
    return 0
  fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "hyparflow: installing $what ($packages) with apt-get" >&2
    # shellcheck disable=SC2086  # one word a package
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $packages >/dev/null
    return  # apt-get's status (a caller's `if` suspends set -e): a failure says where to get them
  fi
  return 1
}
