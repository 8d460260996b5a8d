"""Text already on the machine for ``train-head --data``: stdlib code and doc prose.

Writes JSON lines of ``{"text": ...}``: ``--code`` random 2000-character pieces
of standard-library modules and ``--prose`` groups of documentation paragraphs
(from /usr/share/doc and the stdlib), drawn with ``--seed``.

    python scripts/disk_text.py OUT.jsonl --code 20 --prose 14 --seed 1 \
        --stdlib /usr/lib/python3.11
"""

import argparse
import json
import random
import sysconfig
from pathlib import Path

from mlx_mtp.train_data import default_snippet_files, text_snippets

PIECE = 2500  # characters drawn per piece, cut to --chars when written


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--code", type=int, default=20)
    ap.add_argument("--prose", type=int, default=14)
    ap.add_argument("--chars", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"])
    )
    args = ap.parse_args()
    rng = random.Random(args.seed)
    rows = []
    for f in rng.sample(sorted(args.stdlib.glob("*.py")), 40):
        text = f.read_text(errors="ignore")
        start = rng.randrange(0, max(1, len(text) - PIECE))
        rows.append(text[start : start + PIECE])
    rows = rows[: args.code]
    docs = [
        f
        for f in default_snippet_files()
        if f.suffix in (".md", ".txt", ".rst") or f.name.startswith("README")
    ]
    paras = text_snippets(docs, chars=2000)
    rng.shuffle(paras)
    buf, prose = "", []
    for p in paras:
        buf += p + "\n\n"
        if len(buf) > PIECE:
            prose.append(buf)
            buf = ""
        if len(prose) >= args.prose:
            break
    with open(args.out, "w") as f:
        for text in rows + prose:
            f.write(json.dumps({"text": text[: args.chars]}) + "\n")


if __name__ == "__main__":
    main()
