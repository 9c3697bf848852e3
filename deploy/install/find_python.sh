# Sourced by scripts/install and scripts/uninstall: check_python NAME succeeds when NAME runs CPython >= 3.11, and
# otherwise says on stderr what it found (and any python3.1x on PATH that would do).
check_python() {
  if ! command -v "$1" >/dev/null 2>&1; then
    echo "scripts/$(basename "$0"): no $1 here: it needs CPython >= 3.11 (python3, or --python PATH)" >&2
    return 1
  fi
  found=$("$1" -c 'import sys; print("%s %d.%d.%d %d" % ((sys.implementation.name,) + tuple(sys.version_info[:3]) + (sys.version_info >= (3, 11),)))' 2>/dev/null)
  case $found in
    "cpython "*" 1") return 0 ;;
    "") found="a program that does not run as python" ;;
    *) found="${found% *}" ;;
  esac
  better=
  for other in python3.14 python3.13 python3.12 python3.11; do
    if command -v "$other" >/dev/null 2>&1; then better="; $(command -v "$other") would: --python $(command -v "$other")"; break; fi
  done
  echo "scripts/$(basename "$0"): needs CPython >= 3.11, and $(command -v "$1") is $found$better" >&2
  return 1
}
