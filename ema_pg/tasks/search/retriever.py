"""Retrieval: BM25 in-process (``bm25s``) or a Search-R1-style HTTP server.

Protocol (DESIGN.md): ``POST /retrieve`` with ``{"queries": [str], "topk": int, "return_scores": bool}``
returns ``{"result": [[{"document": {"contents": "title\\ntext"}, "score": float}, ...], ...]}``
(without scores each item is the document itself). ``serve()`` runs that protocol over a
local corpus, for tests and for a corpus too big to load in every worker.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import bm25s

logging.getLogger("bm25s").setLevel(logging.WARNING)  # an empty query is a policy action, not news


class BM25Retriever:
    def __init__(self, docs: list[tuple[str, str]]):
        self.contents = [f"{title}\n{text}" for title, text in docs]
        self.index = bm25s.BM25()
        self.index.index(bm25s.tokenize(self.contents, show_progress=False), show_progress=False)

    def retrieve(self, queries: list[str], topk: int = 3) -> list[list[dict]]:
        """Per query, the top-k documents as ``{"contents": "title\\ntext"}``."""
        k = min(topk, len(self.contents))
        idx, scores = self.index.retrieve(bm25s.tokenize(list(queries), show_progress=False), k=k, show_progress=False)
        return [[{"contents": self.contents[int(i)], "score": float(s)} for i, s in zip(row, srow)]
                for row, srow in zip(idx, scores)]


class HTTPRetriever:
    """Client of a Search-R1-style retrieval server."""

    def __init__(self, url: str, timeout: float = 30.0):
        self.url, self.timeout = url.rstrip("/"), timeout

    def retrieve(self, queries: list[str], topk: int = 3) -> list[list[dict]]:
        body = json.dumps({"queries": list(queries), "topk": topk, "return_scores": True}).encode()
        req = urllib.request.Request(f"{self.url}/retrieve", data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                res = json.loads(r.read())["result"]
        except OSError as e:
            raise ConnectionError(f"retrieval server {self.url} did not answer ({e}); start it or use "
                                  "task.retriever=bm25") from None
        return [[{"contents": (it["document"] if "document" in it else it)["contents"], "score": it.get("score")}
                 for it in row] for row in res]


def serve(retriever: BM25Retriever, host: str = "127.0.0.1", port: int = 0) -> tuple[ThreadingHTTPServer, str]:
    """Serve ``retriever`` on loopback in a daemon thread; returns (server, base url). ``server.shutdown()`` stops it."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            if self.path != "/retrieve":
                self.send_error(404)
                return
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            res = retriever.retrieve(req["queries"], int(req.get("topk", 3)))
            with_scores = bool(req.get("return_scores", False))
            out = [[{"document": {"contents": d["contents"]}, "score": d["score"]} if with_scores
                    else {"contents": d["contents"]} for d in row] for row in res]
            data = json.dumps({"result": out}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):  # quiet
            pass

    srv = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://{host}:{srv.server_address[1]}"
