"""Rewards: host functions scoring decoded completions against their task examples.

Every reward is `reward_fn(completions: Sequence[str], examples: Sequence[Mapping], **options)
-> f32[B]` (NumPy; rewards run outside jit) and raises ValueError naming the problem
when the batch is misaligned or an example lacks a field. Importing the package
registers them under kind "reward":

| name               | 1 when (else 0, unless stated)                                        |
|--------------------|-----------------------------------------------------------------------|
| math_strict        | the reply states its final answer explicitly and it equals "answer"   |
| math_lenient       | the boxed content, else the last number, equals "answer"              |
| last_integer       | the last integer written equals "answer"                              |
| format_boxed       | exactly one complete \\boxed{...}                                     |
| format_answer_only | the reply is only a number (whitespace and a final period allowed)    |
| short_reply        | len(reply) < max_chars (default 40)                                   |
| countdown          | a safe expression over "numbers" (each used once) equals "target"     |
| countdown_format   | an expression can be extracted and parsed                             |
| length_penalty     | -coef * max(0, length - budget) / budget (<= 0)                       |
| reward_model       | a trained reward model's score (`workdir`: its run; in-process)       |
| reasoning_gym      | the task's own scorer on the last <answer> tag (rewards/suites.py)    |
| reasoning_gym_lenient | the same, else on the reply's last line                            |
| multiple_choice    | the reply ends stating a letter A-D equal to "answer"                 |
| multiple_choice_lenient | the last standalone letter A-D equals "answer"                   |

`combine`, `from_config`, `lexicographic` and `gated` build rewards that return
`(total f32[B], {component: f32[B]})` for logging.
"""

from jaxrl_agents.rewards import answers, countdown, formatting, learned, length, suites
from jaxrl_agents.rewards.answers import (
    extract_boxed,
    last_integer,
    last_integer_reward,
    last_number,
    lenient_answer,
    math_lenient_reward,
    math_strict_reward,
    numbers_equal,
    parse_number,
    strict_answer,
)
from jaxrl_agents.rewards.combine import (
    CombinedReward,
    Gated,
    Lexicographic,
    SumOfRewards,
    WeightedSum,
    combine,
    from_config,
    gated,
    lexicographic,
)
from jaxrl_agents.rewards.countdown import (
    ExpressionError,
    ParsedExpression,
    countdown_format_reward,
    countdown_reward,
    evaluate_expression,
    extract_expression,
    parse_expression,
)
from jaxrl_agents.rewards.formatting import (
    format_answer_only_reward,
    format_boxed_reward,
    short_reply_reward,
)
from jaxrl_agents.rewards.length import length_penalty_reward

__all__ = [
    "CombinedReward",
    "ExpressionError",
    "Gated",
    "Lexicographic",
    "SumOfRewards",
    "ParsedExpression",
    "WeightedSum",
    "answers",
    "combine",
    "countdown",
    "countdown_format_reward",
    "countdown_reward",
    "evaluate_expression",
    "extract_boxed",
    "extract_expression",
    "formatting",
    "format_answer_only_reward",
    "format_boxed_reward",
    "from_config",
    "gated",
    "last_integer",
    "last_integer_reward",
    "last_number",
    "learned",
    "length",
    "length_penalty_reward",
    "lenient_answer",
    "lexicographic",
    "math_lenient_reward",
    "math_strict_reward",
    "numbers_equal",
    "parse_expression",
    "parse_number",
    "short_reply_reward",
    "strict_answer",
    "suites",
]
