"""One HTTP call for the tests of the OpenAI front door, without raising on 4xx/5xx."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def http(base: str, path: str, body: bytes | None = None, headers=None, method=None, ctx=None):
    """-> (status, headers, parsed JSON or text)."""
    method = method or ("POST" if body is not None else "GET")
    req = urllib.request.Request(f"{base}{path}", data=body, method=method)
    for name, value in (headers or {"Content-Type": "application/json"}).items():
        req.add_header(name, value)
    try:
        with urllib.request.urlopen(req, timeout=30, context=ctx) as resp:
            status, got, raw = resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as e:
        status, got, raw = e.code, e.headers, e.read()
    text = raw.decode()
    try:
        return status, got, json.loads(text)
    except json.JSONDecodeError:
        return status, got, text
