"""The built-in tiny tokenizer: byte-level BPE trained offline on a fixed synthetic corpus.

Same code + same ``tokenizers`` version -> identical ``tokenizer.json`` bytes. Digits are split one per
pre-token before BPE (as Qwen2 does), so every digit is its own token and numbers are never merged:
this makes arithmetic much easier for a tiny model to learn. Special tokens follow ChatML:
``<|endoftext|>`` (id 0, pad), ``<|im_start|>`` (id 1), ``<|im_end|>`` (id 2, eos).
"""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, EOS_TOKEN]
TINY_VOCAB_SIZE = 1024
CORPUS_SEED = 1234

# ChatML as Qwen2 renders it, without a default system message (the data decides whether there is one).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = """
the a an and or of to in on at for with by from is are was were be been has have had do does did
it this that these those there here what which who how many much more less than then so if not no yes
one two three four five six seven eight nine ten hundred thousand half twice each every all some total
number numbers sum difference product quotient remainder answer question result equals equal plus minus
times divided multiply add subtract count sort reverse copy list sequence digit digits letter letters word
words first second third last next previous before after left right step steps think final solve problem
using create equation use only once basic arithmetic operations can make target value values given
apples oranges books pens cookies dollars cents money price cost buy sold sells bought pays paid spent
friends students class school day days week weeks month months year years hour hours minute minutes
she he they we you her his their our your him them people person boy girl man woman mother father
has gets gave takes took needs wants left more fewer altogether together remaining rest each per
rate speed distance miles meters kilograms liters percent fraction average twice third quarter
let us check verify therefore because since so thus correct wrong true false please assistant user
system helpful you are a output format reason carefully show work put inside tags box boxed
""".split()

_NAMES = "Natalia James Maria Tom Anna Ben Lucy Omar Priya Chen Sara Leo Mia Noah Ivy Sam".split()
_ITEMS = "apples books pens cookies marbles stickers cards shells eggs tickets".split()
_OPS = ["+", "-", "*", "/"]


def _arith_lines(rng: random.Random) -> list[str]:
    a, b = rng.randint(0, 999), rng.randint(1, 99)
    op = rng.choice(_OPS)
    c = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
    return [
        f"What is {a} {op} {b}?",
        f"{a}{op}{b}={c}",
        f"{a} {op} {b} = {c}. The answer is {c}.",
        f"<think>{a} {op} {b} = {c}</think> <answer>{c}</answer>",
        f"#### {c}",
        f"The final answer is \\boxed{{{c}}}.",
    ]


def _word_problem(rng: random.Random) -> str:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    x, y = rng.randint(2, 90), rng.randint(2, 90)
    return (
        f"{name} has {x} {item}. {name} buys {y} more {item}. How many {item} does {name} have now? "
        f"{name} has {x} + {y} = {x + y} {item}.\n#### {x + y}"
    )


def _list_task(rng: random.Random) -> str:
    nums = [rng.randint(0, 99) for _ in range(rng.randint(3, 6))]
    letters = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))
    return (
        f"Using the numbers {nums}, create an equation that equals {sum(nums)}. "
        f"You can use basic arithmetic operations (+, -, *, /) and each number can only be used once.\n"
        f"Sort the list {nums}: {sorted(nums)}. Reverse the word {letters}: {letters[::-1]}. "
        f"Copy: {letters}"
    )


def synthetic_corpus(seed: int = CORPUS_SEED, n_blocks: int = 600) -> list[str]:
    """The fixed training text: arithmetic, word problems, list/letter tasks, plain English, ChatML."""
    rng = random.Random(seed)
    lines: list[str] = []
    for _ in range(n_blocks):
        lines += _arith_lines(rng)
        lines.append(_word_problem(rng))
        lines.append(_list_task(rng))
        words = rng.sample(_WORDS, 12)
        lines.append(" ".join(words).capitalize() + ".")
        lines.append(f"{IM_START}user\n{' '.join(words[:6])}?{EOS_TOKEN}\n{IM_START}assistant\n")
    lines.append(" ".join(_WORDS))
    lines.append("You are a helpful assistant. Let's think step by step.")
    return lines


def build_tiny_tokenizer(
    vocab_size: int = TINY_VOCAB_SIZE, padding_side: str = "left"
) -> PreTrainedTokenizerFast:
    """Train the tiny byte-level BPE tokenizer in memory (about a second) and wrap it for transformers."""
    tok = Tokenizer(models.BPE())
    # Digits first, one per pre-token, so BPE can never merge them; then GPT-2 style byte-level split.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        padding_side=padding_side,
        model_max_length=4096,
    )
    hf_tok.chat_template = CHATML_TEMPLATE
    return hf_tok


def save_tiny_tokenizer(out_dir: str | Path) -> Path:
    """Train and save the tiny tokenizer with ``save_pretrained``; ``AutoTokenizer`` reloads it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer().save_pretrained(out)
    return out
