"""Generate the embedded training corpus (``corpus.txt``): English-like prose from a small seeded grammar.

The text is synthetic, so it has no licence questions and is identical on every machine. Regenerate with
``python -m crosstrain.data.generate_corpus`` (writes next to this file); the output is deterministic.
"""

from __future__ import annotations

import random
from pathlib import Path

NAMES = ["Ada", "Bram", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kaia", "Leo",
         "Mira", "Nils", "Olga", "Pavel", "Quinn", "Rosa", "Sami", "Tove"]
PLACES = ["the harbour", "the old mill", "the market", "the library", "the river bank", "the north field",
          "the station", "the lighthouse", "the orchard", "the workshop", "the village square", "the forest edge"]
NOUNS = ["lantern", "letter", "boat", "garden", "clock", "bridge", "window", "basket", "map", "engine", "kettle",
         "song", "storm", "ladder", "compass", "bicycle", "notebook", "candle", "fence", "wagon"]
ADJS = ["small", "quiet", "bright", "heavy", "old", "curious", "gentle", "broken", "careful", "distant", "warm",
        "narrow", "patient", "silver", "crooked", "early", "tired", "clever", "green", "hollow"]
VERBS_T = [("found", "find"), ("carried", "carry"), ("repaired", "repair"), ("painted", "paint"),
           ("opened", "open"), ("watched", "watch"), ("borrowed", "borrow"), ("cleaned", "clean"),
           ("followed", "follow"), ("measured", "measure"), ("sold", "sell"), ("built", "build")]
VERBS_I = ["waited", "laughed", "listened", "walked home", "slept", "worked late", "sang quietly", "hesitated",
           "looked around", "stayed silent"]
TIMES = ["in the morning", "after supper", "before dawn", "on Sunday", "at noon", "late in the evening",
         "during the rain", "when the bells rang", "in early spring", "on the first cold day"]
ADVS = ["slowly", "gladly", "carefully", "at once", "again", "without a word", "with great care", "once more"]
WEATHER = ["The wind turned cold", "A light rain began to fall", "The sun came out over the hills",
           "Fog rolled in from the sea", "The sky was clear and pale", "Snow covered the roofs"]
CONNECT = ["Then", "Later", "Soon", "Afterwards", "Meanwhile", "By then", "At last", "Still"]
SAYINGS = ["we should go now", "the work is almost done", "nobody saw it coming", "this will take all day",
           "it is better to wait", "the answer was here all along", "tomorrow will be easier"]


def _np(rng: random.Random) -> str:
    det = rng.choice(["the", "a", "her", "his", "their"])
    noun = rng.choice(NOUNS)
    phrase = f"{rng.choice(ADJS)} {noun}" if rng.random() < 0.6 else noun
    if det == "a" and phrase[0] in "aeiou":
        det = "an"
    return f"{det} {phrase}"


def _sentence(rng: random.Random) -> str:
    who = rng.choice(NAMES)
    kind = rng.randrange(8)
    if kind == 0:
        s = f"{who} {rng.choice(VERBS_T)[0]} {_np(rng)} {rng.choice(TIMES)}."
    elif kind == 1:
        s = f"{rng.choice(CONNECT)} {who} {rng.choice(VERBS_I)} near {rng.choice(PLACES)}."
    elif kind == 2:
        other = rng.choice(NAMES)
        s = f'"{rng.choice(SAYINGS).capitalize()}," said {who} to {other}.'
    elif kind == 3:
        s = f"{rng.choice(WEATHER)}, and {who} {rng.choice(VERBS_T)[0]} {_np(rng)} {rng.choice(ADVS)}."
    elif kind == 4:
        past, base = rng.choice(VERBS_T)
        s = f"{who} wanted to {base} {_np(rng)}, but {rng.choice(NAMES)} {rng.choice(VERBS_I)}."
    elif kind == 5:
        count = rng.randrange(2, 13)
        s = f"There were {count} {rng.choice(NOUNS)}s at {rng.choice(PLACES)}, and each one was {rng.choice(ADJS)}."
    elif kind == 6:
        s = f"When {who} reached {rng.choice(PLACES)}, {_np(rng)} was already {rng.choice(ADJS)}."
    else:
        s = f"{_np(rng).capitalize()} stood by {rng.choice(PLACES)} {rng.choice(TIMES)}."
    return s


def generate(n_bytes: int = 600_000, seed: int = 1234) -> str:
    """Paragraphs of 3-7 sentences, with occasional chapter headings, until ``n_bytes`` characters."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    chapter = 0
    while size < n_bytes:
        if rng.random() < 0.03 or chapter == 0:
            chapter += 1
            heading = f"Chapter {chapter}: The {rng.choice(ADJS).capitalize()} {rng.choice(NOUNS).capitalize()}\n\n"
            parts.append(heading)
            size += len(heading)
        para = " ".join(_sentence(rng) for _ in range(rng.randrange(3, 8))) + "\n\n"
        parts.append(para)
        size += len(para)
    return "".join(parts)


def main() -> None:
    out = Path(__file__).with_name("corpus.txt")
    out.write_text(generate(), encoding="ascii")
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
