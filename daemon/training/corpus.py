"""Training text that is on every machine specd runs on, and the instructions made of it.

Sources (each with its licence, recorded in the head's model card and GGUF):

- `python-stdlib`: the Python standard library's own source files, as installed with the
  interpreter running specd (tests and `site-packages` left out). PSF-2.0.
- `python-docs`: the documentation topics the interpreter ships for `help()`
  (`pydoc_data.topics`: sections of the language reference). PSF-2.0.
- `stories`: story prompts composed here from short word lists (part of specd,
  Apache-2.0).

Each source item (a file, a topic, a story's characters) goes to the evaluation split or
the training split by a hash of its name, so no text is in both. Instructions are made
of code snippets (top-level functions and classes), documentation passages and story
prompts with fixed templates: explain, document, test, refactor, review or reimplement a
snippet; summarise or teach a passage; write a story. Any instruction that shares a run of
text with an excluded prompt (`specd bench`'s, which `specd train-draft` passes) is
dropped.
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import random
import re
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("train", "eval")
EVAL_PERCENT = 5  # of source items held out for evaluation
SNIPPET_LINES = (4, 60)  # a code snippet's length bounds, lines
PASSAGE_CHARS = (300, 1800)  # a documentation passage's length bounds
EXCLUDE_WINDOW = 64  # chars: an instruction sharing this long a run with an excluded
# prompt (whitespace collapsed) is dropped
# instruction kinds, drawn in these proportions
KIND_WEIGHTS = {"code": 6, "docs": 2, "story": 2}

LICENCES = {
    "python-stdlib": ("PSF-2.0", "the Python standard library's source, as installed"),
    "python-docs": ("PSF-2.0", "pydoc_data.topics: the Python documentation topics"),
    "stories": ("Apache-2.0", "story prompts composed by specd from its own word lists"),
}

CODE_TEMPLATES = (
    "Explain what this Python code does:\n\n```python\n{code}\n```",
    "Add type hints and a docstring to this code, keeping its behaviour:\n\n"
    "```python\n{code}\n```",
    "Write pytest unit tests for this code:\n\n```python\n{code}\n```",
    "Refactor this code to make it easier to read, keeping its behaviour:\n\n"
    "```python\n{code}\n```",
    "Review this code: point out bugs, edge cases and possible improvements.\n\n"
    "```python\n{code}\n```",
    "Rewrite this Python code in {language}:\n\n```python\n{code}\n```",
)
# a function with a docstring also makes "write it from its description"
DESCRIBE_TEMPLATE = ("Write a Python function `{name}{signature}` that does the following: "
                     "{summary}")
LANGUAGES = ("JavaScript", "TypeScript", "Rust", "Go", "Java", "C++", "C#", "Kotlin")
DOC_TEMPLATES = (
    "Summarize this passage from the Python documentation in a few sentences:\n\n{text}",
    "Explain this to a Python beginner, with a short example:\n\n{text}",
    "Write three quiz questions, with answers, about this text:\n\n{text}",
    "Rewrite this passage in plain English:\n\n{text}",
)
STORY_TEMPLATE = "Write a short story (about {words} words) about {who} who {what}."
STORY_WHO = ("a retired clockmaker", "a young beekeeper", "a night-shift nurse",
             "a travelling musician", "a street cat", "a shy robot", "an old fisherman",
             "a school librarian", "a mountain guide", "a baker", "a postal worker",
             "a chess prodigy", "a gardener", "a ferry captain", "a museum guard",
             "a translator", "a balloon pilot", "a young inventor", "a detective",
             "a farmer")
STORY_WHAT = ("finds a key that opens no door", "loses their voice before a concert",
              "receives a letter from their future self", "must cross a frozen river",
              "befriends a stranger on a train", "discovers a hidden room at home",
              "wakes up in a city where it never stops raining",
              "has one day to repair a broken bridge", "finds a map drawn by a child",
              "hears a song no one else can hear", "inherits a garden full of strange plants",
              "gets lost in a forest at dusk", "teaches an old dog a new trick",
              "must keep a promise made years ago", "finds a camera with one photo left",
              "meets their childhood hero", "is the last to leave a flooded village",
              "finds a clock that runs backwards", "opens a shop that sells only umbrellas",
              "wins a prize they never entered for")
STORY_WORDS = (120, 150, 200, 250)


@dataclass(frozen=True)
class Instruction:
    """A user message to send to the target, and where its text came from."""

    text: str
    kind: str  # "code" | "docs" | "story"
    source: str  # a key of LICENCES
    item: str  # the source item (file, topic, story) it was made from


def split_of(item: str, eval_percent: int = EVAL_PERCENT) -> str:
    """The split a source item belongs to: a stable hash of its name."""
    h = int.from_bytes(hashlib.sha256(item.encode("utf-8")).digest()[:4], "big")
    return "eval" if h % 100 < eval_percent else "train"


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files() -> list[Path]:
    """The standard library's .py files, without its test suites and site-packages."""
    root = stdlib_dir()
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


Definition = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def code_snippets(path: Path) -> Iterator[tuple[str, Definition]]:
    """Top-level functions and classes of a source file (a long class: its methods), as
    source text within SNIPPET_LINES, with their AST nodes."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return
    lines = source.splitlines()
    lo, hi = SNIPPET_LINES

    def text(node: Definition) -> str | None:
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        end = getattr(node, "end_lineno", None) or node.lineno
        if not lo <= end - start + 1 <= hi:
            return None
        body = lines[start - 1:end]
        indent = min((len(x) - len(x.lstrip()) for x in body if x.strip()), default=0)
        return "\n".join(x[indent:] for x in body)

    for node in tree.body:
        if isinstance(node, Definition):
            snippet = text(node)
            if snippet is not None:
                yield snippet, node
            elif isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                        snippet = text(sub)
                        if snippet is not None:
                            yield snippet, sub


def doc_passages() -> Iterator[tuple[str, str]]:
    """(topic, passage) from the documentation topics, paragraphs joined up to
    PASSAGE_CHARS."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions package the docs separately
        return
    lo, hi = PASSAGE_CHARS
    for name in sorted(topics):
        paragraphs = [p.strip() for p in re.split(r"\n\s*\n", topics[name]) if p.strip()]
        part: list[str] = []
        for p in paragraphs:
            part.append(p)
            if sum(len(x) for x in part) >= lo:
                passage = "\n\n".join(part)[:hi]
                yield name, passage
                part = []


def _code_instructions(rng: random.Random, split: str, eval_percent: int
                       ) -> Iterator[Instruction]:
    root = stdlib_dir()
    files = [p for p in _stdlib_files()
             if split_of(f"stdlib/{p.relative_to(root)}", eval_percent) == split]
    rng.shuffle(files)
    for path in files:
        item = f"stdlib/{path.relative_to(root)}"
        for code, node in code_snippets(path):
            template = rng.choice(CODE_TEMPLATES)
            yield Instruction(template.format(code=code, language=rng.choice(LANGUAGES)),
                              "code", "python-stdlib", item)
            if isinstance(node, ast.ClassDef):
                continue
            doc = ast.get_docstring(node)
            if doc and rng.random() < 0.5 and not node.name.startswith("_"):
                summary = doc.strip().split("\n\n")[0].replace("\n", " ")
                args = ast.unparse(node.args)
                yield Instruction(DESCRIBE_TEMPLATE.format(
                    name=node.name, signature=f"({args})", summary=summary),
                    "code", "python-stdlib", item)


def _doc_instructions(rng: random.Random, split: str, eval_percent: int
                      ) -> Iterator[Instruction]:
    passages = [(t, p) for t, p in doc_passages()
                if split_of(f"docs/{t}", eval_percent) == split]
    rng.shuffle(passages)
    for topic, passage in passages:
        yield Instruction(rng.choice(DOC_TEMPLATES).format(text=passage), "docs",
                          "python-docs", f"docs/{topic}")


def _story_instructions(rng: random.Random, split: str, eval_percent: int
                        ) -> Iterator[Instruction]:
    combos = [(who, what) for who, what in itertools.product(STORY_WHO, STORY_WHAT)
              if split_of(f"story/{who}/{what}", eval_percent) == split]
    rng.shuffle(combos)
    for who, what in combos:
        yield Instruction(STORY_TEMPLATE.format(words=rng.choice(STORY_WORDS), who=who,
                                                what=what),
                          "story", "stories", f"story/{who}/{what}")


def _normalised(text: str) -> str:
    return " ".join(text.split())


class Excluder:
    """Tells whether an instruction shares EXCLUDE_WINDOW characters (whitespace
    collapsed) with any excluded text."""

    def __init__(self, texts: Sequence[str]):
        self.windows = {t[i:i + EXCLUDE_WINDOW] for t in map(_normalised, texts)
                        for i in range(max(len(t) - EXCLUDE_WINDOW + 1, 1))}

    def hits(self, text: str) -> bool:
        t = _normalised(text)
        return any(t[i:i + EXCLUDE_WINDOW] in self.windows
                   for i in range(max(len(t) - EXCLUDE_WINDOW + 1, 1)))


def instructions(split: str, *, seed: int = 0, exclude: Sequence[str] = (),
                 eval_percent: int = EVAL_PERCENT) -> Iterator[Instruction]:
    """The instructions of `split` ("train" or "eval"), in a fixed order for a seed, the
    kinds interleaved in KIND_WEIGHTS' proportions, until every source is used up."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} (one of {', '.join(SPLITS)})")
    rng = random.Random(f"{seed}/{split}")
    streams = {"code": _code_instructions(rng, split, eval_percent),
               "docs": _doc_instructions(rng, split, eval_percent),
               "story": _story_instructions(rng, split, eval_percent)}
    excluder = Excluder(exclude)
    while streams:
        kinds = list(streams)
        kind = rng.choices(kinds, weights=[KIND_WEIGHTS[k] for k in kinds])[0]
        inst = next(streams[kind], None)
        if inst is None:
            del streams[kind]
        elif not excluder.hits(inst.text):
            yield inst


def sources_record() -> list[dict[str, str]]:
    """What the training text is, for the model card: source, licence, description."""
    version = ".".join(map(str, sys.version_info[:3]))
    return [{"source": name, "licence": licence,
             "description": desc + (f" (Python {version})" if name.startswith("python")
                                    else "")}
            for name, (licence, desc) in LICENCES.items()]
