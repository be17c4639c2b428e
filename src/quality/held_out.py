"""A held-out prompt set: chat prompts written after the default was chosen, used only to check its greedy answers.

The main set (``headrace.quality.prompts``) is what the default's quantization and every KV path were measured and
chosen on; a choice tuned on a set can look better there than it is. These prompts share none of its questions,
instructions or conversations; the bench pairs them with workflow prompts from another corpus seed. The check reads
the greedy answers as a user sees them: whether the first token is the reference's, how many leading tokens agree,
and whether the whole answer does.
"""

from __future__ import annotations

from headrace.quality.prompts import ChatSource

QUESTIONS = (
    "What is the freezing point of water in Fahrenheit?", "Who invented the telephone?", "What is a volcano?",
    "How many days are in a leap year?", "What is the largest desert in the world?", "Why do birds migrate?",
    "What is the currency of Japan?", "How does a refrigerator keep food cold?", "What is an eclipse?",
    "What is the longest river in Africa?", "Why do we yawn?", "What is a fossil?", "How do fish breathe?",
    "What is the capital of Canada?", "What gas do plants release?", "How many sides does a hexagon have?",
    "What is democracy?", "Who discovered penicillin?", "What is the hardest natural substance?",
    "How do earthquakes happen?", "What is a metaphor?", "What is 12 plus 29?", "Why is the Dead Sea so salty?",
    "What is a glacier?", "How does soap clean things?", "What instrument has 88 keys?", "What is erosion?",
    "Why do stars twinkle?", "What is the biggest animal on Earth?", "How does a bicycle stay upright?",
)

INSTRUCTIONS = (
    "Write a two-line poem about rain.", "List three uses for a rubber band.",
    "Rewrite this sentence more politely: Close the door.", "Translate 'good morning' into Spanish.",
    "Write a Python function that returns the larger of two numbers.", "Give me a name for a pet turtle.",
    "Summarize the plot of Cinderella in one sentence.", "Explain what a spreadsheet is to a child.",
    "Suggest a title for a blog post about gardening.", "Write a short thank-you note to a teacher.",
    "Sort these words alphabetically: pear, apple, mango, banana.", "Give two tips for staying focused.",
)

CONVERSATIONS = (
    ("What is a comet?", "A comet is a small icy body that orbits the Sun.", "Why does it have a tail?"),
    ("I would like to start cooking at home.", "Simple dishes like pasta or omelettes are a good start.",
     "How do I make an omelette?"),
    ("What is a river delta?", "A delta is land formed where a river deposits sediment at its mouth.",
     "Name a famous one."),
    ("Can you help me plan a picnic?", "Of course. Where and when is it?", "Saturday in the park, for four people."),
)

SYSTEM = (
    ("You are a patient maths tutor.", "What is a fraction?"),
    ("You answer in one short sentence.", "Why do we need sleep?"),
    ("You are a travel guide for Lisbon.", "What should I see first?"),
    ("You are a helpful librarian.", "Can you suggest a mystery novel?"),
)


def held_out_sources() -> list[ChatSource]:
    """30 questions, 12 instructions, 4 conversations, 4 system prompts: 50 chat prompts in a fixed order."""
    out = [ChatSource("chat", ({"role": "user", "content": q},)) for q in QUESTIONS]
    out += [ChatSource("instruction", ({"role": "user", "content": t},)) for t in INSTRUCTIONS]
    roles = ("user", "assistant", "user")
    out += [ChatSource("multi_turn", tuple({"role": r, "content": c} for r, c in zip(roles, turns)))
            for turns in CONVERSATIONS]
    out += [ChatSource("system", ({"role": "system", "content": s}, {"role": "user", "content": q})) for s, q in SYSTEM]
    return out


__all__ = ["held_out_sources"]
