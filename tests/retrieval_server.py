"""A retrieval server for tests: Search-R1's ``POST /retrieve`` protocol (``search_r1/search/retrieval_server.py``:
``{"queries", "topk", "return_scores"}`` in, ``{"result": [[{"document": {"id", "contents"}, "score"}, ...]]}`` out)
over a few documents by word overlap, with fault modes: ``500``, ``nonjson``, ``noresult``, ``slow`` (answers
after ``delay`` seconds), ``trickle`` (its answer one byte every ``delay`` seconds), ``cut`` (closes the connection
halfway through its answer), ``fail_after`` (healthy for ``n`` requests, then 500 for good). Loopback only."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FaultServer:
    def __init__(self, docs: list[dict], mode: str = "ok", delay: float = 0.0, n: int = 0):
        self.docs, self.mode, self.delay, self.n = docs, mode, delay, n
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                if self.path != "/retrieve":  # Search-R1's FastAPI app has this one route
                    self.send_error(404)
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                mode = server.mode
                if mode == "fail_after":
                    mode = "ok" if len(server.requests) <= server.n else "500"
                if mode == "slow":
                    time.sleep(server.delay)
                if mode == "500":
                    self._send(500, b"Internal Server Error", "text/plain")
                elif mode == "nonjson":
                    self._send(200, b"<html>gateway page</html>", "text/html")
                elif mode == "noresult":
                    self._send(200, json.dumps({"detail": "Not Found"}).encode(), "application/json")
                else:
                    data = json.dumps({"result": [server.search(q, body["topk"], body.get("return_scores"))
                                                  for q in body["queries"]]}).encode()
                    if mode in ("trickle", "cut"):
                        self.send_response(200)
                        self.send_header("Content-Type", "application/json")
                        self.send_header("Content-Length", str(len(data)))
                        self.end_headers()
                        if mode == "cut":
                            self.wfile.write(data[: len(data) // 2])
                            self.wfile.flush()
                            self.close_connection = True
                            return
                        for i in range(len(data)):
                            try:
                                self.wfile.write(data[i:i + 1])
                                self.wfile.flush()
                            except OSError:  # the client gave up
                                return
                            time.sleep(server.delay)
                    else:
                        self._send(200, data, "application/json")

            def _send(self, code, data, ctype):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}/retrieve"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def search(self, query: str, topk: int, scores: bool) -> list:
        words = set(query.lower().split())
        ranked = sorted(self.docs, key=lambda d: -len(words & set(d["contents"].lower().split())))[:topk]
        return [{"document": d, "score": float(len(words & set(d["contents"].lower().split())))} if scores else d
                for d in ranked]

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()
