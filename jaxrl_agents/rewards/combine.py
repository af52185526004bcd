"""Reward combinators: several rewards in, one total plus every component for logging.

Every combinator is called like a reward, `fn(completions, examples, **kwargs)`,
and returns `(total f32[B], components dict[str, f32[B]])` so that trainers
log each term. Components may be reward functions, registered reward names,
or other combinators (whose components are then logged as "name/part").
Keyword arguments (e.g. `lengths=` token counts) reach only the components
whose signature accepts them; one no component accepts is an error, not a
silent no-op.

* `combine` / `WeightedSum`: sum_m w_m r_m (ALGORITHMS.md 3.5).
* `from_config`: a `WeightedSum` from {registered name: weight or options}.
* `lexicographic`: a higher-priority term dominates every lower one
  ("OPTIAGENT"-style priorities).
* `gated`: a child term counts only when a parent passes (conditional gating,
  "ChatShopBuddy"), e.g. correctness only for well-formatted replies.

A config chooses how its rewards combine by name (config.reward_combinator, registry
kind "reward_combinator"): the `WeightedSum` of config.rewards in, one reward out,
the combinator's options keyword-only.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl_agents import registry

RewardFn = Callable[..., Any]
"""completions, examples, **options -> f32[B] (or (f32[B], dict) for a combinator)."""

# What a component may be given as: a callable, a registered name, or (log name, either).
ComponentSpec = RewardFn | str | tuple[str, RewardFn | str]


def _resolve(spec: ComponentSpec) -> tuple[str, RewardFn]:
  """(log name, callable) of a component given in any of the accepted forms."""
  if isinstance(spec, tuple):
    name, fn = spec
    return name, _resolve(fn)[1]
  if isinstance(spec, str):
    return spec, registry.get("reward", spec)
  if not callable(spec):
    raise TypeError(f"a reward component must be callable or a registered name, got {spec!r}")
  fn = getattr(spec, "func", spec)  # functools.partial keeps the function's name on .func
  return getattr(fn, "__name__", type(spec).__name__), spec


def _accepted_kwargs(fn: RewardFn) -> frozenset[str] | None:
  """Keyword names `fn` accepts after (completions, examples); None if it takes **kwargs."""
  if isinstance(fn, CombinedReward):
    return fn.accepted_kwargs
  try:
    params = list(inspect.signature(fn).parameters.values())
  except (TypeError, ValueError):  # builtins without a signature
    return frozenset()
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
    return None
  positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                inspect.Parameter.POSITIONAL_OR_KEYWORD)]
  skip = {p.name for p in positional[:2]}
  return frozenset(p.name for p in params
                   if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                 inspect.Parameter.KEYWORD_ONLY) and p.name not in skip)


class CombinedReward:
  """Base of the combinators: component bookkeeping, keyword forwarding and output checks."""

  def __init__(self, components: Sequence[tuple[str, RewardFn]]):
    if not components:
      raise ValueError("a combined reward needs at least one component")
    names = [name for name, _ in components]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
      raise ValueError(f"component names must be unique; repeated: {duplicates}")
    self._components = tuple(components)
    self._accepts = {name: _accepted_kwargs(fn) for name, fn in components}

  @property
  def names(self) -> tuple[str, ...]:
    """Component names, in order."""
    return tuple(name for name, _ in self._components)

  @property
  def components(self) -> tuple[tuple[str, RewardFn], ...]:
    """(name, reward) pairs, in order (to build another combinator from the same parts)."""
    return self._components

  @property
  def accepted_kwargs(self) -> frozenset[str] | None:
    """Keywords some component accepts; None if one takes arbitrary keywords."""
    if any(a is None for a in self._accepts.values()):
      return None
    return frozenset().union(*self._accepts.values())

  def _evaluate(self, completions: Sequence[str], examples: Sequence[Mapping[str, Any]] | None,
                kwargs: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """({name: f32[B]} component values, {"name/part": f32[B]} parts of nested combinators)."""
    accepted = self.accepted_kwargs
    if accepted is not None and set(kwargs) - accepted:
      raise TypeError(f"no reward component accepts keyword(s) {sorted(set(kwargs) - accepted)}; "
                      f"accepted: {sorted(accepted)}")
    batch = len(completions)
    values, parts = {}, {}
    for name, fn in self._components:
      accepts = self._accepts[name]
      own = {k: v for k, v in kwargs.items() if accepts is None or k in accepts}
      out = fn(completions, examples, **own)
      if isinstance(out, tuple):  # a nested combinator
        out, sub = out
        parts.update({f"{name}/{k}": np.asarray(v, np.float32) for k, v in sub.items()})
      value = np.asarray(out, dtype=np.float32)
      if value.shape != (batch,):
        raise ValueError(f"reward component {name!r} returned shape {value.shape}, "
                         f"expected ({batch},)")
      if not np.isfinite(value).all():
        # A NaN reward would silently poison every advantage of its group.
        bad = np.flatnonzero(~np.isfinite(value))[:5].tolist()
        raise ValueError(f"reward component {name!r} returned non-finite values at {bad}")
      values[name] = value
    return values, parts

  def __call__(self, completions: Sequence[str],
               examples: Sequence[Mapping[str, Any]] | None = None,
               **kwargs: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    raise NotImplementedError


class WeightedSum(CombinedReward):
  """total = sum_m w_m r_m; the logged components are the unweighted r_m.

  Args:
    components: {log name: (reward, weight)}; a reward is a callable, a
      registered name or a combinator.
  """

  def __init__(self, components: Mapping[str, tuple[RewardFn | str, float]]):
    resolved, weights = [], {}
    for name, spec in components.items():
      if not (isinstance(spec, tuple) and len(spec) == 2):
        raise TypeError(f"component {name!r} must be a (reward, weight) pair, got {spec!r}")
      fn, weight = spec
      resolved.append((name, _resolve(fn)[1]))
      weights[name] = _check_weight(name, weight)
    super().__init__(resolved)
    self.weights = weights

  def __call__(self, completions: Sequence[str],
               examples: Sequence[Mapping[str, Any]] | None = None,
               **kwargs: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(total f32[B], {name: f32[B]} unweighted components and nested parts)."""
    values, parts = self._evaluate(completions, examples, kwargs)
    total = np.zeros(len(completions), np.float32)
    for name, value in values.items():
      total += np.float32(self.weights[name]) * value
    return total, {**values, **parts}

  def __repr__(self) -> str:
    return f"WeightedSum({self.weights})"


class SumOfRewards:
  """The sum of rewards that each return (total f32[B], {name: f32[B]}), their components
  merged: verifiable rewards scored in a time-limited worker beside a learned one scored
  in-process. `last_timeouts` sums the parts' timeouts (`time_limit.timeouts`)."""

  def __init__(self, *parts):
    if len(parts) < 2:
      raise ValueError(f"SumOfRewards needs two or more rewards, got {len(parts)}")
    self.parts = parts

  def __call__(self, completions: Sequence[str],
               examples: Sequence[Mapping[str, Any]] | None = None,
               **kwargs: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    total = np.zeros(len(completions), np.float32)
    components: dict[str, np.ndarray] = {}
    for part in self.parts:
      part_total, part_components = part(completions, examples, **kwargs)
      clash = sorted(set(components) & set(part_components))
      if clash:
        raise ValueError(f"rewards {clash} appear in more than one part of a SumOfRewards")
      total += np.asarray(part_total, np.float32)
      components.update(part_components)
    return total, components

  @property
  def last_timeouts(self) -> int:
    return sum(int(getattr(part, "last_timeouts", 0)) for part in self.parts)

  def __repr__(self) -> str:
    return f"SumOfRewards{self.parts}"


def _check_weight(name: str, weight: Any) -> float:
  if isinstance(weight, bool) or not isinstance(weight, int | float | np.number):
    raise TypeError(f"weight of reward {name!r} must be a number, got {weight!r}")
  if not math.isfinite(weight):
    raise ValueError(f"weight of reward {name!r} must be finite, got {weight}")
  return float(weight)


def combine(components: Mapping[str, tuple[RewardFn | str, float]]) -> WeightedSum:
  """The weighted sum of `components` ({log name: (reward, weight)}); see `WeightedSum`."""
  return WeightedSum(components)


def from_config(spec: Mapping[str, Any]) -> WeightedSum:
  """A `WeightedSum` of registered rewards: {name: weight} or {name: {"weight": w, **options}}.

  ```
  from_config({"last_integer": 1.0, "short_reply": {"weight": 0.2, "max_chars": 20}})
  ```
  Options are bound with `functools.partial`; "weight" defaults to 1. Nested
  `ml_collections.ConfigDict` values are accepted.

  Raises:
    KeyError: an unknown reward name (the registered ones are listed) or an
      option the reward does not take (its options are listed).
  """
  if not spec:
    raise ValueError("from_config needs at least one reward")
  components = {}
  for name, value in spec.items():
    fn = registry.get("reward", name)  # KeyError listing the registered rewards
    if hasattr(value, "items"):  # a Mapping or a ConfigDict (which is not a Mapping)
      options = dict(value.items())
      weight = options.pop("weight", 1.0)
      if options:
        valid = _accepted_kwargs(fn)
        unknown = sorted(set(options) - valid) if valid is not None else []
        if unknown:
          raise KeyError(f"reward {name!r} has no option(s) {unknown}; options: "
                         f"{sorted(valid)} and 'weight'")
        fn = functools.partial(fn, **options)
    else:
      weight = value
    components[name] = (fn, weight)
  return WeightedSum(components)


class Lexicographic(CombinedReward):
  """A total ordered first by the first component, then by the second, and so on.

      total = sum_i w_i r_i / sum_i w_i,  w_{M-1} = 1,  w_i = (1 + sum_{j>i} w_j) / min_gap

  Every component must lie in [0, 1] (checked). If two replies' values of
  component i differ at all, they differ by at least `min_gap` (1 for
  pass/fail rewards), so w_i * min_gap = 1 + sum_{j>i} w_j exceeds the largest
  possible difference of all lower terms together: the higher term decides
  whenever it differs. For min_gap = 1 the weights are 2^(M-1-i). If a
  component takes values closer than `min_gap`, dominance does not hold for
  those pairs. The total lies in [0, 1].

  Args:
    components: (log name, reward) pairs, highest priority first; rewards as in `combine`.
    min_gap: smallest nonzero difference between values of every component but the last.
  """

  def __init__(self, components: Sequence[ComponentSpec], min_gap: float = 1.0):
    if not 0 < min_gap <= 1:
      raise ValueError(f"min_gap must be in (0, 1], got {min_gap}")
    super().__init__([_resolve(c) for c in components])
    weights = [1.0]
    for _ in range(len(self._components) - 1):
      weights.insert(0, (1.0 + sum(weights)) / min_gap)
    total = sum(weights)
    self.weights = dict(zip(self.names, (w / total for w in weights), strict=True))

  def __call__(self, completions: Sequence[str],
               examples: Sequence[Mapping[str, Any]] | None = None,
               **kwargs: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(total f32[B] in [0, 1], {name: f32[B]} components and nested parts)."""
    values, parts = self._evaluate(completions, examples, kwargs)
    total = np.zeros(len(completions), np.float64)
    for name, value in values.items():
      if (value < 0).any() or (value > 1).any():
        raise ValueError(f"lexicographic component {name!r} must lie in [0, 1], got values in "
                         f"[{value.min()}, {value.max()}]")
      total += self.weights[name] * value
    return total.astype(np.float32), {**values, **parts}


def lexicographic(components: Sequence[ComponentSpec], min_gap: float = 1.0) -> Lexicographic:
  """Higher-priority rewards dominate lower ones; see `Lexicographic`."""
  return Lexicographic(components, min_gap=min_gap)


class Gated(CombinedReward):
  """total = parent_weight * parent + child_weight * child * [parent >= threshold].

  The logged child is the counted (gated) value; its raw value is logged as
  "<child>/ungated", so one sees e.g. accuracy among badly formatted replies too.

  Args:
    parent: the gate (e.g. a format reward); a reward as in `combine`.
    child: counted only where the parent passes (e.g. correctness).
    threshold: the parent passes where its value is >= threshold.
    parent_weight: weight of the parent in the total (0 for a pure gate).
    child_weight: weight of the gated child.
  """

  def __init__(self, parent: ComponentSpec, child: ComponentSpec, *, threshold: float = 1.0,
               parent_weight: float = 1.0, child_weight: float = 1.0):
    parent_name, parent_fn = _resolve(parent)
    child_name, child_fn = _resolve(child)
    super().__init__([(parent_name, parent_fn), (child_name, child_fn)])
    self.parent, self.child = parent_name, child_name
    self.threshold = threshold
    self.parent_weight = _check_weight(parent_name, parent_weight)
    self.child_weight = _check_weight(child_name, child_weight)

  def __call__(self, completions: Sequence[str],
               examples: Sequence[Mapping[str, Any]] | None = None,
               **kwargs: Any) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(total f32[B], {parent, child (gated), child/ungated, and nested parts})."""
    values, parts = self._evaluate(completions, examples, kwargs)
    parent, child = values[self.parent], values[self.child]
    gated_child = np.where(parent >= self.threshold, child, np.float32(0.0))
    total = np.float32(self.parent_weight) * parent + np.float32(self.child_weight) * gated_child
    return total.astype(np.float32), {self.parent: parent, self.child: gated_child,
                                      f"{self.child}/ungated": child, **parts}


def gated(parent: ComponentSpec, child: ComponentSpec, *, threshold: float = 1.0,
          parent_weight: float = 1.0, child_weight: float = 1.0) -> Gated:
  """`child` counts only where `parent` passes; see `Gated`."""
  return Gated(parent, child, threshold=threshold, parent_weight=parent_weight,
               child_weight=child_weight)


# The configs' names (config.reward_combinator.name): config.rewards' WeightedSum -> one reward.


@registry.register("reward_combinator", "sum")
def weighted_sum(weighted: WeightedSum) -> RewardFn:
  """sum_m w_m r_m."""
  return weighted


@registry.register("reward_combinator", "lexicographic")
def by_priority(weighted: WeightedSum, *, min_gap: float = 1.0) -> RewardFn:
  """The first reward decides, then the second, ... (weights ignored; each in [0, 1])."""
  return lexicographic(list(weighted.components), min_gap=min_gap)


@registry.register("reward_combinator", "gated")
def gate_first(weighted: WeightedSum, *, threshold: float = 1.0) -> RewardFn:
  """w_0 r_0 + w_1 r_1 [r_0 >= threshold]: the second counts only where the first passes."""
  parts = list(weighted.components)
  if len(parts) != 2:
    raise ValueError(f"reward_combinator 'gated' needs exactly two rewards (gate first), "
                     f"got {list(weighted.weights)}")
  (gate, _), (child, _) = parts
  return gated(parts[0], parts[1], parent_weight=weighted.weights[gate],
               child_weight=weighted.weights[child], threshold=threshold)
