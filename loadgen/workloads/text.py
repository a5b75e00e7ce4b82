"""Deterministic filler text and the prompt-size estimate every workload budgets with."""
from __future__ import annotations

import random
from pathlib import Path

from loadgen.errors import UsageError

WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government number "
    "night point home water room mother area money story fact month lot right study book eye job word "
    "business issue side kind head house service friend father power hour game line end member law car "
    "city community name president team minute idea kid body information back parent face others level "
    "office door health person art war history party result change morning reason research girl guy "
    "moment air teacher force education foot boy age policy music market sense nation plan college "
    "interest death experience effect class control care field development role effort rate heart drug "
    "show leader light voice wife police mind price report decision son view relationship town road "
    "arm difference value building action model season society tax director position player record "
    "paper space ground form event official matter center couple site project activity star table need "
    "court oil situation cost industry figure street image phone data picture practice piece land "
    "product doctor wall patient worker news test movie north love support technology step baby "
    "computer type attention film tree source organization hair window evidence population site "
    "ask find give tell become leave feel bring begin keep hold write stand hear mean meet include "
    "continue set learn lead understand watch follow stop create speak read allow add spend grow open "
    "walk win offer remember consider appear buy wait serve send expect build stay fall cut reach "
    "remain suggest raise pass sell require decide return explain hope develop carry break receive "
    "good new first last long great little own other old big high different small large next early "
    "young important few public bad same able late hard major better economic strong possible whole "
    "free military true federal international full special easy clear recent certain personal open "
    "red difficult available likely short single medical current wrong private past foreign fine "
    "common poor natural significant similar hot dead central happy serious ready simple left physical"
).split()


def estimate_tokens(text: str, chars_per_token: float) -> int:
    return int(len(text) / chars_per_token) + 1


def content_text(content) -> str:
    """A message's text, whether its content is a string or a list of {"type": "text"} parts."""
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def estimate_chat_tokens(messages, chars_per_token: float) -> int:
    """Content estimate plus a few tokens per message for the chat template's markers."""
    return sum(estimate_tokens(content_text(m["content"]), chars_per_token) + 5 for m in messages) + 3


def sentence(rng: random.Random, min_words: int = 6, max_words: int = 16) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))]
    return " ".join(words).capitalize() + "."


def paragraph(rng: random.Random, chars: int) -> str:
    """Sentences cut to about `chars` characters (at a word boundary)."""
    out: list[str] = []
    size = 0
    while size < chars:
        s = sentence(rng)
        out.append(s)
        size += len(s) + 1
    return truncate_words(" ".join(out), chars)


def question(rng: random.Random) -> str:
    opener = rng.choice(("What does the text say about", "Why is there", "How does the", "Summarize what happens to the",
                         "Who is responsible for the", "When did the", "List the facts about the"))
    return f"{opener} {rng.choice(WORDS)} {rng.choice(WORDS)} {rng.choice(WORDS)}?"


def truncate_words(text: str, chars: int) -> str:
    """At most `chars` characters, cut at a word boundary."""
    if len(text) <= chars:
        return text
    cut = text.rfind(" ", 0, chars)
    return text[: cut if cut > 0 else chars]


def load_documents(path: Path) -> list[str]:
    """One document per non-empty line (the Lee corpus format), or blank-line separated paragraphs."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    lines = [ln.strip() for ln in text.splitlines()]
    docs = [ln for ln in lines if ln]
    if len(docs) < 2 and "\n\n" in text:
        docs = [p.strip() for p in text.split("\n\n") if p.strip()]
    return docs


def document_question(name: str, system: str, body: str, cfg) -> tuple[dict, dict]:
    """A reader's chat (system instructions, then the document and its question as the user turn), refused
    with a UsageError when it would not fit --max-prompt-tokens."""
    messages = ({"role": "system", "content": system}, {"role": "user", "content": body})
    size = estimate_chat_tokens(messages, cfg.chars_per_token)
    if size > cfg.max_prompt_tokens:
        raise UsageError(f"{name}: prompts of ~{size} tokens exceed --max-prompt-tokens {cfg.max_prompt_tokens}; "
                         "lower --doc-tokens")
    return messages
