"""What apsd keeps across restarts and shares between replicas: the state.

* :mod:`apsd.state.keeper`: the keeper the daemon runs: the effective configuration (the config
  file's, with tenants and keys managed through ``/admin``), who wins for a tenant the file
  declares, the admin operations and their audit, and the flushes of what a restart must not lose;
* :mod:`apsd.state.records`: what is kept (tenant and key records, audit entries, usage rows);
* :mod:`apsd.state.usage`: usage gathered per hour, tenant, model and backend, and summarised;
* :mod:`apsd.state.store`: the interface of where it is kept, :mod:`apsd.state.sqlite` (an
  embedded SQLite file: a single daemon, the default) and :mod:`apsd.state.redis` (replicas that
  share ``[store]``'s Redis).

The simulator keeps nothing: only the daemon opens a keeper.
"""
