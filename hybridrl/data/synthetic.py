"""Built-in synthetic tasks, written in verl's row schema, small enough for a tiny model on CPU.

Prompts are short and answers are bare (the model outputs only the answer, scored exactly by
``hybridrl.rewards.synthetic``), because the chat template already adds ~10 tokens and a
1-5M-parameter model learns short, exact formats fastest:

    hybridrl/addition   "12+345="        -> "357"
    hybridrl/reverse    "reverse 1234"   -> "4321"
    hybridrl/sort       "sort 5 3 9"     -> "3 5 9"
    countdown           TinyZero's prompt (numbers, target, <answer> tags) -> an equation

Every generator is a pure function of its arguments and ``seed``.
"""

from __future__ import annotations

import math
import random
import string
from typing import Any

INSTRUCTION_COUNTDOWN = (
    "Using the numbers {numbers}, create an equation that equals {target}. You can use basic arithmetic "
    "operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think> tags. "
    "And return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
)


def make_row(
    data_source: str, content: str, ground_truth: Any, solution: str, ability: str, split: str, index: int
) -> dict[str, Any]:
    """One row in verl's schema with a single user message; ``extra_info["solution"]`` is a response
    that scores 1.0 (the SFT target)."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "solution": solution},
    }


def _number(rng: random.Random, min_digits: int, max_digits: int) -> int:
    digits = rng.randint(min_digits, max_digits)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


QUESTION_ARITHMETIC = "What is {expression}? Reply with only the number."


def addition_example(rng: random.Random, min_digits: int = 1, max_digits: int = 3, num_operands: int = 2,
                     operator: str = "+", style: str = "bare"):
    """(prompt, ground truth, solution) for ``a+b(+c...)=`` (or ``*``); each operand has ``min_digits..max_digits`` digits.

    ``style="bare"`` asks ``12+345=`` (for models trained from scratch); ``style="question"`` asks
    ``What is 12 + 345? Reply with only the number.`` (for instruction-tuned models such as SmolLM2).
    Either way the answer is the bare number, scored by ``hybridrl.rewards.synthetic.addition_score``.
    """
    if not 1 <= min_digits <= max_digits or num_operands < 2:
        raise ValueError(f"addition needs 1 <= min_digits <= max_digits and num_operands >= 2, got "
                         f"{min_digits}, {max_digits}, {num_operands}")
    if operator not in ("+", "*") or style not in ("bare", "question"):
        raise ValueError(f"addition needs operator in ('+', '*') and style in ('bare', 'question'), got "
                         f"{operator!r}, {style!r}")
    operands = [_number(rng, min_digits, max_digits) for _ in range(num_operands)]
    value = sum(operands) if operator == "+" else math.prod(operands)
    if style == "bare":
        prompt = operator.join(map(str, operands)) + "="
    else:
        prompt = QUESTION_ARITHMETIC.format(expression=f" {operator} ".join(map(str, operands)))
    return prompt, str(value), str(value)


def reverse_example(rng: random.Random, min_len: int = 3, max_len: int = 6, alphabet: str = "digits"):
    """(prompt, ground truth, solution) for ``reverse <s>``; ``s`` has ``min_len..max_len`` digits or lowercase letters."""
    chars = {"digits": string.digits, "letters": string.ascii_lowercase}.get(alphabet)
    if chars is None or not 1 <= min_len <= max_len:
        raise ValueError(f"reverse needs alphabet in ('digits', 'letters') and 1 <= min_len <= max_len, got "
                         f"{alphabet!r}, {min_len}, {max_len}")
    s = "".join(rng.choice(chars) for _ in range(rng.randint(min_len, max_len)))
    return f"reverse {s}", s[::-1], s[::-1]


def sort_example(rng: random.Random, min_len: int = 3, max_len: int = 6, max_value: int = 9):
    """(prompt, ground truth, solution) for ``sort <numbers>``: ``min_len..max_len`` integers in ``[0, max_value]``."""
    if not 1 <= min_len <= max_len or max_value < 1:
        raise ValueError(f"sort needs 1 <= min_len <= max_len and max_value >= 1, got {min_len}, {max_len}, {max_value}")
    nums = [rng.randint(0, max_value) for _ in range(rng.randint(min_len, max_len))]
    answer = " ".join(map(str, sorted(nums)))
    return "sort " + " ".join(map(str, nums)), answer, answer


def countdown_example(rng: random.Random, min_numbers: int = 3, max_numbers: int = 4, max_number: int = 99):
    """(prompt, {"target", "numbers"}, "<answer>equation</answer>") with a target reachable by combining all numbers.

    The target comes from a random left-to-right expression over the numbers (``+ - *`` and exact
    ``/``, kept positive and preferably <= 10 * max_number), so every example is solvable with each
    number used exactly once.
    """
    if not 2 <= min_numbers <= max_numbers or max_number < 2:
        raise ValueError(f"countdown needs 2 <= min_numbers <= max_numbers and max_number >= 2, got "
                         f"{min_numbers}, {max_numbers}, {max_number}")
    numbers = [rng.randint(1, max_number) for _ in range(rng.randint(min_numbers, max_numbers))]
    value, expression = numbers[0], str(numbers[0])
    for n in numbers[1:]:
        options = {"+": value + n, "*": value * n}
        options.update({"-": value - n} if value > n else {})
        options.update({"/": value // n} if value % n == 0 else {})
        small = [op for op, v in options.items() if v <= 10 * max_number]  # targets in a human range
        op = rng.choice(small) if small else min(options, key=options.get)
        value, expression = options[op], f"({expression} {op} {n})"
    shown = rng.sample(numbers, len(numbers))
    prompt = INSTRUCTION_COUNTDOWN.format(numbers=shown, target=value)
    return prompt, {"target": value, "numbers": shown}, f"<answer>{expression[1:-1]}</answer>"


TASKS = {
    # name: (data_source, ability, example function)
    "addition": ("hybridrl/addition", "math", addition_example),
    "reverse": ("hybridrl/reverse", "algorithmic", reverse_example),
    "sort": ("hybridrl/sort", "algorithmic", sort_example),
    "countdown": ("countdown", "math", countdown_example),
}


def generate_splits(task: str, n_train: int, n_test: int, seed: int = 0, **knobs: Any) -> dict[str, list[dict]]:
    """``{"train": rows, "test": rows}`` for ``task``; test prompts never appear in train.

    ``knobs`` are the task's difficulty arguments (see the ``*_example`` functions).
    """
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; choose from {sorted(TASKS)}")
    data_source, ability, example = TASKS[task]
    rng = random.Random(seed)
    train = [example(rng, **knobs) for _ in range(n_train)]
    seen, test = {example[0] for example in train}, []
    for _ in range(50 * max(n_test, 1)):  # rejection sampling; bounded so a tiny task space cannot loop forever
        if len(test) == n_test:
            break
        drawn = example(rng, **knobs)
        if drawn[0] not in seen:
            seen.add(drawn[0])
            test.append(drawn)
    if len(test) < n_test:
        raise ValueError(f"{task}: only {len(test)} test prompts distinct from the {n_train} training ones; "
                         "raise the difficulty knobs or lower n/n_test")
    return {
        split: [make_row(data_source, p, gt, sol, ability, split, i) for i, (p, gt, sol) in enumerate(drawn)]
        for split, drawn in (("train", train), ("test", test))
    }
