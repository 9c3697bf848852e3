#!/bin/sh
# Open-source nginx has no active health checks: it cannot ask the watchdog's /readyz by itself. This loop asks for it
# and writes the upstream block nginx includes, marking `down` every engine whose watchdog does not answer 200, and
# reloads nginx (gracefully: requests in flight finish on the old workers) when the block changed.
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
  if [ "$block" != "$(cat "$out" 2>/dev/null)" ]; then
    printf '%s\n' "$block" > "$out.tmp" && mv "$out.tmp" "$out" && $reload && echo "$(date +%s.%N) $block" | tr '\n' ' ' && echo
  fi
  sleep "$interval"
done
