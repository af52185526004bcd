"""Text-to-SQL: the query check, the read-only sandbox's other layers, execution-match scoring,
and hostile queries through the host loop (counted, never executed, no file changed)."""

import hashlib
import os
import sqlite3
import time

import jax
import numpy as np
import pytest

from jaxrl_agents import envs
from jaxrl_agents.envs import text_to_sql
from jaxrl_agents.models import tokenizer as tokenizer_lib
from jaxrl_agents.models import zoo
from jaxrl_agents.rollout import host_loop
from jaxrl_agents.rollout import sampler as sampler_lib

HOSTILE = [
    "DROP TABLE employees",
    "DELETE FROM employees",
    "UPDATE employees SET salary = 0",
    "INSERT INTO employees VALUES (99, 'x', 'x', 'x', 1, 1)",
    "REPLACE INTO employees VALUES (1, 'x', 'x', 'x', 1, 1)",
    "WITH a AS (SELECT 1) DELETE FROM employees",
    "CREATE TABLE evil (x)",
    "ATTACH DATABASE '{evil}' AS evil",
    "DETACH DATABASE main",
    "PRAGMA writable_schema = 1",
    "VACUUM INTO '{evil}'",
    "SELECT 1; DROP TABLE employees",
    "SELECT name FROM employees; ATTACH '{evil}' AS e",
    "BEGIN",
]


@pytest.mark.parametrize("sql", [
    "SELECT name FROM employees", "select count(*) from projects where budget > 1000",
    "WITH a AS (SELECT id FROM employees) SELECT COUNT(*) FROM a",
    "SELECT name FROM employees UNION SELECT title FROM projects",
    "SELECT e.name FROM employees e JOIN projects p ON p.lead_id = e.id ORDER BY e.name"])
def test_single_selects_pass_the_check(sql):
  text_to_sql.check_select(sql)


@pytest.mark.parametrize("sql", HOSTILE + ["SELECT * FROM", "", "SELECT 1 " + "+ 1 " * 600])
def test_everything_else_is_refused_before_sqlite_sees_it(sql):
  with pytest.raises(text_to_sql.SqlRefused):
    text_to_sql.check_select(sql.format(evil="/tmp/evil.db"))


def _digest(directory):
  return {name: hashlib.sha256(open(os.path.join(directory, name), "rb").read()).hexdigest()
          for name in sorted(os.listdir(directory))}


@pytest.mark.parametrize("sql", [s for s in HOSTILE if ";" not in s] + [
    "SELECT load_extension('/tmp/nothing')"])
def test_the_connection_refuses_writes_even_without_the_check(sql, tmp_path, monkeypatch):
  """Defence in depth: with the parser check switched off, the read-only connection and its
  authorizer still refuse every statement that is not a plain read."""
  env = envs.make("text_to_sql", None, databases=1)
  path, _ = env.database(0)
  before = _digest(env.dir)
  evil = str(tmp_path / "evil.db")
  monkeypatch.setattr(text_to_sql, "check_select", lambda sql: None)
  with pytest.raises(sqlite3.Error):
    text_to_sql.run_query(path, sql.format(evil=evil))
  assert _digest(env.dir) == before and not os.path.exists(evil)


@pytest.mark.parametrize("sql", [
    "SELECT " + "(" * 300 + "1" + ")" * 300, "SELECT " + "(" * 5000,
    "SELECT name FROM employees WHERE " + " AND ".join(["(1 = 1)"] * 200)])
def test_deep_or_long_queries_are_refused_not_crashed(sql):
  env = envs.make("text_to_sql", None, databases=1)
  ep = env.episode(env.sample_task(np.random.default_rng(0)))
  out = ep.step(f"<sql>{sql}</sql>")
  assert out.info["refused"] == 1.0 and out.obs.startswith("Error: ") and not out.done


def test_a_query_cannot_build_a_huge_value():
  env = envs.make("text_to_sql", None, databases=1)
  path, _ = env.database(0)
  for sql in ("SELECT zeroblob(30000000)", "SELECT length(randomblob(30000000))",
              "SELECT length(zeroblob(60000) || zeroblob(60000))"):
    with pytest.raises(sqlite3.Error, match="too big"):
      text_to_sql.run_query(path, sql)
  _, rows = text_to_sql.run_query(path, "SELECT printf('%.*c', 30000000, 'x')")
  assert rows == [(None,)]  # printf gives NULL past the limit


def test_a_runaway_query_is_interrupted_at_its_time_limit():
  env = envs.make("text_to_sql", None, databases=1)
  path, _ = env.database(0)
  start = time.monotonic()
  with pytest.raises(sqlite3.OperationalError, match="time limit of 0.3 s"):
    text_to_sql.run_query(path, "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c)"
                          " SELECT COUNT(*) FROM c", time_limit_s=0.3)
  assert time.monotonic() - start < 2.0


def test_scoring_by_hand():
  gold = [("Ada",), ("Bram",), ("Cleo",)]
  assert text_to_sql.execution_match([("Cleo",), ("Ada",), ("Bram",)], gold, ordered=False)
  assert not text_to_sql.execution_match([("Cleo",), ("Ada",), ("Bram",)], gold, ordered=True)
  assert not text_to_sql.execution_match([("Ada",), ("Ada",), ("Bram",)], gold, ordered=False)
  assert text_to_sql.execution_match([(1 / 3,)], [(0.3333333333,)], ordered=True)
  # 2 of 4 predicted rows are among the 3 gold ones: precision 1/2, recall 2/3, F1 4/7.
  f1 = text_to_sql.partial_match([("Ada",), ("Bram",), ("Dov",), ("Esme",)], gold)
  np.testing.assert_allclose(f1, 4 / 7)
  assert text_to_sql.partial_match([], []) == 1.0 and text_to_sql.partial_match([], gold) == 0.0


def test_every_question_is_answered_by_its_gold_query_and_not_by_another():
  env = envs.make("text_to_sql", None, databases=4)
  rng = np.random.default_rng(0)
  tasks = [env.sample_task(rng) for _ in range(40)]
  assert len({t["gold"].split(" WHERE")[0] for t in tasks}) >= 5  # the templates vary
  for task in tasks:
    ep = env.episode(task)
    assert "Question: " + task["question"] in ep.reset()
    right = ep.step(f"Let me answer. <answer>{task['gold']}</answer>")
    assert right.done and right.reward == 1.0 and right.info["partial_match"] == 1.0, task
    _, rows = text_to_sql.run_query(ep.path, task["gold"])
    assert rows and rows[0][0] is not None, task  # a question with an answer
  wrong = env.episode(tasks[0]).step("<answer>SELECT name FROM employees</answer>")
  assert wrong.done and wrong.reward == 0.0


def test_databases_are_generated_from_their_seed_alone():
  assert text_to_sql.generate_database(3) == text_to_sql.generate_database(3)
  assert text_to_sql.generate_database(3) != text_to_sql.generate_database(4)
  env = envs.make("text_to_sql", None, databases=2)
  path, tables = env.database(1)
  conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
  assert conn.execute("SELECT COUNT(*) FROM employees").fetchone()[0] == \
      len(tables["employees"]) == 40
  conn.close()
  assert not os.access(path, os.W_OK) or os.geteuid() == 0  # written once, read-only


def test_partial_reward_and_tool_turns():
  env = envs.make("text_to_sql", None, databases=1, reward="partial")
  task = {"db": 0, "question": "Names in Avalon?",
          "gold": "SELECT name FROM employees WHERE city = 'Avalon'"}
  ep = env.episode(task)
  look = ep.step("<sql>SELECT name, city FROM employees</sql>")
  assert not look.done and look.info["sql_call"] == 1.0
  assert look.obs.startswith("name | city\n") and "only the first 10" in look.obs
  assert ep.step("no tags").info["invalid"] == 1.0
  everyone = ep.step("<answer>SELECT name FROM employees</answer>")
  _, avalon = text_to_sql.run_query(ep.path, task["gold"])
  np.testing.assert_allclose(everyone.reward, 2 * len(avalon) / (40 + len(avalon)))
  with pytest.raises(ValueError, match="reward"):
    envs.make("text_to_sql", None, reward="bleu")


class Scripted:
  """text_to_sql whose episodes ignore the model and send scripted replies, one per turn."""

  host = True

  def __init__(self, env, replies):
    self.env, self.replies = env, replies

  def episode(self, task):
    inner, replies = self.env.episode(task), iter(self.replies)
    outer = type("ScriptedEpisode", (), {})()
    outer.reset = inner.reset
    outer.step = lambda reply: inner.step(next(replies))
    return outer


def test_hostile_queries_through_the_host_loop_are_counted_and_change_nothing(tmp_path):
  model = zoo.load("tiny")
  tok = model.tokenizer
  env = envs.make("text_to_sql", None, databases=1)
  task = env.sample_task(np.random.default_rng(0))
  evil = str(tmp_path / "evil.db")
  hostile = [f"<sql>{s.format(evil=evil)}</sql>" for s in HOSTILE]
  turns = len(hostile) + 1
  scripted = Scripted(env, hostile + [f"<answer>{task['gold']}</answer>"])
  before = _digest(env.dir)
  sampling = sampler_lib.SamplingConfig(max_new_tokens=2, temperature=1.0,
                                        stop_tokens=tokenizer_lib.stop_token_ids(tok),
                                        pad_id=tok.pad_token_id)
  out = host_loop.rollout(model.params, model.cfg, tok, scripted, [task], jax.random.key(0),
                          sampling, group_size=1, num_turns=turns, obs_tokens=32,
                          step_timeout_s=10.0)
  info = {k: float(np.asarray(v)[0]) for k, v in out.episodes.info.items()}
  assert info["refused"] == len(HOSTILE) and info["sql_error"] == 0, info
  assert info["success"] == 1.0 and float(out.episodes.traj.rewards[0]) == 1.0
  assert not out.failed.any() and out.counters["env_errors"] == 0
  assert _digest(env.dir) == before and not os.path.exists(evil)


# One opcode can outrun sqlite's progress handler: the query's process is killed instead.
_GLOB = ("SELECT printf('%.*c', 99990, 'a') GLOB '*' || replace(printf('%.*c', 16000, 'x'), "
         "'x', '[a]') || 'b'")


def test_a_query_stuck_in_one_opcode_is_killed_at_its_time_limit():
  env = envs.make("text_to_sql", None, databases=1)
  path, _ = env.database(0)
  for sql in (_GLOB, _GLOB + " FROM employees"):
    start = time.monotonic()
    with pytest.raises(sqlite3.OperationalError, match="time limit of 1 s"):
      text_to_sql.run_query(path, sql, time_limit_s=1.0)
    assert time.monotonic() - start < 1.0 + text_to_sql._STARTUP_S + 1.0


def test_a_query_result_and_its_temporary_storage_are_bounded(tmp_path, monkeypatch):
  env = envs.make("text_to_sql", None, databases=1)
  path, _ = env.database(0)
  with pytest.raises(sqlite3.OperationalError, match="the result holds more than 1048576 bytes"):
    text_to_sql.run_query(path, "SELECT printf('%.*c', 99000, 'x') FROM employees",
                          max_rows=text_to_sql.MAX_ANSWER_ROWS)
  # a sort far larger than sqlite's heap cap: an error, and no temporary file anywhere
  temp = tmp_path / "temp"
  temp.mkdir()
  monkeypatch.setenv("TMPDIR", str(temp))
  monkeypatch.setenv("SQLITE_TMPDIR", str(temp))
  text_to_sql._WORKERS.close()  # the next worker starts with these
  big_sort = ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c LIMIT 3000000) "
              "SELECT x FROM c ORDER BY printf('%.*c', 400, x) LIMIT 1")
  with pytest.raises(sqlite3.Error, match="out of memory|time limit|without a result"):
    text_to_sql.run_query(path, big_sort, time_limit_s=5.0)
  assert os.listdir(temp) == []


def test_answer_queries_do_not_grow_the_callers_memory():
  import resource

  env = envs.make("text_to_sql", None, databases=1)
  path, _ = env.database(0)
  before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  rows = ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c LIMIT 1001) "
          "SELECT printf('%.*c', 99000, 'x') FROM c")
  for _ in range(8):  # each built 1001 rows of 99 KB in its own process; refused there
    with pytest.raises(sqlite3.OperationalError, match="more than"):
      text_to_sql.run_query(path, rows, max_rows=text_to_sql.MAX_ANSWER_ROWS)
  assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # KB


def _idle_pids() -> list[int]:
  return [w.proc.pid for w in text_to_sql._WORKERS._idle]


def test_one_worker_serves_query_after_query_and_a_killed_one_is_replaced():
  env = envs.make("text_to_sql", None, databases=1)
  path, _ = env.database(0)
  text_to_sql._WORKERS.close()
  text_to_sql.run_query(path, "SELECT 1")
  (pid,) = _idle_pids()
  for _ in range(10):
    assert len(text_to_sql.run_query(path, "SELECT name FROM employees")[1]) > 1
  assert _idle_pids() == [pid]
  with pytest.raises(sqlite3.OperationalError, match="time limit of 0.3 s"):  # interrupted
    text_to_sql.run_query(path, "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c)"
                          " SELECT COUNT(*) FROM c", time_limit_s=0.3)
  assert _idle_pids() == [pid]  # by itself: kept
  with pytest.raises(sqlite3.OperationalError, match="time limit of 0.3 s"):
    text_to_sql.run_query(path, _GLOB, time_limit_s=0.3)  # stuck in one instruction
  assert _idle_pids() == []  # killed
  assert text_to_sql.run_query(path, "SELECT 1")[1] == [(1,)]
  (worker,) = text_to_sql._WORKERS._idle
  assert worker.proc.pid != pid
  worker.proc.kill()  # dies while idle: the next query gets another
  worker.proc.wait()
  assert text_to_sql.run_query(path, "SELECT 2")[1] == [(2,)]


def test_a_workers_cpu_limit_is_each_querys_not_their_sum():
  """Before each query a worker's CPU limit moves to what it has used + the query's limit + 2 s
  (a fixed limit would end a long-lived worker in the middle of an innocent query)."""
  import subprocess
  import sys

  from jaxrl_agents.envs import sql_sandbox

  code = (f"import sys; sys.path.insert(0, {os.path.dirname(sql_sandbox.__file__)!r})\n"
          "import resource, sql_sandbox\n"
          "def used():\n"
          "  u = resource.getrusage(resource.RUSAGE_SELF); return u.ru_utime + u.ru_stime\n"
          "for _ in range(3):\n"
          "  end = used() + 0.4\n"
          "  while used() < end: pass\n"
          "  sql_sandbox._cap_cpu(1.0)\n"
          "  print(used(), resource.getrlimit(resource.RLIMIT_CPU)[0])\n")
  out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True,
                       check=True).stdout
  limits = [(float(u), int(soft)) for u, soft in (line.split() for line in out.splitlines())]
  assert len(limits) == 3
  for used, soft in limits:
    assert used + 1.0 + 1.0 < soft <= used + 1.0 + 2.0 + 1e-9, (used, soft)
  assert limits[-1][1] >= limits[0][1] + 1  # it moved with the worker's use


def test_databases_of_a_killed_run_are_removed_by_the_next(tmp_path, monkeypatch):
  import signal
  import subprocess
  import sys
  import tempfile

  monkeypatch.setenv("TMPDIR", str(tmp_path))
  monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
  code = ("from jaxrl_agents import envs\n"
          "env = envs.make('text_to_sql', None, databases=1); env.database(0)\n"
          "print(env.dir, flush=True)\n"
          "import time; time.sleep(600)\n")
  child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": os.getcwd()})
  orphan = child.stdout.readline().strip()
  assert os.path.isdir(orphan) and orphan.startswith(str(tmp_path))
  live = envs.make("text_to_sql", None, databases=1)  # its owner lives: kept
  assert os.path.isdir(orphan)
  child.send_signal(signal.SIGKILL)
  child.wait()
  envs.make("text_to_sql", None, databases=1)
  assert not os.path.exists(orphan) and os.path.isdir(live.dir)
