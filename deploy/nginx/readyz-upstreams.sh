#!/bin/sh
# Open-source nginx has no active health checks: it cannot ask the watchdog's /readyz by itself. This loop asks for it
# and writes the upstream block nginx includes, marking `down` every engine whose watchdog does not answer 200, and
# reloads nginx (gracefully: requests in flight finish on the old workers) when the block changed. A reload that
# fails leaves the previous block in place and is tried again on the next round.
#
#   readyz-upstreams.sh UPSTREAM_FILE UPSTREAM_NAME ENGINE_ADDR=READYZ_URL...
#   e.g. readyz-upstreams.sh /etc/nginx/vllm-upstream.conf vllm \
#          10.0.0.1:8000=http://10.0.0.1:9830/readyz 10.0.0.2:8000=http://10.0.0.2:9830/readyz
#
# INTERVAL (seconds between rounds, default 2) and RELOAD (default "nginx -s reload") come from the environment.
# A watchdog that does not answer within 2 s counts as not ready. Tested by tests/unit/test_nginx_readyz.py.
set -u
out=$1
name=$2
shift 2
interval=${INTERVAL:-2}
reload=${RELOAD:-nginx -s reload}
while :; do
  block="upstream $name {"
  for pair in "$@"; do
    engine=${pair%%=*}
    readyz=${pair#*=}
    if curl -fsS -m 2 -o /dev/null "$readyz" 2>/dev/null; then
      block="$block
    server $engine max_fails=0;"
    else
      block="$block
    server $engine down;"
    fi
  done
  block="$block
}"
  # The block stays in place only once nginx has reloaded with it: a failed reload puts the previous one back (or
  # removes a first one), so the next round sees a difference and tries again.
  if [ "$block" != "$(cat "$out" 2>/dev/null)" ] && printf '%s\n' "$block" > "$out.tmp"; then
    if [ -e "$out" ]; then cp -p "$out" "$out.prev"; else rm -f "$out.prev"; fi
    mv "$out.tmp" "$out"
    if $reload; then
      rm -f "$out.prev"
      echo "$(date +%s.%N) $block" | tr '\n' ' ' && echo
    else
      echo "$(date +%s.%N) reload failed ($reload): the previous block is back; trying again next round" >&2
      if [ -e "$out.prev" ]; then mv "$out.prev" "$out"; else rm -f "$out"; fi
    fi
  fi
  sleep "$interval"
done
