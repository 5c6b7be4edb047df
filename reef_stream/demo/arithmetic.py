"""The demo task's text side: its vocabulary, its problems and its reward. No torch.

``reef_stream.demo.task`` (the policy, sampling, the evaluator) imports all of this and
exports it as its own; it lives here so that a sandbox worker running the demo's reward
(``reef reward --sandbox process``) imports the reward alone, without torch
(``reef_stream.consumers.reward.sandbox.reference``): ``exact_match`` is ``reef_stream.demo.arithmetic:exact_match``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from reef_stream.api.rewards import Reward
from reef_stream.core.events import Generation

__all__ = [
    "BOS", "DIGIT_TOKENS", "EOS", "PAD", "PROMPT_LEN", "VOCABULARY", "VOCAB_SIZE", "ExactMatch",
    "Problem", "decode", "encode", "exact_match", "parse_prompt",
]

# --------------------------------------------------------------------------- vocabulary

#: Token id -> text. Ids 0-2 are special; the digits are ids 3-12.
VOCABULARY: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", *"0123456789", "+", "=")
VOCAB_SIZE = len(VOCABULARY)
PAD, BOS, EOS = 0, 1, 2
_IDS = {text: i for i, text in enumerate(VOCABULARY)}
#: The token id of each digit 0-9, in order.
DIGIT_TOKENS: tuple[int, ...] = tuple(_IDS[d] for d in "0123456789")

#: ``<bos>a+b=``.
PROMPT_LEN = 5

def encode(text: str) -> np.ndarray:
    """``int32[len(text)]``: the token ids of ``text`` (digits, ``+``, ``=``; no special
    tokens). Raises ``ValueError`` naming a character outside the vocabulary."""
    try:
        return np.array([_IDS[ch] for ch in text], dtype=np.int32)
    except KeyError as error:
        raise ValueError(f"{error.args[0]!r} is not in the demo vocabulary") from None

def decode(token_ids: Sequence[int] | np.ndarray) -> str:
    """The text of ``token_ids`` (special tokens appear as ``<pad>``, ``<bos>``, ``<eos>``; an
    id outside the vocabulary as ``<unk>``)."""
    return "".join(VOCABULARY[i] if 0 <= i < VOCAB_SIZE else "<unk>"
                   for i in (int(t) for t in token_ids))

# --------------------------------------------------------------------------- problems

@dataclass(frozen=True, slots=True)
class Problem:
    """One prompt ``a+b=`` (``a``, ``b``: digits 0-9) and its answer, the last digit of
    ``a + b``."""

    a: int
    b: int

    def __post_init__(self) -> None:
        if not (0 <= self.a <= 9 and 0 <= self.b <= 9):
            raise ValueError(f"operands are digits 0-9, not {self.a} and {self.b}")

    @property
    def text(self) -> str:
        """``"3+9="``: the prompt without ``<bos>``; also its ``prompt_id``."""
        return f"{self.a}+{self.b}="

    @property
    def prompt_id(self) -> str:
        return self.text

    @property
    def answer(self) -> str:
        """The expected completion text: one digit (``"2"`` for ``3+9=``)."""
        return str((self.a + self.b) % 10)

    @property
    def answer_token(self) -> int:
        return DIGIT_TOKENS[(self.a + self.b) % 10]

    @property
    def token_ids(self) -> np.ndarray:
        """``int32[PROMPT_LEN]``: ``<bos>`` then the prompt."""
        return np.concatenate([np.array([BOS], dtype=np.int32), encode(self.text)])

def parse_prompt(token_ids: Sequence[int] | np.ndarray) -> Problem:
    """The ``Problem`` whose ``token_ids`` these are; ``ValueError`` saying what is wrong when
    they are not a prompt of this task."""
    ids = [int(t) for t in token_ids]
    text = decode(ids[1:])
    if (len(ids) != PROMPT_LEN or ids[0] != BOS or len(text) != 4 or not text[0].isdigit()
            or text[1] != "+" or not text[2].isdigit() or text[3] != "="):
        raise ValueError(f"{decode(ids)!r} is not a demo prompt (<bos>a+b= with digits a, b)")
    return Problem(int(text[0]), int(text[2]))

# --------------------------------------------------------------------------- reward

@dataclass(frozen=True, slots=True)
class ExactMatch:
    """The task's ``RewardFunction``: 1.0 when the completion is exactly the answer to the
    prompt (read back from the prompt's tokens), else 0.0; component ``exact_match`` the same.

    Pure, quick, idempotent; does not block. Raises ``ValueError`` for a generation whose
    prompt is not a prompt of this task (the reward worker dead-letters it).
    """

    source: str = "exact_match"

    def __call__(self, generation: Generation) -> Reward:
        problem = parse_prompt(generation.prompt_token_ids)
        completion = decode(generation.completion_token_ids).removesuffix(VOCABULARY[EOS])
        reward = 1.0 if completion == problem.answer else 0.0
        return Reward(reward=reward, components={"exact_match": reward})

#: The reward function to give a recipe: ``Recipe(..., reward=exact_match)``.
exact_match = ExactMatch()

