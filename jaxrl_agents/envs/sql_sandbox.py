"""One read-only SELECT in a process of its own, under hard limits (text_to_sql's tool).

sqlite's progress handler runs between virtual-machine instructions, so one instruction
(a GLOB over a long string, a sort) can outrun any time limit inside the process that
runs it, and a thread running it cannot be stopped. So each query runs here, in a child
process the caller (`text_to_sql.run_query`) kills at the time limit, with
  - its address space capped (MEMORY_BYTES) and sqlite's heap capped below it,
  - temporary tables and sorts in memory (no temporary files: the file size limit is 0),
  - the result capped (rows by the caller, bytes here: MAX_RESULT_BYTES),
  - CPU seconds capped as a last resort.
The module imports only the standard library (the caller runs it with `python -I -S`,
starting in tens of milliseconds), and the caller imports its authorizer from it.

Protocol: one JSON request on stdin {path, sql, max_rows, time_limit_s, max_value_bytes};
one JSON reply on stdout: {"columns": [...], "rows": [[...], ...]} (blobs as
{"blob": hex}) or {"error": sqlite3 exception class name, "message": ...}.
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


def main() -> None:
  request = json.loads(sys.stdin.read())
  resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
  resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
  cpu = int(request["time_limit_s"]) + 2
  resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
  sys.stdout.write(json.dumps(execute(request)))


if __name__ == "__main__":
  main()
