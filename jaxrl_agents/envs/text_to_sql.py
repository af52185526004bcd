"""Text-to-SQL over generated sqlite databases, with a query tool (a host environment).

Each task is a question about a small generated company database (employees
and projects, fictional names and places) with a gold query. Each turn the
agent either runs a query to look at the data or answers:

  <sql>SELECT ...</sql>         the tool: the first MAX_ROWS rows, or "Error: ..."
  <answer>SELECT ...</answer>   the final query; the episode ends

The answer is scored by execution: its result against the gold query's
(as multisets of rows, or as lists when the gold query orders them). Reward 1
for the same result (`reward="execution"`), or the F1 of their rows
(`reward="partial"`); info records both (`success`, `partial_match`).

Model output is hostile input. A query runs only if it is a single SELECT
(sqlglot parses it: one statement, a query, no data or schema change anywhere
in its tree; at most MAX_SQL_CHARS characters), on a connection opened
read-only (`mode=ro`), with an authorizer that allows reading and ordinary
functions only (no ATTACH, PRAGMA, writes or extension loading), in a worker
process apart from the trainer, killed at the time limit (and replaced), with its
memory, temporary storage and result size capped (`envs/sql_sandbox.py`), and at most
MAX_ROWS + 1 rows fetched. The database files are written once, read-only, in a private
temporary directory. Counted per step in `info`: sql_call, sql_error,
refused, invalid (neither tag), success, partial_match.
"""

from __future__ import annotations

import atexit
import collections
import json
import logging
import os
import select
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Any

import numpy as np
import sqlglot
from sqlglot import exp

from jaxrl_agents import registry
from jaxrl_agents.envs import base, sql_sandbox

# sqlglot warns when it falls back to an opaque command for syntax it does not
# model; such a statement is refused anyway, and hostile replies would flood the log.
logging.getLogger("sqlglot").setLevel(logging.ERROR)

MAX_SQL_CHARS = 2000
MAX_NESTING = 20  # parentheses deep (sqlglot's parser recurses on them)
MAX_VALUE_BYTES = 100_000  # the longest string or blob a query may build (SQLITE_LIMIT_LENGTH)
MAX_ROWS = 10  # shown by the tool
MAX_ANSWER_ROWS = 1000  # compared for an answer (a database holds at most 40 rows a table)
MAX_CELL_CHARS = 40
QUERY_TIME_LIMIT_S = 2.0

# Nodes that change data or schema, or reach outside the query, anywhere in the tree.
_FORBIDDEN = (exp.Insert, exp.Update, exp.Delete, exp.Drop, exp.Create, exp.Alter, exp.Command,
              exp.Pragma, exp.Attach, exp.Detach, exp.Transaction, exp.Commit, exp.Rollback,
              exp.Merge, exp.Set, exp.Use)

SCHEMA = """CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT, department TEXT,
  city TEXT, salary INTEGER, hire_year INTEGER);
CREATE TABLE projects (id INTEGER PRIMARY KEY, title TEXT, department TEXT, budget INTEGER,
  lead_id INTEGER REFERENCES employees(id));"""

DEPARTMENTS = ("Research", "Sales", "Support", "Design", "Finance", "Legal")
CITIES = ("Avalon", "Brightwater", "Cobalt Bay", "Dunmore", "Elmstead")
_PROJECT_WORDS = ("Atlas", "Beacon", "Cinder", "Delta", "Ember", "Falcon", "Granite", "Harbor",
                  "Iris", "Juniper", "Kite", "Lumen")


class SqlRefused(ValueError):
  """A query the tool will not run (not a single read-only SELECT)."""


def check_select(sql: str) -> None:
  """Raises SqlRefused unless `sql` is one SELECT query that changes nothing."""
  if len(sql) > MAX_SQL_CHARS:
    raise SqlRefused(f"the query is longer than {MAX_SQL_CHARS} characters")
  depth = deepest = 0
  for ch in sql:  # one pass: the parser recurses on nesting
    depth += (ch == "(") - (ch == ")")
    deepest = max(deepest, depth)
  if deepest > MAX_NESTING:
    raise SqlRefused(f"the query nests parentheses more than {MAX_NESTING} deep")
  try:
    statements = [s for s in sqlglot.parse(sql, read="sqlite") if s is not None]
  except (sqlglot.errors.SqlglotError, RecursionError, ValueError) as e:
    reason = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
    raise SqlRefused(f"the query does not parse ({reason})") from None
  if len(statements) != 1:
    raise SqlRefused(f"write exactly one statement (got {len(statements)})")
  tree = statements[0]
  if not isinstance(tree, exp.Query):
    raise SqlRefused(f"only SELECT queries run here (got {type(tree).__name__.upper()})")
  for node in tree.walk():
    if isinstance(node, _FORBIDDEN):
      raise SqlRefused(f"only SELECT queries run here ({type(node).__name__.upper()} inside)")


# Starting a query worker (python -I -S, sqlite3): far less than this on any machine.
_STARTUP_S = 2.0
# How long past its time limit a query's reply may take before its worker is killed: the
# worker's own interruption (sqlite's progress handler, at the limit) keeps the worker, and
# comes first unless the query is stuck inside one sqlite instruction.
_REPLY_SLACK_S = 1.0


class _Worker:
  """A query process (envs/sql_sandbox.py): one request and its reply at a time."""

  def __init__(self):
    self.proc = subprocess.Popen([sys.executable, "-I", "-S", sql_sandbox.__file__],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL)
    self.fresh = True

  def ask(self, request: dict, timeout_s: float) -> dict | None:
    """The reply to `request`; None when the worker ended without one (it is then dead).
    Raises TimeoutError when no reply came in time (the worker is then killed)."""
    try:
      self.proc.stdin.write(json.dumps(request).encode() + b"\n")
      self.proc.stdin.flush()
    except OSError:  # BrokenPipeError: it had ended
      return None
    deadline = time.monotonic() + timeout_s + (_STARTUP_S if self.fresh else _REPLY_SLACK_S)
    self.fresh = False
    fd, chunks = self.proc.stdout.fileno(), []
    while not chunks or not chunks[-1].endswith(b"\n"):
      left = deadline - time.monotonic()
      if left <= 0 or not select.select([fd], [], [], left)[0]:
        self.kill()
        raise TimeoutError
      chunk = os.read(fd, 1 << 20)
      if not chunk:
        self.kill()
        return None
      chunks.append(chunk)
    try:
      return json.loads(b"".join(chunks))
    except ValueError:
      self.kill()
      return None

  def kill(self) -> None:
    self.proc.kill()
    self.proc.wait()
    for pipe in (self.proc.stdin, self.proc.stdout):
      pipe.close()


class _Workers:
  """Idle query workers, reused: one query at a time each, as many as queries in flight."""

  def __init__(self):
    self._idle: list[_Worker] = []
    self._lock = threading.Lock()
    atexit.register(self.close)

  def ask(self, request: dict, timeout_s: float) -> dict | None:
    with self._lock:
      worker = self._idle.pop() if self._idle else None
    if worker is not None and worker.proc.poll() is not None:
      worker.kill()  # it ended while idle (after running out of memory)
      worker = None
    worker = worker or _Worker()
    reply = worker.ask(request, timeout_s)  # TimeoutError: killed
    if reply is None:
      return None
    if worker.proc.poll() is None:
      with self._lock:
        self._idle.append(worker)
    else:
      worker.kill()
    return reply

  def close(self) -> None:
    with self._lock:
      idle, self._idle = self._idle, []
    for worker in idle:
      worker.kill()


_WORKERS = _Workers()


def run_query(path: str, sql: str, *, max_rows: int = MAX_ROWS,
              time_limit_s: float = QUERY_TIME_LIMIT_S) -> tuple[list[str], list[tuple]]:
  """(column names, up to max_rows + 1 rows) of a checked SELECT on the database at `path`,
  opened read-only, run in a worker process that is killed at the time limit, with
  its memory, temporary storage and result size capped (envs/sql_sandbox.py). Raises
  SqlRefused or sqlite3.Error."""
  check_select(sql)
  request = {"path": path, "sql": sql, "max_rows": max_rows, "time_limit_s": time_limit_s,
             "max_value_bytes": MAX_VALUE_BYTES}
  try:
    reply = _WORKERS.ask(request, time_limit_s)
  except TimeoutError:  # killed: whatever the query was doing, it stops
    raise sqlite3.OperationalError(
        f"the query ran past its time limit of {time_limit_s:g} s") from None
  if reply is None:
    raise sqlite3.OperationalError(
        "the query's process ended without a result (past its memory or CPU limits)")
  if "error" in reply:
    message = reply["message"]
    if message == "interrupted":
      message = f"the query ran past its time limit of {time_limit_s:g} s"
    elif message.startswith("not authorized"):
      message = f"only reading the tables is allowed ({message})"
    error = getattr(sqlite3, reply["error"], sqlite3.Error)
    raise (error if isinstance(error, type) and issubclass(error, sqlite3.Error)
           else sqlite3.Error)(message)
  rows = [tuple(bytes.fromhex(v["blob"]) if isinstance(v, dict) else v for v in row)
          for row in reply["rows"]]
  return reply["columns"], rows


def _cell(value) -> str:
  text = f"{value:.6g}" if isinstance(value, float) else str(value)
  return text if len(text) <= MAX_CELL_CHARS else text[:MAX_CELL_CHARS] + "..."


def show_result(columns: list[str], rows: list[tuple], max_rows: int = MAX_ROWS) -> str:
  """A result as the tool shows it: a header, one line per row, and what was left out."""
  lines = [" | ".join(columns)] + [" | ".join(_cell(v) for v in row) for row in rows[:max_rows]]
  if not rows:
    lines.append("(no rows)")
  elif len(rows) > max_rows:
    lines.append(f"(more rows: only the first {max_rows} are shown)")
  return "\n".join(lines)


def _key(row: tuple) -> tuple:
  return tuple(round(v, 6) if isinstance(v, float) else v for v in row)


def partial_match(predicted: list[tuple], gold: list[tuple]) -> float:
  """F1 of two results' rows as multisets (floats compared to 6 decimals)."""
  return base.multiset_f1(collections.Counter(map(_key, predicted)),
                          collections.Counter(map(_key, gold)))


def execution_match(predicted: list[tuple], gold: list[tuple], ordered: bool) -> bool:
  """The same rows (in the same order when the gold query orders them)."""
  p, g = list(map(_key, predicted)), list(map(_key, gold))
  return p == g if ordered else collections.Counter(p) == collections.Counter(g)


def generate_database(seed: int) -> dict[str, list[tuple]]:
  """The rows of database `seed`: 40 employees and 15 projects, from the seed alone."""
  rng = np.random.default_rng(seed)
  names = base.invented_names()
  picked = rng.choice(len(names), 40, replace=False)
  employees = [(i + 1, names[n], DEPARTMENTS[rng.integers(len(DEPARTMENTS))],
                CITIES[rng.integers(len(CITIES))], int(rng.integers(30, 151)) * 1000,
                int(rng.integers(2005, 2025))) for i, n in enumerate(picked)]
  titles = rng.choice(len(_PROJECT_WORDS), 12, replace=False)
  projects = [(i + 1, f"Project {_PROJECT_WORDS[t]}", DEPARTMENTS[rng.integers(len(DEPARTMENTS))],
               int(rng.integers(10, 500)) * 1000, int(rng.integers(1, 41)))
              for i, t in enumerate(titles)]
  return {"employees": employees, "projects": projects}


def _write(path: str, tables: dict[str, list[tuple]]) -> None:
  conn = sqlite3.connect(path)
  try:
    conn.executescript(SCHEMA)
    conn.executemany("INSERT INTO employees VALUES (?, ?, ?, ?, ?, ?)", tables["employees"])
    conn.executemany("INSERT INTO projects VALUES (?, ?, ?, ?, ?)", tables["projects"])
    conn.commit()
  finally:
    conn.close()
  os.chmod(path, 0o444)


def _quote(text: str) -> str:
  return "'" + text.replace("'", "''") + "'"


def make_question(tables: dict[str, list[tuple]], rng: np.random.Generator) -> tuple[str, str]:
  """(question, gold query) from one of the templates, about values the database holds."""
  employees = tables["employees"]
  person = employees[rng.integers(len(employees))]
  dept, city = person[2], person[3]
  lead = employees[tables["projects"][rng.integers(len(tables["projects"]))][4] - 1][1]
  year = int(rng.integers(2008, 2022))
  tie = "(on a tie, the first in alphabetical order)"
  templates = [
      (f"How many employees work in the {dept} department?",
       f"SELECT COUNT(*) FROM employees WHERE department = {_quote(dept)}"),
      (f"What is the average salary of the employees in {city}?",
       f"SELECT AVG(salary) FROM employees WHERE city = {_quote(city)}"),
      (f"Who earns the most in the {dept} department {tie}?",
       f"SELECT name FROM employees WHERE department = {_quote(dept)} "
       "ORDER BY salary DESC, name LIMIT 1"),
      (f"List the names of the employees in {city} hired after {year}.",
       f"SELECT name FROM employees WHERE city = {_quote(city)} AND hire_year > {year}"),
      (f"How many projects does the {dept} department run?",
       f"SELECT COUNT(*) FROM projects WHERE department = {_quote(dept)}"),
      (f"What is the total budget of the projects led by {lead}?",
       "SELECT SUM(p.budget) FROM projects p JOIN employees e ON p.lead_id = e.id "
       f"WHERE e.name = {_quote(lead)}"),
      (f"Which department has the most employees {tie}?",
       "SELECT department FROM employees GROUP BY department "
       "ORDER BY COUNT(*) DESC, department LIMIT 1"),
  ]
  return templates[rng.integers(len(templates))]


class SqlEpisode:
  """One question over one database."""

  def __init__(self, path: str, question: str, gold: str, reward: str):
    self.path, self.question, self.gold, self.reward = path, question, gold, reward

  def reset(self) -> str:
    return (f"Answer the question with one SQLite query over this database.\n{SCHEMA}\n"
            f"Question: {self.question}\nTo run a query and see its first rows, write "
            "<sql>SELECT ...</sql>. When you are sure, reply <answer>SELECT ...</answer> "
            "with the query that answers the question.")

  def step(self, reply: str) -> base.HostStep:
    info = dict(sql_call=0.0, sql_error=0.0, refused=0.0, invalid=0.0, success=0.0,
                partial_match=0.0)
    answer = base.last_between(reply, "<answer>", "</answer>")
    query = answer if answer is not None else base.last_between(reply, "<sql>", "</sql>")
    if query is None:
      info["invalid"] = 1.0
      return base.HostStep("Write <sql>...</sql> to run a query or <answer>...</answer> to "
                           "answer.", 0.0, False, info)
    try:
      columns, rows = run_query(self.path, query,
                                max_rows=MAX_ROWS if answer is None else MAX_ANSWER_ROWS)
    except SqlRefused as e:
      info["refused"], shown, rows = 1.0, f"Error: {e}.", None
    except sqlite3.Error as e:
      info["sql_error"], shown, rows = 1.0, f"Error: {str(e)[:200]}.", None
    else:
      shown = show_result(columns, rows)
    if answer is None:
      info["sql_call"] = 1.0
      return base.HostStep(shown, 0.0, False, info)
    if rows is not None:
      _, gold = run_query(self.path, self.gold, max_rows=MAX_ANSWER_ROWS)
      ordered = bool(sqlglot.parse_one(self.gold, read="sqlite").args.get("order"))
      info["success"] = float(execution_match(rows, gold, ordered))
      info["partial_match"] = partial_match(rows, gold)
    reward = info["success"] if self.reward == "execution" else info["partial_match"]
    return base.HostStep("", reward, True, info)


_DIR_PREFIX = "jaxrl_text_to_sql_"
_OWNER_FILE = "owner"  # "<pid> <host>" of the process whose databases these are


def _remove_orphans() -> None:
  """Deletes the database directories of this user's processes that died without cleaning
  up (a SIGKILLed run): their owner's pid is gone on this host."""
  root = tempfile.gettempdir()
  for name in os.listdir(root):
    path = os.path.join(root, name)
    if not name.startswith(_DIR_PREFIX) or os.path.islink(path) or not os.path.isdir(path):
      continue
    try:
      if os.stat(path).st_uid != os.geteuid():
        continue
      with open(os.path.join(path, _OWNER_FILE)) as f:
        pid, host = f.read().split()
      os.kill(int(pid), 0)
    except ProcessLookupError:
      if host == socket.gethostname():
        shutil.rmtree(path, ignore_errors=True)
    except (OSError, ValueError):
      continue  # not ours, being created, or an owner that lives


class TextToSql:
  """The environment: questions over `databases` generated databases (a host environment)."""

  host = True

  def __init__(self, tokenizer=None, *, databases: int = 8, reward: str = "execution"):
    del tokenizer  # observations are text; the loop tokenizes them
    if databases < 1:
      raise ValueError(f"text_to_sql: databases must be >= 1, got {databases}")
    if reward not in ("execution", "partial"):
      raise ValueError(f"text_to_sql: reward must be 'execution' or 'partial', got {reward!r}")
    self.databases, self.reward = databases, reward
    _remove_orphans()
    self.dir = tempfile.mkdtemp(prefix=_DIR_PREFIX)
    with open(os.path.join(self.dir, _OWNER_FILE), "w") as f:
      f.write(f"{os.getpid()} {socket.gethostname()}")
    weakref.finalize(self, shutil.rmtree, self.dir, ignore_errors=True)
    self._tables: dict[int, dict] = {}
    self._lock = threading.Lock()

  def database(self, seed: int) -> tuple[str, dict[str, list[tuple]]]:
    """(path, rows) of database `seed`, written on first use."""
    with self._lock:
      if seed not in self._tables:
        self._tables[seed] = generate_database(seed)
        _write(self.path(seed), self._tables[seed])
      return self.path(seed), self._tables[seed]

  def path(self, seed: int) -> str:
    return os.path.join(self.dir, f"company_{seed}.sqlite")

  def sample_task(self, rng: np.random.Generator) -> dict[str, Any]:
    """A question whose gold result is not empty (else any empty query would score)."""
    seed = int(rng.integers(self.databases))
    path, tables = self.database(seed)
    for _ in range(100):
      question, gold = make_question(tables, rng)
      _, rows = run_query(path, gold, max_rows=1)
      if rows and rows[0][0] is not None:
        break
    return {"db": seed, "question": question, "gold": gold}

  def episode(self, task: dict[str, Any]) -> SqlEpisode:
    path, _ = self.database(int(task["db"]))
    return SqlEpisode(path, str(task["question"]), str(task["gold"]), self.reward)


@registry.register("env", "text_to_sql")
def make(tokenizer, **options) -> TextToSql:
  """Text-to-SQL over generated sqlite databases, a read-only query tool (host)."""
  return TextToSql(tokenizer, **options)
