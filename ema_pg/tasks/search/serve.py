"""Serve a Search-R1 corpus with BM25 on Search-R1's ``/retrieve`` protocol (a stand-in for its e5 server):

    python -m ema_pg.tasks.search.serve --corpus corpus.jsonl --port 8000

``corpus.jsonl``: Search-R1's corpus format, JSON lines each with ``contents`` = ``"Title"\\ntext``.
"""

from __future__ import annotations

import json
import threading

from ...cli import command_parser
from .retriever import BM25Retriever, serve


def load_corpus(path: str) -> list[tuple[str, str]]:
    """(title, text) pairs from a Search-R1 corpus file: JSON lines with ``contents`` = ``"Title"\\ntext``."""
    docs = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                title, _, text = str(row["contents"]).partition("\n")
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{i}: not a corpus row (a JSON object with 'contents'): {e}") from None
            docs.append((title, text))
    if not docs:
        raise ValueError(f"{path}: no documents")
    return docs


def main(argv: list[str] | None = None) -> None:
    ap = command_parser("Serve a Search-R1-format corpus (JSON lines, 'contents') with BM25 on Search-R1's /retrieve "
                        "protocol.")
    ap.add_argument("--corpus", required=True, help="JSON lines, each with 'contents': '\"Title\"\\ntext'")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args(argv)
    try:
        docs = load_corpus(args.corpus)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    srv, url = serve(BM25Retriever(docs), args.host, args.port)
    print(f"serving {len(docs)} documents at {url} (Ctrl-C stops)", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        srv.shutdown()


if __name__ == "__main__":
    main()
