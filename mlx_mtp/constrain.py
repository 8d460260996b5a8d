"""Constrained decoding: answers that are JSON, or JSON valid for a schema.

``JSONConstraint`` is a logits processor (``processor(tokens, logits)``): it
masks every token the grammar forbids after the tokens generated so far. The
grammar is llguidance's (``LLMatcher``), compiled from a JSON schema; the
end-of-sequence tokens are allowed only where the JSON may end, and once it
is complete they are all that is allowed.

Speculative rounds call the processor at every verified position, whose
prefixes end in drafts that may be rejected, and then at the next round's
prefix: the matcher rolls back to what the new prefix shares with what it
consumed and consumes the rest, and the mask at each consumed length is kept
until a rollback passes it (the verify asks again for the draft rows' masks).
Since the same masks apply with drafts or without, greedy answers are those
of constrained plain decoding.

Compiling a grammar takes from milliseconds to tens of seconds (a large tool
set on a large vocabulary): ``Grammars`` compiles each once, off the decoding
thread, and every constraint on it starts from a copy.
"""

import json
import threading
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence
from urllib.parse import unquote

import mlx.core as mx
import numpy as np

from .errors import MTPError

# Output that reads like ``json.dumps``: the grammar fixes the whitespace, so a
# model cannot pad an answer with spaces and newlines until max_tokens.
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# compiled grammars kept by ``Grammars`` (a tool set or schema each)
DEFAULT_GRAMMAR_CACHE = 32


def grammar_tokenizer(tokenizer, vocab: int):
    """llguidance's view of an mlx-lm ``tokenizer``, with ``vocab`` token ids.

    Building it reads the whole vocabulary (under a second): build it once
    per model. Raises ``MTPError`` for a tokenizer llguidance cannot read.
    """
    import llguidance.hf

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    eos = getattr(tokenizer, "eos_token_ids", None)
    eos = [eos] if isinstance(eos, int) else sorted(eos or ())
    try:
        # an end token from the model's config that the tokenizer lacks
        # cannot be written out: the grammar ends with the others
        eos = [t for t in eos if t < len(hf)] or None
        return llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=eos)
    except Exception as e:  # slow (Python) tokenizers, unreadable vocabularies
        raise MTPError(f"constrained decoding cannot use this tokenizer ({e})")


def json_grammar(schema: Optional[Dict[str, Any]] = None) -> str:
    """The grammar of JSON valid for ``schema``; of any JSON object without one."""
    from llguidance import LLMatcher

    if schema is not None:
        check_schema(schema)
    try:
        return LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"}, defaults=_LAYOUT
        )
    except ValueError as e:
        raise MTPError(f"invalid JSON schema: {e}") from None


def check_schema(schema: Any) -> None:
    """Raise ``MTPError`` where a ``$ref`` of ``schema`` reaches no end: its
    references lead back to it and no finite JSON value satisfies it, so that
    an answer held to it could never be finished (recursion with a way out,
    a tree's optional children, is fine)."""
    refs = _refs(schema, schema, set())
    ends: set = set()  # the references some finite value satisfies
    grew = True
    while grew:
        grew = False
        for ref in refs - ends:
            if _ends(_target(schema, ref), schema, ends):
                ends.add(ref)
                grew = True
    stuck = sorted(refs - ends)
    if stuck:
        raise MTPError(
            f"invalid JSON schema: '$ref' {json.dumps(stuck[0])} refers back to "
            "itself and no finite value satisfies it"
        )


# what a schema keyword holds: one schema, a list of them, or a map to them
_ONE = ("items", "additionalItems", "additionalProperties", "contains", "not",
        "if", "then", "else", "propertyNames", "unevaluatedItems",
        "unevaluatedProperties")  # fmt: skip
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _subschemas(schema: dict):
    """The schemas directly inside ``schema``."""
    for key, value in schema.items():
        if key in _ONE and isinstance(value, dict):
            yield value
        elif key in _LIST and isinstance(value, list):
            yield from (s for s in value if isinstance(s, dict))
        elif key in _MAP and isinstance(value, dict):
            yield from (s for s in value.values() if isinstance(s, dict))


def map_subschemas(schema: dict, fn) -> dict:
    """A copy of ``schema`` with ``fn(subschema, keyword)`` in place of each
    schema directly inside it."""
    out = dict(schema)
    for key, value in schema.items():
        if key in _ONE and isinstance(value, dict):
            out[key] = fn(value, key)
        elif key in _LIST and isinstance(value, list):
            out[key] = [fn(s, key) if isinstance(s, dict) else s for s in value]
        elif key in _MAP and isinstance(value, dict):
            out[key] = {
                k: fn(s, key) if isinstance(s, dict) else s for k, s in value.items()
            }
    return out


def _target(root: Any, ref: str) -> Any:
    """What the local reference ``ref`` ("#/$defs/a") points to; None where it
    points nowhere here (llguidance reports that)."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in unquote(ref[1:]).split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _refs(schema: Any, root: Any, seen: set) -> set:
    """The local references reachable from ``schema`` (``seen`` grows)."""
    if not isinstance(schema, dict):
        return seen
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref not in seen and _target(root, ref) is not None:
        seen.add(ref)
        _refs(_target(root, ref), root, seen)
    for sub in _subschemas(schema):
        _refs(sub, root, seen)
    return seen


def _ends(schema: Any, root: Any, ends: set) -> bool:
    """Whether a finite value satisfies ``schema``, given that one satisfies
    each reference in ``ends`` and none the other references."""
    if not isinstance(schema, dict) or "const" in schema or "enum" in schema:
        return True
    ref = schema.get("$ref")
    if isinstance(ref, str) and _target(root, ref) is not None and ref not in ends:
        return False
    if not all(_ends(s, root, ends) for s in schema.get("allOf") or ()):
        return False
    for key in ("anyOf", "oneOf"):
        alternatives = schema.get(key)
        if alternatives and not any(_ends(s, root, ends) for s in alternatives):
            return False
    kinds = schema.get("type")
    if not isinstance(kinds, (str, list)):
        return True  # untyped: a value of another kind will do
    kinds = [kinds] if isinstance(kinds, str) else kinds
    return any(_kind_ends(k, schema, root, ends) for k in kinds)


def _kind_ends(kind: str, schema: dict, root: Any, ends: set) -> bool:
    if kind == "object":
        properties = schema.get("properties") or {}
        required = schema.get("required") or ()
        return all(_ends(properties.get(k, True), root, ends) for k in required)
    if kind == "array":
        n = schema.get("minItems") or 0
        prefix = (schema.get("prefixItems") or [])[:n]
        rest = n > len(prefix) and not _ends(schema.get("items", True), root, ends)
        return all(_ends(s, root, ends) for s in prefix) and not rest
    return True


class Grammars:
    """Compiled grammars for one tokenizer, the ``size`` last used kept.

    ``compile(grammar)`` compiles a grammar on its first use (slow for a large
    one: call it off the decoding thread). Constraints start from copies of
    the compiled matcher, which share llguidance's lexer: what one request's
    decoding builds of it, the next one reuses.
    """

    def __init__(self, ll_tokenizer, size: int = DEFAULT_GRAMMAR_CACHE):
        self.ll_tokenizer, self.size = ll_tokenizer, size
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, grammar: str):
        """The compiled matcher of ``grammar``, to be copied, never consumed.
        Raises ``MTPError`` for a grammar llguidance refuses."""
        with self._lock:
            if grammar in self._compiled:
                self._compiled.move_to_end(grammar)
                return self._compiled[grammar]
        matcher = compile_grammar(self.ll_tokenizer, grammar)  # slow: unlocked
        with self._lock:
            self._compiled[grammar] = matcher
            while len(self._compiled) > self.size:
                self._compiled.popitem(last=False)
        return matcher


def compile_grammar(ll_tokenizer, grammar: str):
    """llguidance's matcher of ``grammar`` at its start, its first mask
    computed here rather than in the first decoding step. ``MTPError`` for a
    grammar it refuses, or one that allows no answer at all."""
    from llguidance import LLMatcher

    matcher = LLMatcher(ll_tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise MTPError(f"invalid JSON schema: {matcher.get_error()}")
    matcher.compute_bitmask()
    if matcher.is_error():  # the error is followed by the parser's state
        reason = matcher.get_error().splitlines()[0]
        raise MTPError(f"invalid JSON schema: no answer can begin ({reason})")
    return matcher


class JSONConstraint:
    """Keeps the tokens after ``prompt_len`` inside ``grammar``; ``compiled``:
    its matcher from ``Grammars.compile`` (else it is compiled here)."""

    def __init__(self, grammar: str, ll_tokenizer, prompt_len: int, compiled=None):
        if compiled is None:
            compiled = compile_grammar(ll_tokenizer, grammar)
        self.matcher = compiled.deep_copy()
        self.prompt_len = prompt_len
        self.vocab = ll_tokenizer.vocab_size
        self.eos = list(ll_tokenizer.eos_tokens)
        self.consumed: List[int] = []
        self.masks: List[mx.array] = []  # masks[i]: after consumed[:i]

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        return self.apply(tokens[self.prompt_len :].tolist(), logits)

    def apply(self, generated: Sequence[int], logits: mx.array) -> mx.array:
        """``logits`` masked to what the grammar allows after ``generated``."""
        if self.follow(generated) < len(generated):
            # the prefix holds a token the grammar forbids: only a rejected
            # draft can put one there, so this row is never used
            return logits
        mask = self._mask()
        width = logits.shape[-1]
        if width != mask.size:  # logits wider or narrower than the vocabulary
            mask = mx.pad(mask, (0, max(0, width - mask.size)))[:width]
        return mx.where(mask, logits, mx.array(-float("inf"), logits.dtype))

    def follow(self, generated: Sequence[int]) -> int:
        """Bring the matcher to the longest start of ``generated`` the grammar
        allows; its length."""
        common = 0
        for a, b in zip(self.consumed, generated):
            if a != b:
                break
            common += 1
        if common < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - common)
            del self.consumed[common:]
            del self.masks[common + 1 :]
        rest = list(generated[common:])
        valid = self.matcher.validate_tokens(rest) if rest else 0
        if valid:
            self.matcher.consume_tokens(rest[:valid])
            self.consumed.extend(rest[:valid])
        return common + valid

    def complete(self) -> bool:
        """Whether what was followed is a whole sentence of the grammar."""
        return self.matcher.is_accepting()

    def _mask(self) -> mx.array:
        """Allowed tokens after ``consumed``, as booleans, from the cache if kept."""
        n = len(self.consumed)
        if n < len(self.masks) and self.masks[n] is not None:
            return self.masks[n]
        if self.matcher.is_error():  # a resource limit: end the answer
            allowed = np.zeros(self.vocab, dtype=bool)
            allowed[self.eos] = True
        else:
            bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
            allowed = np.unpackbits(bits, bitorder="little")[: self.vocab]
        self.masks.extend([None] * (n + 1 - len(self.masks)))  # lengths not asked
        self.masks[n] = mx.array(allowed.astype(bool))
        return self.masks[n]


class TriggeredConstraint:
    """Free text, until the tokens ``trigger`` open a part held to ``grammar``;
    free again once that part is complete (a tool call opened in ``auto``).

    Outside the held parts nothing is masked, so special tokens and any text
    stay the model's own. Each opened part has its own ``JSONConstraint``,
    found again by where it opened when drafts are rolled back.
    """

    def __init__(self, grammar: str, ll_tokenizer, prompt_len: int, trigger,
                 compiled=None):  # fmt: skip
        self.grammar, self.ll_tokenizer = grammar, ll_tokenizer
        self.prompt_len, self.trigger = prompt_len, list(trigger)
        self.parts: Dict[int, JSONConstraint] = {}  # by where each opened
        # compiled now (a bad grammar fails here): a part opened while
        # decoding only copies it
        if compiled is None:
            compiled = compile_grammar(ll_tokenizer, grammar)
        self.compiled = compiled

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        generated = tokens[self.prompt_len :].tolist()
        start = self._open_part(generated)
        if start is None:
            return logits
        return self.parts[start].apply(generated[start:], logits)

    def _open_part(self, generated: List[int]) -> Optional[int]:
        """Where the part still being written opened; None in free text."""
        n, at = len(self.trigger), 0
        while True:
            start = _find(generated, self.trigger, at)
            if start is None:
                return None
            start += n
            part = self.parts.get(start)
            if part is None:
                part = JSONConstraint(self.grammar, self.ll_tokenizer, 0, self.compiled)
                self.parts[start] = part
            followed = part.follow(generated[start:])
            if not part.complete():
                return start  # being written (or a rejected draft's row)
            if followed == len(generated) - start:
                return None  # just closed
            at = start + followed


def _find(tokens: List[int], pattern: List[int], at: int) -> Optional[int]:
    while True:
        try:
            i = tokens.index(pattern[0], at)
        except ValueError:
            return None
        if tokens[i : i + len(pattern)] == pattern:
            return i
        at = i + 1


def response_format_grammar(response_format: Any) -> Optional[str]:
    """The grammar an OpenAI ``response_format`` asks for (None: free text).

    Raises ``ValueError`` with a message for the client on a malformed field.
    """
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ValueError("'response_format' must be an object")
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return json_grammar()
    if kind != "json_schema":
        raise ValueError(
            "'response_format.type' must be 'text', 'json_object' or "
            f"'json_schema', got {json.dumps(kind)}"
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise ValueError(
            "'response_format.json_schema' must be an object with a 'schema' object"
        )
    # no schema: any JSON value, as OpenAI reads it
    schema = spec.get("schema") if "schema" in spec else {}
    try:
        return json_grammar(schema)
    except MTPError as e:
        raise ValueError(str(e)) from None
