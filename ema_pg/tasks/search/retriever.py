"""Retrieval: BM25 in-process (``bm25s``) or a Search-R1 retrieval server over HTTP.

Protocol (Search-R1's ``search_r1/search/retrieval_server.py``): ``POST <url>`` (its route is
``/retrieve``) with ``{"queries": [str], "topk": int, "return_scores": bool}`` returns
``{"result": [[{"document": {"id", "contents": "\\"Title\\"\\ntext"}, "score": float}, ...], ...]}``,
one list per query (without scores each item is the document itself). Users write the full URL,
``http://127.0.0.1:8000/retrieve``; the bare ``http://127.0.0.1:8000`` is accepted too.

:class:`HTTPRetriever` sends one request per call (the environment calls it once per turn with
every row that searched), with a timeout, retries with exponential backoff (``requests`` and
urllib3's ``Retry``: connection errors, read time-outs, HTTP 500/502/503/504), and one line naming
the URL and what came back when it still fails (:class:`RetrieverError`). ``check()`` is the
start-up health check: one query before any model is built.

``serve()`` runs the same protocol over a local corpus in a thread (tests, small corpora);
``python -m ema_pg.tasks.search.serve --corpus corpus.jsonl --port 8000`` serves a corpus in
Search-R1's format (JSON lines with ``contents``: ``"Title"\\ntext``) with BM25.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from ..base import ServiceError

logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)  # each retry's warning: the final error says it
ROUTE = "/retrieve"  #: the server's route (Search-R1's retrieval_server.py)
BACKOFF_S = 0.5  #: urllib3's backoff factor: waits of 0.5, 1, 2, ... s between tries


class RetrieverError(ServiceError):
    """The retrieval server failed (down, too slow, an HTTP error, an answer that is not the protocol's)."""


def bm25s_module():
    """``bm25s``, imported on first use with JAX hidden from it. Where JAX is installed, bm25s's import warms up a
    JAX top-k (``bm25s/selection.py``); that starts JAX's GPU backend, which takes 75% of the GPU's memory for
    itself (XLA's preallocation), and a training run in the same process is left a quarter (found on an H200: the
    math recipe at 1.5B ran out of memory with 25 GiB allocated by PyTorch). Without JAX bm25s picks its top-k
    with numpy, as it does wherever JAX is not installed. A process that imported JAX itself keeps it."""
    if "bm25s" in sys.modules:
        return sys.modules["bm25s"]
    hide = "jax" not in sys.modules
    if hide:
        sys.modules["jax"] = None  # `import jax.lax` raises ImportError, which bm25s takes as "not installed"
    try:
        import bm25s
    finally:
        if hide:
            del sys.modules["jax"]
    logging.getLogger("bm25s").setLevel(logging.WARNING)  # its import sets DEBUG: a line per index built, one per
    # empty query (a policy action, not news); its warnings and errors still pass
    return bm25s


SCORE_DECIMALS = 4  #: BM25 scores are ranked at this many decimals: past float32 noise (about 1e-6 at their size)


def rank(scores, k: int) -> tuple[list[int], np.ndarray]:
    """(the indices of the ``k`` best ``scores``, the scores rounded to SCORE_DECIMALS): highest first, a tie
    broken by the lower index. bm25s's own top-k (``np.argpartition``) orders tied documents by whichever sort
    kernel numpy dispatches (AVX-512 and AVX2 order them differently), and its float32 sums can differ in the last
    bit between kernels; both made the search world's demonstrations differ between CPUs."""
    rounded = np.round(np.asarray(scores, dtype=np.float64), SCORE_DECIMALS)
    order = np.lexsort((np.arange(len(rounded)), -rounded))[:k]
    return [int(i) for i in order], rounded


class BM25Retriever:
    def __init__(self, docs: list[tuple[str, str]]):
        self.bm25s = bm25s_module()
        self.contents = [f"{title}\n{text}" for title, text in docs]
        self.index = self.bm25s.BM25()
        self.index.index(self.bm25s.tokenize(self.contents, show_progress=False), show_progress=False)

    def retrieve(self, queries: list[str], topk: int = 3) -> list[list[dict]]:
        """Per query, the top-k documents as ``{"contents": "title\\ntext", "score": float}``, the same on every
        CPU: :func:`rank` orders them."""
        if not queries:
            return []
        k = min(topk, len(self.contents))
        out = []
        for tokens in self.bm25s.tokenize(list(queries), show_progress=False, return_ids=False):
            scores = self.index.get_scores(tokens) if tokens else np.zeros(len(self.contents))
            order, rounded = rank(scores, k)
            out.append([{"contents": self.contents[i], "score": float(rounded[i])} for i in order])
        return out

    def check(self) -> None:
        pass


def retrieve_url(url: str) -> str:
    """The URL to post to: ``url`` as given when its path ends with ``/retrieve``, else ``url`` + ``/retrieve``."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"task.retriever_url={url!r} is not an http(s) URL; write it as Search-R1 users do: "
                         "http://127.0.0.1:8000/retrieve")
    path = parts.path.rstrip("/")
    if not path.endswith(ROUTE):
        path += ROUTE
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


class HTTPRetriever:
    """Client of a Search-R1 retrieval server (see the module docstring)."""

    def __init__(self, url: str, timeout: float = 30.0, retries: int = 3):
        import requests
        from requests.adapters import HTTPAdapter
        from urllib3.util.retry import Retry

        if timeout <= 0 or retries < 0:
            raise ValueError(f"task.retriever_timeout must be > 0 s and task.retriever_retries >= 0; got {timeout}, {retries}")
        self.url, self.timeout, self.retries = retrieve_url(url), float(timeout), int(retries)
        retry = Retry(total=retries, connect=retries, read=retries, status=retries, other=0, backoff_factor=BACKOFF_S,
                      status_forcelist=(500, 502, 503, 504), allowed_methods=None, raise_on_status=False)
        self.session = requests.Session()
        self.session.mount("http://", HTTPAdapter(max_retries=retry))
        self.session.mount("https://", HTTPAdapter(max_retries=retry))
        self.requests = 0  #: requests sent (one per call with queries)

    def _fail(self, what: str, fix: str = "", retried: bool = False) -> RetrieverError:
        """The one line of a failure; ``retried``: the failure is one urllib3 retries (no connection, a time-out,
        an HTTP 5xx), so the server was asked retries + 1 times; any other answer was one request."""
        tries = f" ({self.retries + 1} tries)" if self.retries and retried else ""
        return RetrieverError(f"retrieval server {self.url} {what}{tries}{'; ' + fix if fix else ''}")

    @property
    def deadline_s(self) -> float:
        """The most a call may take, retries and their back-off included: task.retriever_timeout for each try's
        whole answer (requests' own time-out bounds only the gap between bytes)."""
        return self.timeout * (self.retries + 1) + sum(BACKOFF_S * 2 ** i for i in range(self.retries))

    def _post(self, body: dict):
        """The POST with its body read whole, inside the deadline: a server that trickles its answer is cut off."""
        import time

        start = time.monotonic()
        with self.session.post(self.url, json=body, timeout=self.timeout, stream=True) as r:
            chunks = []
            while chunk := r.raw.read1(1 << 16, decode_content=True):  # whatever has arrived, as it arrives
                chunks.append(chunk)
                if time.monotonic() - start > self.deadline_s:
                    raise _Deadline()
            r._content = b"".join(chunks)  # what .text and .json() read
            return r

    def retrieve(self, queries: list[str], topk: int = 3) -> list[list[dict]]:
        import requests
        import urllib3

        if not queries:
            return []
        body = {"queries": list(queries), "topk": int(topk), "return_scores": True}
        self.requests += 1
        try:
            r = self._post(body)
        except _Deadline:
            raise self._fail(f"did not finish its answer within {self.deadline_s:g} s (task.retriever_timeout="
                             f"{self.timeout:g} s a try)", "raise task.retriever_timeout or check the server") from None
        except requests.exceptions.RetryError as e:  # the HTTP-status retries ran out
            raise self._fail(f"kept answering an HTTP error ({_reason(e)})", retried=True) from None
        except (requests.exceptions.Timeout, requests.exceptions.ConnectionError) as e:
            if isinstance(e, requests.exceptions.Timeout) or _reason(e) == "timed out":  # read time-outs, retried
                raise self._fail(f"did not answer within task.retriever_timeout={self.timeout:g} s",
                                 "raise task.retriever_timeout or check the server", retried=True) from None
            raise self._fail(f"did not answer ({_reason(e)})", "start it, or fix task.retriever_url",
                             retried=True) from None
        except urllib3.exceptions.ReadTimeoutError:  # a gap in the body longer than the time-out
            raise self._fail(f"did not answer within task.retriever_timeout={self.timeout:g} s",
                             "raise task.retriever_timeout or check the server") from None
        except (requests.exceptions.RequestException, urllib3.exceptions.HTTPError) as e:  # the answer broke off
            raise self._fail(f"broke off its answer ({type(e).__name__}: {_reason(e)})", "check the server") from None
        if r.status_code != 200:
            raise self._fail(f"answered HTTP {r.status_code}: {_snippet(r.text)}") from None
        try:
            data = r.json()
        except ValueError:
            raise self._fail(f"answered something that is not JSON: {_snippet(r.text)}") from None
        res = data.get("result") if isinstance(data, dict) else None
        if not isinstance(res, list) or len(res) != len(queries):
            got = f"keys {sorted(data)}" if isinstance(data, dict) else type(data).__name__
            raise self._fail(f"answered JSON without a 'result' list of {len(queries)} (got {got})",
                             "is it a Search-R1 retrieval server?") from None
        try:
            return [[{"contents": (it["document"] if "document" in it else it)["contents"], "score": it.get("score")}
                     for it in row] for row in res]
        except (TypeError, KeyError, AttributeError):
            raise self._fail(f"answered result items without document.contents: {_snippet(json.dumps(res))}") from None

    def check(self) -> None:
        """One query before anything expensive: raises :class:`RetrieverError` naming the URL if it fails."""
        try:
            self.retrieve(["health check"], 1)
        except RetrieverError as e:
            raise RetrieverError(f"start-up check: {e}") from None


class _Deadline(Exception):
    """A call ran past :attr:`HTTPRetriever.deadline_s`."""


def _reason(e: Exception) -> str:
    """The innermost reason of a requests error, in a few words (connection refused, name not resolved, ...)."""
    text = str(e)
    for key in ("Connection refused", "Name or service not known", "No route to host", "too many 500 error responses",
                "too many 502 error responses", "too many 503 error responses", "too many 504 error responses",
                "timed out"):
        if key in text:
            return key.lower()
    return text.split(":")[-1].strip(" )'\"")[:120] or type(e).__name__


def _snippet(text: str, n: int = 120) -> str:
    text = " ".join(text.split())
    return repr(text[:n] + ("..." if len(text) > n else ""))


def serve(retriever: BM25Retriever, host: str = "127.0.0.1", port: int = 0) -> tuple[ThreadingHTTPServer, str]:
    """Serve ``retriever`` on ``host`` in a daemon thread; returns (server, its ``/retrieve`` URL).
    ``server.shutdown()`` stops it."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            if self.path != ROUTE:
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
    return srv, f"http://{host}:{srv.server_address[1]}{ROUTE}"
