"""Training text for an MTP head: user files, and the trunk's own continuations.

A head is judged on what the trunk generates, so the best data is the trunk's
own greedy answers to varied prompts (self-distillation). Prompts come from
fixed templates over topics and from the docstrings and text already on the
machine, drawn with a seed so a run can be repeated. ``EVAL_PROMPTS`` are
written by hand in other words and are never produced for training.
"""

import ast
import json
import random
import sys
import sysconfig
from pathlib import Path
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple

from .errors import MTPError

# Held-out prompts (code, prose, chat) for acceptance estimates.
EVAL_PROMPTS = {
    "code": [
        "Write a Python function that checks whether a string is a palindrome, "
        "ignoring case and spaces.",
        "Show me how to read a CSV file in Python and print the sum of the second "
        "column.",
        "Implement binary search over a sorted list in Python, with comments.",
        "Explain what a Python decorator is and give a small example.",
    ],
    "prose": [
        "Write a short story about a lighthouse keeper who finds a message in a "
        "bottle.",
        "Describe a walk through a forest in autumn.",
        "Write a paragraph about why people enjoy watching the ocean.",
        "Tell me about the history of the bicycle.",
    ],
    "chat": [
        "Hi! Can you suggest three things to do on a rainy weekend?",
        "How do I make a good cup of tea?",
        "What are some tips for sleeping better at night?",
        "I have a job interview tomorrow. How should I prepare?",
    ],
}

TOPICS = (
    "the water cycle, photosynthesis, volcanoes, black holes, the Roman Empire, "
    "the French Revolution, the printing press, electricity, magnets, gravity, "
    "the human heart, vaccines, sleep, coffee, chocolate, bread baking, pasta, "
    "gardening, composting, bees, ants, whales, penguins, elephants, cats, dogs, "
    "horses, trees, deserts, rainforests, glaciers, earthquakes, hurricanes, "
    "climate change, solar power, wind turbines, batteries, electric cars, "
    "trains, airplanes, rockets, the Moon, Mars, Jupiter, the Sun, stars, "
    "telescopes, microscopes, DNA, evolution, dinosaurs, fossils, the ocean, "
    "coral reefs, rivers, mountains, maps, compasses, clocks, calendars, money, "
    "banks, taxes, inflation, budgeting, saving money, investing, startups, "
    "marketing, job interviews, resumes, teamwork, leadership, public speaking, "
    "time management, learning a language, reading habits, writing essays, "
    "poetry, music theory, the piano, the guitar, painting, photography, film, "
    "theatre, chess, football, basketball, running, swimming, yoga, meditation, "
    "healthy eating, vitamins, first aid, hiking, camping, travel, hotels, "
    "cooking rice, soup, salads, birthdays, weddings, friendship, parenting, "
    "pets, recycling, plastic, cities, villages, architecture, bridges, roads, "
    "the internet, email, passwords, encryption, databases, spreadsheets, "
    "operating systems, Linux, Python, JavaScript, SQL, HTML, CSS, git, "
    "unit testing, debugging, recursion, sorting algorithms, hash tables, "
    "linked lists, binary trees, graphs, regular expressions, APIs, JSON, "
    "machine learning, neural networks, statistics, probability, geometry, "
    "fractions, prime numbers, the Pythagorean theorem, calculus, logic"
).split(", ")

CHAT_TEMPLATES = (
    "What is {t}?",
    "Explain {t} to a ten-year-old.",
    "Give me five facts about {t}.",
    "Write a short paragraph about {t}.",
    "What are the pros and cons of {t}?",
    "Why is {t} important?",
    "Write a haiku about {t}.",
    "Summarize the key ideas of {t} in a few sentences.",
    "How would you teach someone about {t}?",
    "Write a short dialogue between two friends talking about {t}.",
    "List some common misconceptions about {t}.",
    "Write an email to a colleague about {t}.",
    "What questions should a beginner ask about {t}?",
    "Compare {t} and {u}.",
    "Write a blog post introduction about {t}.",
    "Tell me a fun story that involves {t}.",
)

CODE_TEMPLATES = (
    "Write a Python function `{name}` that does this: {doc}",
    "Explain what this Python function does: `{name}` - {doc}",
    "How would I {doc_lower} in Python? Show code.",
)


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def docstring_tasks(limit: int = 20000) -> List[tuple]:
    """(name, first docstring line) of public stdlib functions."""
    tasks = []
    for f in sorted(_stdlib_dir().glob("*.py")):
        try:
            tree = ast.parse(f.read_text(encoding="utf-8", errors="ignore"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = (ast.get_docstring(node) or "").strip().split("\n")[0]
                if 20 <= len(doc) <= 160 and doc[0].isupper():
                    tasks.append((node.name, doc.rstrip(".")))
        if len(tasks) >= limit:
            break
    return tasks


def text_snippets(files: Iterable[Path], chars: int = 300) -> List[str]:
    """Paragraph-sized pieces of text files, to be continued by the trunk."""
    out = []
    for f in files:
        try:
            text = Path(f).read_text(encoding="utf-8", errors="ignore")
        except OSError:
            continue
        for para in text.split("\n\n"):
            para = para.strip()
            if 80 <= len(para) <= 2000:
                out.append(para[:chars])
    return out


def distill_prompts(
    n: int, seed: int = 0, snippet_files: Sequence[Path] = ()
) -> List[dict]:
    """``n`` varied training prompts: ``{"chat": str}`` or ``{"text": str}``.

    Chat prompts go through the chat template; text prompts are continued as
    they are. None of them equals an ``EVAL_PROMPTS`` entry.
    """
    rng = random.Random(seed)
    tasks = docstring_tasks()
    snippets = text_snippets(snippet_files) if snippet_files else []
    held_out = {p for ps in EVAL_PROMPTS.values() for p in ps}
    prompts: List[dict] = []
    while len(prompts) < n:
        kind = rng.random()
        if kind < 0.55 or not (tasks or snippets):
            t, u = rng.sample(TOPICS, 2)
            p = {"chat": rng.choice(CHAT_TEMPLATES).format(t=t, u=u)}
        elif kind < 0.85 and tasks:
            name, doc = rng.choice(tasks)
            template = rng.choice(CODE_TEMPLATES)
            doc_lower = doc[0].lower() + doc[1:]
            p = {"chat": template.format(name=name, doc=doc, doc_lower=doc_lower)}
        elif snippets:
            p = {"text": rng.choice(snippets)}
        else:
            continue
        if next(iter(p.values())) not in held_out:
            prompts.append(p)
    return prompts


def render_prompt(tokenizer: Any, prompt: dict) -> List[int]:
    """Token ids of a prompt from ``distill_prompts``."""
    if "chat" in prompt and getattr(tokenizer, "chat_template", None) is not None:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt["chat"]}], add_generation_prompt=True
        )
    return tokenizer.encode(next(iter(prompt.values())))


def self_distill(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[dict],
    max_tokens: int,
    batch_size: int = 32,
    out_file: Optional[Path] = None,
    progress=None,
) -> Iterator[List[int]]:
    """The trunk's greedy continuations, as full token sequences (prompt + answer).

    ``model`` is mlx-lm's model; generation is batched with mlx-lm's
    ``batch_generate``. Each sequence is appended to ``out_file`` (JSON lines)
    as soon as its batch ends, so a long run can be stopped and reused.
    """
    from mlx_lm import batch_generate

    for start in range(0, len(prompts), batch_size):
        chunk = [
            render_prompt(tokenizer, p) for p in prompts[start : start + batch_size]
        ]
        result = batch_generate(
            model, tokenizer, chunk, max_tokens=max_tokens, return_token_ids=True
        )
        for prompt_ids, answer in zip(chunk, result.token_ids):
            seq = list(prompt_ids) + list(answer)
            if out_file is not None:
                with open(out_file, "a") as f:
                    f.write(
                        json.dumps({"tokens": seq, "prompt_len": len(prompt_ids)})
                        + "\n"
                    )
            if progress is not None:
                progress(len(answer))
            yield seq, len(prompt_ids)


def read_data_file(path: Path, tokenizer: Any) -> List[Tuple[List[int], int]]:
    """``(tokens, answer_start)`` from a text file, or JSON lines with "tokens" or "text".

    A JSON line's optional "prompt_len" marks where the answer starts; only
    tokens from there on are targets (a head never drafts inside a prompt).
    """
    path = Path(path)
    try:
        raw = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise MTPError(f"{path}: cannot read ({e.strerror})") from None
    if path.suffix == ".jsonl":
        seqs = []
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise MTPError(f"{path}:{n}: not a JSON line") from None
            if "tokens" in row:
                tokens = [int(t) for t in row["tokens"]]
                seqs.append((tokens, int(row.get("prompt_len", 0))))
            elif "text" in row:
                seqs.append((tokenizer.encode(row["text"]), 0))
            else:
                raise MTPError(f'{path}:{n}: a line needs "tokens" or "text"')
        return seqs
    return [(tokenizer.encode(raw), 0)]


def chunk_sequences(
    seqs: Iterable[Tuple[List[int], int]], length: int, min_len: int = 8
) -> List[Tuple[List[int], int]]:
    """Cut ``(tokens, answer_start)`` sequences into windows of at most ``length``.

    Each window keeps where its answer starts, relative to the window.
    """
    out = []
    for seq, start in seqs:
        for i in range(0, len(seq), length):
            piece = seq[i : i + length]
            if len(piece) >= min_len and i + len(piece) > start + 1:
                out.append((piece, max(0, start - i)))
    return out


def default_snippet_files(limit: int = 400) -> List[Path]:
    """Documentation and source on this machine, for continuation prompts."""
    roots = [Path("/usr/share/doc"), _stdlib_dir()]
    files: List[Path] = []
    for root in roots:
        for pattern in ("README*", "*.md", "*.txt", "*.rst"):
            files.extend(sorted(root.rglob(pattern))[:limit])
    files.extend(sorted(_stdlib_dir().glob("*.py"))[:limit])
    return [f for f in files if f.is_file()]


if __name__ == "__main__":  # quick look at the prompt mix
    for p in distill_prompts(int(sys.argv[1]) if len(sys.argv) > 1 else 10):
        print(p)
