"""Prompts for self-distillation, and the held-out prompts a head is judged on.

A head is judged on what the trunk generates, so its best data is the trunk's
own greedy answers to varied prompts. ``training_prompts`` draws them from
templates over topics (questions, explanations, lists, prose, code, advice,
multi-turn chats), from a seed, using nothing but this file: every machine
draws the same prompts. ``EVAL_PROMPTS`` are written by hand, in other words,
and no template here can produce them (a test checks this); a run's
validation prompts come from the generator under a separate seed stream and
are never trained on.
"""

import random
from collections.abc import Sequence
from typing import Any

Prompt = dict[str, Any]  # {"messages": [{"role", "content"}, ...]} or {"text": str}

EVAL_PROMPTS = {
    "code": [
        "Write a Python function that checks whether a string is a palindrome, "
        "ignoring case and spaces.",
        "Show me how to read a CSV file in Python and print the sum of the second "
        "column.",
        "Implement binary search over a sorted list in Python, with comments.",
        "Explain what a Python decorator is and give a small example.",
        "My JavaScript loop prints the same number five times when I use setTimeout "
        "inside it. Why, and how do I fix it?",
        "Write a SQL query that finds the three customers who spent the most money "
        "last month.",
    ],
    "prose": [
        "Write a short story about a lighthouse keeper who finds a message in a "
        "bottle.",
        "Describe a walk through a forest in autumn.",
        "Write a paragraph about why people enjoy watching the ocean.",
        "Tell me about the history of the bicycle.",
        "Describe the sounds and smells of a busy market early in the morning.",
        "Write a letter from a grandmother to her grandson who just left for "
        "university.",
    ],
    "chat": [
        "Hi! Can you suggest three things to do on a rainy weekend?",
        "How do I make a good cup of tea?",
        "What are some tips for sleeping better at night?",
        "I have a job interview tomorrow. How should I prepare?",
        "My neighbour's dog barks all night. What can I do about it politely?",
        "I want to start running but I get bored quickly. Any advice?",
    ],
}
DEFAULT_EVAL_PER_KIND = 4


def _list(text: str) -> list[str]:
    return [w.strip() for w in text.split(",")]


TOPICS = _list(
    "the water cycle, photosynthesis, volcanoes, black holes, the Roman Empire, the "
    "French Revolution, the printing press, electricity, magnets, gravity, the "
    "human heart, vaccines, coffee, chocolate, bread baking, pasta, gardening, "
    "composting, bees, ants, whales, penguins, elephants, cats, horses, trees, "
    "deserts, rainforests, glaciers, earthquakes, hurricanes, climate change, solar "
    "power, wind turbines, batteries, electric cars, trains, airplanes, rockets, "
    "the Moon, Mars, Jupiter, stars, telescopes, microscopes, DNA, evolution, "
    "dinosaurs, fossils, coral reefs, rivers, mountains, maps, compasses, clocks, "
    "calendars, money, banks, taxes, inflation, budgeting, investing, startups, "
    "marketing, resumes, teamwork, leadership, public speaking, time management, "
    "learning a language, reading habits, writing essays, poetry, music theory, the "
    "piano, the guitar, painting, photography, film, theatre, chess, football, "
    "basketball, swimming, yoga, meditation, healthy eating, vitamins, first aid, "
    "hiking, camping, hotels, cooking rice, soup, salads, birthdays, weddings, "
    "friendship, parenting, pets, recycling, plastic, cities, villages, "
    "architecture, bridges, roads, the internet, email, passwords, encryption, "
    "databases, spreadsheets, operating systems, Linux, git, unit testing, "
    "recursion, sorting algorithms, hash tables, linked lists, binary trees, "
    "graphs, regular expressions, APIs, JSON, machine learning, neural networks, "
    "statistics, probability, geometry, fractions, prime numbers, the Pythagorean "
    "theorem, calculus, logic, ancient Egypt, the Vikings, the Silk Road, the "
    "Renaissance, the Industrial Revolution, the steam engine, the telephone, "
    "radio, television, satellites, GPS, tides, rainbows, lightning, snow, fog, the "
    "seasons, migration of birds, owls, sharks, octopuses, mushrooms, cheese, tea "
    "ceremonies, spices, fermentation, knitting, woodworking, pottery, origami, "
    "board games, video games, libraries, museums, newspapers, podcasts, "
    "volunteering, negotiation, remote work, minimalism, habits, motivation, "
    "memory, dreams, happiness"
)

QUESTIONS = (
    "What is {t}?",
    "How does {t} work?",
    "Why does {t} matter?",
    "Explain {t} to a ten-year-old.",
    "Explain {t} in simple terms.",
    "What are the pros and cons of {t}?",
    "What is the difference between {t} and {u}?",
    "What do {t} and {u} have in common?",
    "Summarize the key ideas of {t}.",
    "What questions should a beginner ask about {t}?",
    "What are common misconceptions about {t}?",
    "How has {t} changed over the last hundred years?",
    "What would happen if {t} disappeared tomorrow?",
    "Can you give me a quick overview of {t}?",
)
LISTS = (
    "Give me {n} facts about {t}.",
    "List {n} interesting things about {t}.",
    "List {n} tips for someone getting into {t}.",
    "Give me {n} questions for a quiz about {t}.",
    "Make a checklist of {n} steps to learn about {t}.",
    "Name {n} books or films that involve {t}, and say why.",
    "Write {n} bullet points comparing {t} and {u}.",
)
PROSE = (
    "Write a short story that involves {t}.",
    "Write a poem about {t}.",
    "Write a haiku about {t}.",
    "Write a short essay on {t}.",
    "Write a blog post introduction about {t}.",
    "Write a short dialogue between two friends talking about {t}.",
    "Write an email to a colleague about {t}.",
    "Describe {t} as if you were a travel guide.",
    "Write a product description for a gadget inspired by {t}.",
    "Write a diary entry of someone who just discovered {t}.",
    "Write a speech for a school assembly about {t}.",
    "Write a news report about a surprising discovery in {t}.",
)
ADVICE = (
    "I want to get better at {a}. Where should I start?",
    "How can I stay motivated while {g}?",
    "I'm nervous about {e}. Any advice?",
    "What is a good plan for {g} in one month?",
    "My friend and I disagree about {t}. How can we talk about it calmly?",
    "Can you help me plan {e}?",
    "What should I pack for {e}?",
)
ACTIVITIES = _list(
    "cooking, drawing, public speaking, writing, running, chess, saving money, "
    "playing the guitar, photography, learning Spanish, gardening, programming, "
    "time management, singing, swimming, negotiating, studying for exams"
)
GOALS = _list(
    "learning to code, training for a 5k race, writing a novel, losing weight, "
    "learning a language, saving for a trip, reading more books, studying maths, "
    "building a website, getting fit, changing careers"
)
EVENTS = _list(
    "a camping trip, a first date, a wedding speech, a move to a new city, a "
    "presentation at work, a birthday party, a road trip, a family dinner, a long "
    "flight, an exam, a first day at a new job, a hiking weekend"
)
TASKS = _list(
    "reverses a linked list, counts the words in a text file, checks whether a "
    "number is prime, merges two sorted lists, finds duplicates in a list, converts "
    "Celsius to Fahrenheit, validates an email address, computes the factorial of a "
    "number recursively, flattens a nested list, returns the n-th Fibonacci number, "
    "sorts a list of dictionaries by a key, removes vowels from a string, parses a "
    "date string, computes the median of a list, implements a stack, implements a "
    "queue with two stacks, finds the longest common prefix of some strings, counts "
    "character frequencies, rotates a matrix, checks balanced parentheses, "
    "implements bubble sort, implements quicksort, does a breadth-first search on a "
    "graph, caches function results, reads a JSON file and prints its keys, "
    "downloads a web page, generates a random password, finds the greatest common "
    "divisor, converts a number to Roman numerals, groups anagrams together"
)
LANGUAGES = ("Python", "Python", "Python", "JavaScript", "C", "Go", "Rust", "Java")
CODE = (
    "Write a {lang} function that {task}.",
    "Show me {lang} code that {task}.",
    "How would I write a program in {lang} that {task}? Explain each step.",
    "Write a {lang} function that {task}, and add a few tests.",
    "What is the time complexity of a {lang} function that {task}?",
    "Give me an example of {c} in {lang}.",
    "Explain {c} in {lang} with a short code sample.",
)
CONCEPTS = _list(
    "list comprehensions, closures, generators, classes and inheritance, "
    "exceptions, type hints, async functions, iterators, lambda functions, string "
    "formatting, file handling, dictionaries, sets, modules, unit tests, recursion, "
    "higher-order functions, pattern matching, interfaces, pointers"
)
FOLLOW_UPS = (
    "Can you explain that in more detail?",
    "Can you give me an example?",
    "Thanks! Could you make it shorter?",
    "What about {u}?",
    "Can you put that into a list?",
    "Why is that?",
    "How would you explain it to a child?",
)
FIRST_REPLIES = (
    "Sure! {T} is a broad subject. What would you like to know about it?",
    "Good question. In short, {t} is something many people find interesting, "
    "and there is a lot to say about it.",
    "Happy to help with {t}. Let me know which part interests you most.",
)
SYSTEMS = (
    "You are a helpful assistant.",
    "You are a concise assistant. Keep answers short.",
    "You are a friendly teacher who explains things clearly.",
)
# kind: (weight, templates)
KINDS = {
    "question": (0.20, QUESTIONS),
    "list": (0.12, LISTS),
    "prose": (0.18, PROSE),
    "code": (0.25, CODE),
    "advice": (0.10, ADVICE),
    "multi-turn": (0.15, None),
}
VALIDATION_STREAM = 7919  # seeds validation prompts apart from training prompts


def _fill(template: str, rng: random.Random) -> str:
    t, u = rng.sample(TOPICS, 2)
    return template.format(
        t=t,
        u=u,
        T=t[:1].upper() + t[1:],
        n=rng.choice((3, 4, 5, 6, 7, 10)),
        a=rng.choice(ACTIVITIES),
        g=rng.choice(GOALS),
        e=rng.choice(EVENTS),
        lang=rng.choice(LANGUAGES),
        task=rng.choice(TASKS),
        c=rng.choice(CONCEPTS),
    )


def _one(rng: random.Random) -> Prompt:
    kinds = list(KINDS)
    kind = rng.choices(kinds, weights=[KINDS[k][0] for k in kinds])[0]
    messages = []
    if rng.random() < 0.2:
        messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
    if kind == "multi-turn":
        t, u = rng.sample(TOPICS, 2)
        first = rng.choice(QUESTIONS).format(t=t, u=u)
        reply = rng.choice(FIRST_REPLIES).format(t=t, T=t[:1].upper() + t[1:])
        messages += [
            {"role": "user", "content": first},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": rng.choice(FOLLOW_UPS).format(u=u)},
        ]
    else:
        messages.append(
            {"role": "user", "content": _fill(rng.choice(KINDS[kind][1]), rng)}
        )
    return {"messages": messages, "kind": kind}


def training_prompts(
    n: int, seed: int = 0, exclude: Sequence[Prompt] = ()
) -> list[Prompt]:
    """``n`` distinct prompts drawn from ``seed``, none of them in ``exclude``.

    The first ``m`` prompts of a seed are the same for every ``n >= m``, so a
    run asked for more prompts extends the one before it.
    """
    rng = random.Random(seed)
    seen = {_key(p) for p in exclude}
    seen |= {_key(chat(p)) for ps in EVAL_PROMPTS.values() for p in ps}
    out: list[Prompt] = []
    for _ in range(50 * n + 1000):
        if len(out) >= n:
            break
        p = _one(rng)
        if _key(p) not in seen:
            seen.add(_key(p))
            out.append(p)
    return out


def validation_prompts(n: int, seed: int = 0) -> list[Prompt]:
    """Prompts for early stopping: the generator under its own seed stream."""
    return training_prompts(n, seed * 1_000_003 + VALIDATION_STREAM)


def chat(text: str) -> Prompt:
    return {"messages": [{"role": "user", "content": text}]}


def eval_prompts(per_kind: int = DEFAULT_EVAL_PER_KIND) -> dict[str, list[Prompt]]:
    """The hand-written held-out prompts, ``per_kind`` of each kind."""
    return {k: [chat(p) for p in ps[:per_kind]] for k, ps in EVAL_PROMPTS.items()}


def _key(p: Prompt) -> str:
    if "text" in p:
        return p["text"]
    return "\x00".join(m["content"] for m in p["messages"])


def render_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids of a prompt: chat messages through the chat template, or text."""
    if "messages" in prompt and getattr(tokenizer, "chat_template", None):
        return list(
            tokenizer.apply_chat_template(
                prompt["messages"], add_generation_prompt=True
            )
        )
    if "messages" in prompt:
        text = "\n".join(m["content"] for m in prompt["messages"]) + "\n"
        return list(tokenizer.encode(text))
    return list(tokenizer.encode(prompt["text"]))
