"""A stand-in vLLM front for footprint profiling: serves a real /metrics page (counters advancing per request),
/v1/models and /v1/completions, from its own process so its CPU is not the watcher's.

    .venv/bin/python bench/page_server.py PORT [PAGE] [--chunked]
"""

from __future__ import annotations

import json
import re
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PAGE = ROOT / "tests" / "data" / "metrics" / "vllm-0.32.0-tp2-under-load.txt"
PROM = "text/plain; version=0.0.4; charset=utf-8"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like uvicorn
    disable_nagle_algorithm = True
    server: PageServer

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _send(self, body: bytes, ctype: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        if self.server.chunked:  # as uvicorn answers a body sent whole: the head, then one chunk and the last
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        else:
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path.startswith("/metrics/?"):  # prometheus_client's app, as vLLM mounts it: honours name[]
            self.server.n += 1
            names = set(parse_qs(urlsplit(self.path).query).get("name[]", []))
            self._send(self.server.page(names), PROM)
        elif self.path.startswith("/metrics"):  # the instrumentator's route: the whole page, whatever the query
            self.server.n += 1
            self._send(self.server.page(), PROM)
        elif self.path.startswith("/v1/models"):
            self._send(json.dumps({"data": [{"id": "m"}]}).encode(), "application/json")
        else:
            self._send(b"{}", "application/json")

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length", "0"))
        self.rfile.read(n)
        self._send(json.dumps({"choices": [{"text": "x"}]}).encode(), "application/json")


class PageServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, page: Path, chunked: bool) -> None:
        super().__init__(("127.0.0.1", port), Handler)
        self.text = page.read_text()
        self.chunked = chunked
        self.n = 0
        self.filtered: dict[frozenset[str], str] = {}

    def page(self, names: set[str] | None = None) -> bytes:
        """The page, or with ``names`` only those samples with their HELP and TYPE (what prometheus_client's
        restricted registry answers). Generation tokens advance every request: an engine under load progressing."""
        text = self.text if names is None else self._only(names)
        return re.sub(r"(vllm:generation_tokens_total\{[^}]*\} )([0-9.e+]+)",
                      lambda m: f"{m.group(1)}{float(m.group(2)) + self.n:.1f}", text).encode()

    def _only(self, names: set[str]) -> str:
        kept = self.filtered.get(frozenset(names))
        if kept is None:
            families = {n.removesuffix(s) for n in names for s in ("_total", "_count", "")}
            kept = "".join(line + "\n" for line in self.text.splitlines()
                           if (line.split()[2] in families if line.startswith("# ") and len(line.split()) > 2
                               else re.split(r"[{ ]", line, maxsplit=1)[0] in names))
            self.filtered[frozenset(names)] = kept
        return kept


def main() -> None:
    port = int(sys.argv[1])
    page = Path(sys.argv[2]) if len(sys.argv) > 2 and not sys.argv[2].startswith("--") else DEFAULT_PAGE
    PageServer(port, page, "--chunked" in sys.argv).serve_forever()


if __name__ == "__main__":
    main()
