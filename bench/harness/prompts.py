"""The benches' prompts: ordinary text, which the demo tokenizer splits roughly into words."""

from __future__ import annotations

PROMPTS = (
    "Summarize the following contract clause about liability and indemnification for a client who",
    "Translate this sentence into English and explain the grammar of each verb form it uses, then",
    "Classify the intent of the customer message below as refund, complaint, question or praise:",
    "Write a short story about a lighthouse keeper who finds a message in a bottle on the shore and",
)


def make_prompt(i: int, words: int) -> str:
    """Prompt i (mod 4) lengthened with the others' words to exactly `words` words."""
    base = PROMPTS[i % len(PROMPTS)].split()
    filler = " ".join(PROMPTS).split()
    return " ".join((base + filler * (words // len(filler) + 1))[:words])
