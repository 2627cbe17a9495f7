"""Airflow's deployment hook (airflow/settings.py: initialize → import_local_settings, in every Airflow process of this
deployment — the CLI and `airflow dags test`, api-server, scheduler, dag-processor, triggerer, Celery workers and the
task processes they fork — at `import airflow`, after the plugins folder is put on sys.path). No policies here: the
cyclic garbage collector of those processes, which spent a fifth to a third of their CPU in it (a `perf` profile of
`make test` on this 2-core host: 20-36 % per Airflow process, most at their start and at their exit).

- Full passes 10x rarer (FULL_PASS_EVERY): CPython runs one once 10 collections of the middle generation have
  passed and the objects promoted since the last one exceed a quarter of the long-lived. Airflow's start (its ORM
  models, Cadwyn's versioned execution-API routers, the providers, the DAG files' imports) leaves ~320k objects
  that all stay: the repeated full passes over them found nothing to free. At 100 they still run, so cyclic
  garbage that reaches the oldest generation is still freed, later.
- No collection at exit: at interpreter teardown CPython collects the whole heap again, several times, as modules
  are cleared. `gc.freeze()` at exit (atexit, LIFO: after every handler registered later, Airflow's dispose_orm and
  logging's flush among them) moves every object into the permanent generation, which those passes never scan.
  Objects are still freed by reference count; only cyclic garbage is left to the exiting process (CPython never
  promises `__del__` at exit). The stages' own processes do the same (tasks/procs.py, skip_exit_collection).

Measured on this host (bench/bench_gc.py, gc.airflow_process_cpu_ratio_deployment_vs_default), one process that
imports Airflow, builds the in-process execution API (as `airflow dags test` does) and parses dags/: 0.62-0.67x the
CPU with these settings than with CPython's defaults (3.3-3.9 CPU s → 2.1-2.6 over four runs).
"""

from __future__ import annotations

import atexit as _atexit
import gc as _gc

__all__: list[str] = []  # no policy functions, and nothing copied into airflow.settings (import_local_settings)

FULL_PASS_EVERY = 100  # middle-generation collections between two full passes (CPython's default: 10)

_young, _middle, _full = _gc.get_threshold()
_gc.set_threshold(_young, _middle, max(_full, FULL_PASS_EVERY))
_atexit.register(_gc.freeze)
