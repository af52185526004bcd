"""What a text-to-SQL query costs the host loop: a reused worker process against a process per
query and against running in the trainer's own process (no time limit that can stop it).

  .venv/bin/python benchmarks/sql_query_cost.py [--queries 50]

Runs the same `--queries` small SELECTs (the environment's gold queries) three ways, in
one process, and prints one JSON object: milliseconds per query (median and mean) for
  worker       text_to_sql.run_query: the query checked, sent to a worker kept between
               queries (envs/sql_sandbox.py); the first query, which starts the worker,
               is timed apart as `worker_first_ms`
  per_process  a fresh `python -I -S sql_sandbox.py` per query (what run_query did before)
  in_process   sql_sandbox.execute in this process (the floor; unsafe: nothing can stop a
               query stuck in one sqlite instruction)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import numpy as np

import cpu_info
from jaxrl_agents import envs
from jaxrl_agents.envs import sql_sandbox, text_to_sql


def _ms(times: list[float]) -> dict[str, float]:
  return {"median_ms": round(1e3 * statistics.median(times), 2),
          "mean_ms": round(1e3 * statistics.fmean(times), 2)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--queries", type=int, default=50)
  args = parser.parse_args()
  if args.queries < 2:
    parser.error(f"--queries must be >= 2, got {args.queries}")
  env = envs.make("text_to_sql", None, databases=1)
  path, tables = env.database(0)
  rng = np.random.default_rng(0)
  queries = [text_to_sql.make_question(tables, rng)[1] for _ in range(args.queries)]
  request = dict(path=path, max_rows=text_to_sql.MAX_ROWS,
                 time_limit_s=text_to_sql.QUERY_TIME_LIMIT_S,
                 max_value_bytes=text_to_sql.MAX_VALUE_BYTES)

  text_to_sql._WORKERS.close()
  worker = []
  for sql in queries:
    start = time.perf_counter()
    text_to_sql.run_query(path, sql)
    worker.append(time.perf_counter() - start)

  per_process = []
  for sql in queries:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-I", "-S", sql_sandbox.__file__],
                   input=json.dumps({**request, "sql": sql}) + "\n", capture_output=True,
                   text=True, check=True)
    per_process.append(time.perf_counter() - start)

  in_process = []
  for sql in queries:
    start = time.perf_counter()
    sql_sandbox.execute({**request, "sql": sql})
    in_process.append(time.perf_counter() - start)

  print(json.dumps({
      "benchmark": "sql_query_cost", "cpu": cpu_info.describe(), "queries": args.queries,
      "worker_first_ms": round(1e3 * worker[0], 2), "worker": _ms(worker[1:]),
      "per_process": _ms(per_process), "in_process": _ms(in_process)}))


if __name__ == "__main__":
  main()
