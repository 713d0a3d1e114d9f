"""Benchmark and training prompt loaders.

Data comes from a directory in the layout of ``shared/datasets`` (one folder per dataset),
given by ``--data-dir`` or ``$D3D_DATA_DIR``. Each loader returns ``Item``s whose ``messages``
go through the target's chat template. Benchmark-only files are never used for training.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

MATH_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."

BENCHMARKS = ("gsm8k", "math500", "aime25", "humaneval", "mbpp", "livecodebench", "mt_bench")
EXTRA = ("mt_bench_2turn",)  # MT-Bench with both turns (the target answers turn 1 first)
# file of each benchmark inside its folder (train sets live beside them)
FILES = {
    "gsm8k": "gsm8k/test.jsonl",
    "math500": "math500/test.jsonl",
    "aime25": "aime25/test.jsonl",
    "humaneval": "humaneval/test.jsonl",
    "mbpp": "mbpp/mbpp.jsonl",
    "livecodebench": "livecodebench/test.jsonl",
    "mt_bench": "mt_bench/question.jsonl",
    "mt_bench_2turn": "mt_bench/question.jsonl",
}
MBPP_TRAIN = range(601, 975)
MBPP_VALID = range(511, 601)


@dataclass
class Item:
    dataset: str
    id: str
    messages: list  # chat messages ending with a user turn
    meta: dict = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.messages[-1]["content"]


def data_dir(explicit: Optional[str] = None) -> Path:
    d = explicit or os.environ.get("D3D_DATA_DIR")
    if d:
        return Path(d)
    # default: the workplace's shared datasets beside the repo, if present
    here = Path(__file__).resolve().parents[2]  # the repo root
    for cand in (here.parent / "shared" / "datasets", here / "data"):
        if cand.is_dir():
            return cand
    raise FileNotFoundError("no data directory: pass --data-dir DIR or set D3D_DATA_DIR (layout of shared/datasets)")


def read_jsonl(path: Path) -> list:
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path} (expected the layout of shared/datasets)")
    rows = []
    with path.open(encoding="utf-8") as f:
        for ln, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                raise ValueError(f"{path}:{ln}: not valid JSON ({e})") from None
    return rows


def _user(text: str) -> list:
    return [{"role": "user", "content": text}]


def format_item(name: str, row: dict, idx: int) -> Optional[Item]:
    """One raw row -> Item with the benchmark's usual prompt format."""
    if name == "gsm8k":
        return Item(name, str(idx), _user(f"{row['question']}\n{MATH_SUFFIX}"))
    if name in ("math500", "aime25"):
        return Item(name, str(row.get("unique_id") or row.get("id") or idx), _user(f"{row['problem']}\n{MATH_SUFFIX}"))
    if name == "humaneval":
        txt = (
            "Complete the following Python function. Return the whole function in a fenced code block.\n\n"
            f"```python\n{row['prompt']}\n```"
        )
        return Item(name, row["task_id"], _user(txt))
    if name == "mbpp":
        tests = "\n".join(row.get("test_list") or [])
        txt = f"{row['text']}\nYour code should pass these tests:\n\n{tests}"
        return Item(name, str(row["task_id"]), _user(txt))
    if name == "livecodebench":
        txt = row["question_content"]
        if row.get("starter_code"):
            txt += f"\n\nUse this starter code:\n```python\n{row['starter_code']}\n```"
        else:
            txt += "\n\nRead the inputs from stdin, solve the problem and write the answer to stdout. Write Python in a fenced code block."
        return Item(name, row.get("question_id", str(idx)), _user(txt))
    if name == "mt_bench":
        return Item(name, str(row["question_id"]), _user(row["turns"][0]), {"category": row.get("category")})
    if name == "mt_bench_2turn":
        # second turn: the first answer is left for the caller to fill (meta), here a placeholder
        t = row["turns"]
        if len(t) < 2:
            return None
        # the assistant turn is the target's own answer to turn 1, filled in by the bench
        msgs = [
            {"role": "user", "content": t[0]},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": t[1]},
        ]
        return Item(name, str(row["question_id"]), msgs, {"category": row.get("category"), "needs_first_answer": True})
    raise ValueError(f"unknown dataset {name!r}; available: {', '.join(BENCHMARKS)}")


def load_benchmark(name: str, n: Optional[int] = None, seed: int = 0, root: Optional[str] = None) -> list:
    """Deterministic selection of n items (all when n is None): shuffled with `seed`."""
    if name not in FILES:
        raise ValueError(f"unknown dataset {name!r}; available: {', '.join(BENCHMARKS)}")
    rows = read_jsonl(data_dir(root) / FILES[name])
    if name == "mbpp":  # benchmark items only: not the train / validation ids
        rows = [r for r in rows if r["task_id"] not in MBPP_TRAIN and r["task_id"] not in MBPP_VALID]
    items = [it for i, r in enumerate(rows) if (it := format_item(name, r, i)) is not None]
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    if n is not None:
        order = order[:n]
    return [items[i] for i in order]


def prompt_items(spec: str, repeats: int = 1) -> list:
    """One prompt, ``repeats`` times (dataset ``prompt``): ``spec`` is the prompt itself, or ``@PATH`` of a text
    file holding it. The bench times it like a dataset, so a race on the same prompt can be checked against it."""
    text = spec
    if spec.startswith("@"):
        path = Path(spec[1:])
        if not path.is_file():
            raise FileNotFoundError(f"prompt file not found: {path}")
        text = path.read_text(encoding="utf-8")
    text = text.strip()
    if not text:
        raise ValueError("--prompt is empty")
    return [Item("prompt", f"r{i}", _user(text)) for i in range(max(1, repeats))]


def parse_datasets(spec: str) -> list:
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if names == ["all"]:
        return list(BENCHMARKS)
    bad = [n for n in names if n not in FILES]
    if bad:
        raise ValueError(f"unknown dataset(s) {', '.join(bad)}; available: {', '.join(BENCHMARKS + EXTRA)} or 'all'")
    return names


def load_training_prompts(root: Optional[str] = None) -> list:
    """Training prompts only: gsm8k train, mbpp train ids 601-974, the alpaca files."""
    d = data_dir(root)
    items = []
    for i, r in enumerate(read_jsonl(d / "gsm8k" / "train.jsonl")):
        items.append(Item("gsm8k-train", f"g{i}", _user(f"{r['question']}\n{MATH_SUFFIX}")))
    for r in read_jsonl(d / "mbpp" / "mbpp.jsonl"):
        if r["task_id"] in MBPP_TRAIN:
            it = format_item("mbpp", r, 0)
            it.dataset = "mbpp-train"
            items.append(it)
    for f in sorted((d / "alpaca").glob("*.jsonl")):
        for i, r in enumerate(read_jsonl(f)):
            txt = r["instruction"] + (f"\n\n{r['input']}" if r.get("input") else "")
            items.append(Item("alpaca", f"{f.stem}-{i}", _user(txt)))
    return items


def load_training_references(root: Optional[str] = None) -> list:
    """Human-written reference responses of the training files (gsm8k train answers, mbpp train
    code, alpaca outputs): text close to what the target writes, for a vocabulary shortlist when
    no self-distillation data is at hand. Never benchmark files."""
    d = data_dir(root)
    out = [r["answer"] for r in read_jsonl(d / "gsm8k" / "train.jsonl") if r.get("answer")]
    out += [r["code"] for r in read_jsonl(d / "mbpp" / "mbpp.jsonl") if r["task_id"] in MBPP_TRAIN and r.get("code")]
    for f in sorted((d / "alpaca").glob("*.jsonl")):
        out += [r["output"] for r in read_jsonl(f) if r.get("output")]
    return out
