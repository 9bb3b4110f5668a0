"""The daemon's outside: HTTP, API keys, logs, systemd, metrics exposition.

* :mod:`~apsd.serve.daemon` — runs the pipeline and the HTTP server under one owner; signals, reloads.
* :mod:`~apsd.serve.http` — the HTTP API (Quart-Trio): ``/infer``, the OpenAI surface, operations.
* :mod:`~apsd.serve.server` — hypercorn's trio worker, with its keep-alive race fixed.
* :mod:`~apsd.serve.auth` — API keys. :mod:`~apsd.serve.logs` — structured logs.
* :mod:`~apsd.serve.notify` — systemd. :mod:`~apsd.serve.prometheus` — ``/metrics``.
* :mod:`~apsd.serve.readiness` — ``/ready``.
"""
