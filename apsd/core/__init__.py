"""The core: a request's life, and the interfaces everything else implements.

Nothing here imports from the rest of apsd (a test checks the layering):

* values: :mod:`~apsd.core.config` (the configuration schema), :mod:`~apsd.core.models` (requests,
  outcomes, capacities), :mod:`~apsd.core.streams` (token streams), :mod:`~apsd.core.clock` (model time);
* a request's life: :mod:`~apsd.core.admission` (token buckets: admit or refuse),
  :mod:`~apsd.core.scheduler` (the queue and dispatch), :mod:`~apsd.core.ledger` (the books, and
  the one function that ends a request);
* interfaces: :mod:`~apsd.core.engine` (engines), :mod:`~apsd.core.policy` (policies),
  :mod:`~apsd.core.store` (where buckets live), :mod:`~apsd.core.hookspecs` (plugins' hooks),
  :mod:`~apsd.core.events` (observation).
"""
