"""paramserver's compiled loops, where the install could build them (``_native.c``, built by
``setup.py``; a C compiler is optional): ``loops`` is the module, or None.

numpy does the same work in several passes over memory, each a separate call with its own
cost: a server's step touches a few thousand rows scattered over gigabytes, so one pass per row
is what sets its speed. Each user of a loop keeps its numpy path and takes the loop where it
applies, with the same result (the tests run both and compare):

- :class:`~paramserver.store.idmap.IdMap` searches a batch of ids and places new ones one id at a
  time, reading a slot and its row's record once each (numpy: a round of array operations per
  window of slots);
- Adagrad on a table's rows (:mod:`paramserver.optim`) updates each row in place, read
  and written once (torch.optim: a gather, the rule's passes, a scatter), with torch's float
  operations in torch's order: bitwise the same;
- a server checks a request's row ids (each set rising, within its table's bounds) and its
  gradients (no NaN or Inf) in one call each, whatever the number of tables (numpy: a few
  array operations over the sets joined; torch: a sum over the gradients joined, a copy);
- a dynamic table's new rows (:mod:`paramserver.store.rowinit`) get their values and
  optimizer state in one write per row (numpy and torch: a pass per array);
- a trainer's record pass (:mod:`paramserver.trainer.replica`) finds every table's unique ids
  in one call (torch: a ``torch.unique`` per table, each with its own cost);
- a trainer's forward makes its step's lookups of every table in one call, and its backward
  adds their gradients in one (torch: an ``index_select`` and an ``index_add_`` per lookup).

The module also names ``MAP_NORESERVE`` for :mod:`mmap`, which Python's does not: a dynamic
table's storage maps room to grow in with it (:mod:`paramserver.store.growth`).

``PARAMSERVER_NATIVE=0`` in the environment turns the loops off (to compare, or to rule them
out).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def _load() -> ModuleType | None:
    if os.environ.get("PARAMSERVER_NATIVE", "1") == "0":
        return None
    try:
        return importlib.import_module("paramserver._native")
    except ImportError:
        return None


loops: ModuleType | None = _load()
