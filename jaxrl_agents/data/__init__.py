"""Task data: TFDS builders for the project's tasks, JSONL prompt files, grain loaders.

```
from jaxrl_agents import data

source = data.load_task("arithmetic/mixed", "train")   # prepared on first use
it = data.make_loader(source, batch_size=8, seed=0)
batch = next(it)                                       # list of 8 example dicts
it.get_state()                                         # JSON-able; set_state resumes
```
Builders (no TensorFlow needed; array_record files read as random-access sources):
- "arithmetic": add1, sub1, add2, sub2, mul_table, mixed (see `arithmetic`).
- "countdown": n3, n4, mixed (see `countdown`).
"""

from jaxrl_agents.data.arithmetic import Arithmetic, ArithmeticConfig
from jaxrl_agents.data.countdown import Countdown, CountdownConfig
from jaxrl_agents.data.jsonl import load_jsonl
from jaxrl_agents.data.loader import make_loader, num_batches, padded_batches
from jaxrl_agents.data.prompts import format_prompts
from jaxrl_agents.data.tasks import (
    BUILDERS,
    TaskSource,
    default_data_dir,
    load_task,
    prepare,
    task_names,
)

__all__ = [
    "BUILDERS",
    "Arithmetic",
    "ArithmeticConfig",
    "Countdown",
    "CountdownConfig",
    "TaskSource",
    "default_data_dir",
    "format_prompts",
    "load_jsonl",
    "load_task",
    "make_loader",
    "num_batches",
    "padded_batches",
    "prepare",
    "task_names",
]
