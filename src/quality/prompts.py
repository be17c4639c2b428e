"""The fixed prompt set the quality benchmark scores every engine on: token ids of the model's own tokenizer.

Kinds, so that short and long, chat and workflow prompts are all measured:

- ``chat``: one short user question through the model's chat template (its default system prompt);
- ``instruction``: a task to do (rewrite, list, translate, write code), some with a paragraph to work on;
- ``multi_turn``: two or three user turns with the assistant's earlier answers written in;
- ``system``: a question under a system prompt of its own;
- ``rag`` and ``long``: given by the caller (``TextSource``): the bench builds them from its corpus as the
  ``naive_rag`` workflow's templates render them (``headrace.bench.quality_prompts``), so this module needs no
  layer above ``plugins``.

Everything is fixed: the same tokenizer gives the same ids, and ``PromptSet.digest`` (a hash of every prompt's
kind and ids) names the set in results and in the reference's cache key. ``subset(n)`` takes every kind in turn, so
a small set stays varied.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from headrace.plugins.engines.llm.chat import apply_template

KINDS = ("chat", "instruction", "multi_turn", "system", "rag", "long")

SHORT_QUESTIONS = (
    "Why is the sky blue?", "What is photosynthesis?", "How do vaccines work?", "What causes the seasons on Earth?",
    "What is the capital of Australia?", "How many legs does a spider have?", "Who wrote Pride and Prejudice?",
    "What is the boiling point of water at sea level?", "Why do cats purr?", "What is a prime number?",
    "How does a rainbow form?", "What is the difference between weather and climate?", "What does DNA stand for?",
    "How far is the Moon from the Earth?", "Why do leaves change colour in autumn?", "What is inflation?",
    "How does a compass work?", "What is the largest ocean?", "What is gravity?", "Why is the ocean salty?",
    "What is a black hole?", "How do bees make honey?", "What is the speed of light?", "Who painted the Mona Lisa?",
    "What is machine learning?", "How does the heart pump blood?", "What is the tallest mountain in the world?",
    "Why do we dream?", "What is an atom made of?", "How do plants drink water?", "What is a haiku?",
    "What language is spoken in Brazil?", "How do airplanes stay in the air?", "What is the water cycle?",
    "Why do onions make people cry?", "What is a noun?", "How many continents are there?",
    "What is the main ingredient of guacamole?", "What does a mill race carry?", "What is recursion?",
    "How do I boil an egg?", "Is a tomato a fruit or a vegetable?", "What is 17 times 3?",
    "What is the square root of 144?", "Hi! How are you today?", "Can you recommend a good book?",
    "What is the opposite of generous?", "What time zone is London in?", "Why do we have leap years?",
    "What is an API?", "How do I make my tea less bitter?", "What is the smallest planet in the solar system?",
    "What is a sonnet?", "How do magnets work?", "What is the function of the liver?", "Tell me a fun fact.",
    "What is a verb?", "Why is exercise good for you?", "What is the chemical symbol for gold?",
    "How long does it take light from the Sun to reach Earth?", "What is a sluice gate?",
    "What is the difference between a lake and a pond?",
)

PARAGRAPHS = (
    "The mill stood at the bend of the river. Water was led from a weir upstream along a narrow channel, the "
    "headrace, to the wheel, and returned to the river through the tailrace. In dry summers the miller closed the "
    "sluice at night so that the pond could fill again by morning.",
    "Our team moved the nightly build from a single large server to a pool of small machines. Builds now start "
    "within a minute of a commit instead of waiting for the evening, but the test suite became flaky because two "
    "tests share a temporary directory.",
    "Honey bees collect nectar from flowers and store it in their honey stomach. Back at the hive they pass it to "
    "other workers, who reduce its water content by fanning their wings until it thickens into honey, then seal "
    "it in wax cells.",
    "The library will close at six on weekdays from next month. Members may still return books through the slot "
    "by the front door at any hour, and the reading room will stay open until eight on Thursdays for exam season.",
    "A cache keeps recently used data close to where it is needed. When the cache is full, something must be "
    "removed; the least recently used entry is a common choice because what was used long ago is less likely to "
    "be used again soon.",
)

INSTRUCTIONS = (
    "Write a haiku about autumn rain.", "List three uses for a paperclip.",
    "Write a two-sentence story about a lighthouse keeper.", "Give me five names for a grey kitten.",
    "Translate into French: Where is the train station?", "Translate into Spanish: I would like a cup of coffee.",
    "Write a Python function that returns the sum of a list of numbers.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a for loop is to a ten-year-old.", "Write a short thank-you note to a neighbour who fed my cat.",
    "Suggest a healthy breakfast for a busy morning.", "Write a limerick about a forgetful robot.",
    "Give three tips for sleeping better.", "Describe the colour green without using the word green.",
    "Write an email asking my manager for a day off on Friday.", "Convert 5 kilometres to miles and explain how.",
    "Name four countries in Africa and their capitals.",
    "Write a SQL query that counts the rows of a table called users.",
    "Make a packing list for a weekend camping trip.", "Rewrite this sentence more politely: Give me the report now.",
    "Write a slogan for a bicycle shop.", "Explain the rules of tic-tac-toe in three sentences.",
    "Write a recipe for a simple tomato soup.", "Give an example of a metaphor and explain it.",
    "Write a JSON object describing a book with a title, an author and a year.",
)

PARAGRAPH_TASKS = (
    "Summarize this paragraph in one sentence:\n\n{p}",
    "Give this paragraph a short title:\n\n{p}",
    "List the main facts in this paragraph as bullet points:\n\n{p}",
    "Rewrite this paragraph for a young child:\n\n{p}",
    "What question does this paragraph answer?\n\n{p}",
)

# (first question, the assistant's answer, the follow-up[, a second answer, a third question])
CONVERSATIONS = (
    ("What is a headrace?", "A headrace is the channel that carries water from a river or pond to a water wheel.",
     "And what is the tailrace?"),
    ("Can you suggest a name for my dog?", "How about Biscuit, Pepper or Juniper?", "Something more serious, please."),
    ("What is 12 plus 30?", "12 plus 30 is 42.", "Now multiply that by 2."),
    ("Who was Ada Lovelace?", "Ada Lovelace was a mathematician who wrote the first published algorithm for "
     "Charles Babbage's Analytical Engine.", "Why is she called the first programmer?"),
    ("I want to learn to cook.", "Great! Start with simple dishes such as omelettes, pasta and soups.",
     "Which of those is easiest?"),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo.", "What is its population?"),
    ("Translate 'good morning' into German.", "'Good morning' in German is 'Guten Morgen'.",
     "And 'good night'?"),
    ("What is a list in Python?", "A list is an ordered, mutable collection of items, written in square brackets.",
     "How do I add an item to it?", "Use the append method: my_list.append(item).", "And how do I remove one?"),
    ("Recommend a film for tonight.", "You might enjoy Spirited Away, an animated fantasy by Studio Ghibli.",
     "Is it suitable for children?"),
    ("What causes thunder?", "Thunder is the sound of air expanding rapidly when lightning heats it.",
     "Why do we see the lightning first?"),
    ("How do I keep basil alive?", "Give it plenty of sun, water it when the soil feels dry, and pinch off flowers.",
     "How often should I water it?"),
    ("What is a mortgage?", "A mortgage is a loan used to buy property, secured on that property.",
     "What happens if I miss a payment?"),
    ("Write a word that rhymes with cat.", "Hat.", "Now one that rhymes with orange.",
     "Very few words rhyme with orange; 'door hinge' is a near rhyme.", "Ha! Give me another near rhyme."),
    ("What is the tallest animal?", "The giraffe is the tallest animal, up to about 5.5 metres.",
     "How long is its neck?"),
    ("Tell me about the Moon.", "The Moon is Earth's only natural satellite, about 384,000 km away.",
     "Has anyone walked on it?"),
)

SYSTEM_PROMPTS = (
    "You are a terse assistant. Answer in one sentence.",
    "You are a friendly tutor for children. Use simple words.",
    "You are a pirate. Always answer like a pirate.",
    "You are a careful software engineer who explains trade-offs.",
    "You answer only with a list of bullet points.",
)
SYSTEM_QUESTIONS = (
    "What is the best way to learn a language?", "How does a computer store numbers?",
    "Why should I drink water?", "What is a database index?",
)


@dataclass(frozen=True)
class ChatSource:
    """A prompt as chat messages, rendered by the model's chat template (assistant turn opened)."""

    kind: str
    messages: tuple[Mapping[str, str], ...]


@dataclass(frozen=True)
class TextSource:
    """A prompt as text already framed (a workflow's template in the chat frame), tokenized as the workflow
    tokenizes it (no special tokens added); ``prefix``: the text a workflow could prefill first (its natural fork
    point), empty for none."""

    kind: str
    text: str
    prefix: str = ""


@dataclass(frozen=True)
class QualityPrompt:
    id: str
    kind: str
    tokens: tuple[int, ...]
    split: int  # a natural fork point: the parent holds tokens[:split], the child the rest (1 <= split < len)
    messages: tuple[Mapping[str, str], ...] | None = None  # a chat's messages (to check an engine's template)
    text: str | None = None  # a text prompt's text (to check an engine's tokenizer)

    def pieces(self) -> tuple[int, int]:
        """Two cut points other than ``split`` (about a third and two thirds in): the numeric floor's pieces."""
        n = len(self.tokens)
        cuts = []
        for cut in (n // 3, 2 * n // 3):
            cut = max(1, min(n - 1, cut))
            while cut in cuts or cut == self.split:
                cut = cut + 1 if cut + 1 < n else cut - 1
            cuts.append(cut)
        a, b = sorted(cuts)
        return a, b


@dataclass(frozen=True)
class PromptSet:
    prompts: tuple[QualityPrompt, ...]
    digest: str = field(init=False)
    index: dict[str, int] = field(init=False, repr=False, compare=False)  # id -> position

    def __post_init__(self) -> None:
        h = hashlib.sha256()
        for p in self.prompts:
            h.update(json.dumps([p.kind, list(p.tokens), p.split]).encode())
        object.__setattr__(self, "digest", h.hexdigest()[:16])
        object.__setattr__(self, "index", {p.id: i for i, p in enumerate(self.prompts)})

    def __len__(self) -> int:
        return len(self.prompts)

    def __iter__(self):
        return iter(self.prompts)

    def subset(self, n: int) -> "PromptSet":
        """``n`` prompts, every kind in turn (in their order within a kind): a small set stays varied."""
        if n >= len(self.prompts):
            return self
        by_kind: dict[str, list[QualityPrompt]] = {}
        for p in self.prompts:
            by_kind.setdefault(p.kind, []).append(p)
        queues = [list(v) for v in by_kind.values()]
        out: list[QualityPrompt] = []
        while len(out) < n:
            for q in queues:
                if q and len(out) < n:
                    out.append(q.pop(0))
        order = {p.id: i for i, p in enumerate(self.prompts)}
        return PromptSet(tuple(sorted(out, key=lambda p: order[p.id])))

    def kinds(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.prompts:
            out[p.kind] = out.get(p.kind, 0) + 1
        return out

    def check_engine(self, engine: Any) -> list[str]:
        """The prompts whose ids ``engine`` (its ``chat_tokens`` and ``encode``) would make otherwise: the set is
        scored as token ids, so an engine with another tokenizer would be scored on prompts it never sees."""
        bad = []
        for p in self.prompts:
            made = engine.chat_tokens(list(p.messages)) if p.messages is not None else engine.encode(p.text)
            if tuple(made) != p.tokens:
                bad.append(p.id)
        return bad


def chat_sources() -> list[ChatSource]:
    """The built-in chat prompts, in a fixed order: 62 short questions, 50 instructions, 30 conversations and 20
    system prompts."""
    out = [ChatSource("chat", ({"role": "user", "content": q},)) for q in SHORT_QUESTIONS]
    tasks = list(INSTRUCTIONS) + [t.format(p=p) for t in PARAGRAPH_TASKS for p in PARAGRAPHS]
    out += [ChatSource("instruction", ({"role": "user", "content": t},)) for t in tasks]
    for turns in CONVERSATIONS:
        out.append(_conversation(turns))
    for turns in CONVERSATIONS:  # a second prompt each: an earlier turn of it, or another follow-up
        out.append(_conversation(turns[:3] if len(turns) > 3 else turns[:2] + (FOLLOW_UP,)))
    for system in SYSTEM_PROMPTS:
        for q in SYSTEM_QUESTIONS:
            out.append(ChatSource("system", ({"role": "system", "content": system}, {"role": "user", "content": q})))
    return out


FOLLOW_UP = "Can you explain that more simply?"


def _conversation(turns: tuple[str, ...]) -> ChatSource:
    roles = ["user", "assistant"] * len(turns)
    return ChatSource("multi_turn", tuple({"role": r, "content": c} for r, c in zip(roles, turns)))


def build_prompt_set(tokenizer: Any, extra: Iterable[ChatSource | TextSource] = (),
                     chats: Iterable[ChatSource] | None = None) -> PromptSet:
    """The chat prompts (``chats``, default the built-in ones) and ``extra`` (the bench's RAG and long prompts) as
    token ids of ``tokenizer`` (a Hugging Face tokenizer with the model's chat template)."""
    prompts: list[QualityPrompt] = []
    counts: dict[str, int] = {}
    for source in [*(chat_sources() if chats is None else chats), *extra]:
        n = counts[source.kind] = counts.get(source.kind, 0) + 1
        pid = f"{source.kind}-{n:03d}"
        if isinstance(source, ChatSource):
            messages = tuple(dict(m) for m in source.messages)
            tokens = apply_template(tokenizer, messages, None, tokenize=True)
            # A conversation's fork point: its earlier turns (what a chat's next turn finds cached); a single turn's:
            # the template's frame before the user's message.
            if messages[-2:-1] and messages[-2]["role"] == "assistant":
                head = apply_template(tokenizer, messages[:-1], None, tokenize=True, add_generation_prompt=False)
            else:  # where the last message's content starts: the same messages with another one
                head = apply_template(tokenizer, [*messages[:-1], {**messages[-1], "content": "#"}], None,
                                      tokenize=True)
            prompts.append(QualityPrompt(pid, source.kind, tuple(tokens), _split(tokens, head), messages=messages))
        else:
            tokens = tokenizer.encode(source.text, add_special_tokens=False)
            head = tokenizer.encode(source.prefix, add_special_tokens=False) if source.prefix else []
            prompts.append(QualityPrompt(pid, source.kind, tuple(tokens), _split(tokens, head), text=source.text))
    return PromptSet(tuple(prompts))


def _split(tokens: Sequence[int], head: Sequence[int]) -> int:
    """Where ``head`` (a prefix's own tokens) stops agreeing with ``tokens``, kept inside (1, len): a fork point."""
    n = 0
    for a, b in zip(tokens, head):
        if a != b:
            break
        n += 1
    return n if 0 < n < len(tokens) else max(1, len(tokens) // 2)


__all__ = ["KINDS", "ChatSource", "TextSource", "QualityPrompt", "PromptSet", "chat_sources", "build_prompt_set"]
