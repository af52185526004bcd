"""Read-only SELECTs in a process apart from the trainer, under hard limits (text_to_sql's tool).

sqlite's progress handler runs between virtual-machine instructions, so one instruction
(a GLOB over a long string, a sort) can outrun any time limit inside the process that
runs it, and a thread running it cannot be stopped. So queries run here, in a worker
process the caller (`text_to_sql.run_query`) kills at a query's time limit and replaces,
with
  - its address space capped (MEMORY_BYTES) and sqlite's heap capped below it,
  - temporary tables and sorts in memory (no temporary files: the file size limit is 0),
  - the result capped (rows by the caller, bytes here: MAX_RESULT_BYTES),
  - CPU seconds capped as a last resort (each query's limit past what the worker has used).
The module imports only the standard library (the caller runs it with `python -I -S`),
and the caller imports its authorizer from it. A worker serves one query after another
(starting one costs a few hundred milliseconds on a busy machine; a query, milliseconds);
it ends at the end of its input, so a worker outlives no trainer.

Protocol, one line each: a JSON request on stdin {path, sql, max_rows, time_limit_s,
max_value_bytes}; a JSON reply on stdout: {"columns": [...], "rows": [[...], ...]}
(blobs as {"blob": hex}) or {"error": sqlite3 exception class name, "message": ...}. After
running out of memory the worker replies and exits (the caller starts another).
"""

from __future__ import annotations

import json
import resource
import sqlite3
import sys
import time

MEMORY_BYTES = 768 << 20  # the child's whole address space (Python, sqlite, the result)
HEAP_BYTES = 256 << 20  # sqlite's own allocations, temporary tables and sorts included
MAX_RESULT_BYTES = 1 << 20  # the rows' text, summed

# What the authorizer lets a statement do (sqlite3 action codes): read, and call functions.
ALLOWED_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
                   sqlite3.SQLITE_RECURSIVE}
DENIED_FUNCTIONS = {"load_extension", "readfile", "writefile", "edit", "fts3_tokenizer"}


def authorize(action, arg1, arg2, db_name, trigger):
  del arg1, db_name, trigger
  if action not in ALLOWED_ACTIONS:
    return sqlite3.SQLITE_DENY
  if action == sqlite3.SQLITE_FUNCTION and str(arg2).lower() in DENIED_FUNCTIONS:
    return sqlite3.SQLITE_DENY
  return sqlite3.SQLITE_OK


def _size(value) -> int:
  return len(value) if isinstance(value, (str, bytes)) else 8


def _cell(value):
  return {"blob": value.hex()} if isinstance(value, bytes) else value


def execute(request: dict) -> dict:
  """The query's columns and rows, or its error, as the reply's JSON object."""
  conn = sqlite3.connect(f"file:{request['path']}?mode=ro", uri=True)
  try:
    conn.execute("PRAGMA temp_store = MEMORY")
    conn.execute(f"PRAGMA hard_heap_limit = {HEAP_BYTES}")
    conn.set_authorizer(authorize)
    # printf('%.*c', ...), zeroblob() and friends build a value in one step: cap its size.
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, request["max_value_bytes"])
    deadline = time.monotonic() + request["time_limit_s"]
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 1000)
    cursor = conn.execute(request["sql"])
    rows = cursor.fetchmany(request["max_rows"] + 1)
    size = sum(_size(v) for row in rows for v in row)
    if size > MAX_RESULT_BYTES:
      return {"error": "OperationalError",
              "message": f"the result holds more than {MAX_RESULT_BYTES} bytes"}
    return {"columns": [d[0] for d in cursor.description or ()],
            "rows": [[_cell(v) for v in row] for row in rows]}
  except sqlite3.Error as e:
    return {"error": type(e).__name__, "message": str(e)}
  except MemoryError:
    return {"error": "OperationalError", "message": "the query ran out of memory"}
  finally:
    conn.close()


def _cap_cpu(time_limit_s: float) -> None:
  """SIGXCPU (which ends the worker) once this query has used its limit's CPU seconds and 2."""
  usage = resource.getrusage(resource.RUSAGE_SELF)
  used = usage.ru_utime + usage.ru_stime
  _, hard = resource.getrlimit(resource.RLIMIT_CPU)
  soft = int(used + time_limit_s) + 2
  resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY
                                           else min(soft, hard), hard))


def main() -> None:
  resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
  resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
  for line in sys.stdin:
    request = json.loads(line)
    _cap_cpu(request["time_limit_s"])
    reply = execute(request)
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
    if reply.get("message") == "the query ran out of memory":
      return  # what a MemoryError leaves behind is not worth keeping


if __name__ == "__main__":
  main()
