"""A tiny DeepSeek-style model whose tokenizer has a Qwen-style tool template.

The byte-level tokenizer of ``tiny.py`` with the tool-call markers as added
tokens, and whole scripted answers as added tokens too: a random model calls
no tool on its own, but ``logit_bias`` on one of these makes it write a call.
"""

import shutil
from pathlib import Path

import tiny

TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a function as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{{ m.content or '' }}
{%- for tool_call in m.tool_calls %}
{%- if tool_call.function %}{% set tool_call = tool_call.function %}{% endif %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# scripted answers (each one token), after the forced starts of a call
ARGS = '{"city": "Paris"}}\n</tool_call>DONE'
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>DONE'
AUTO = "Let me look.<tool_call>\n" + CALL
ADDED = ["<tool_call>", "</tool_call>", ARGS, CALL, AUTO]


def token_id(text: str) -> int:
    return 256 + len(tiny.SPECIALS) + ADDED.index(text)


def build(folder: Path, target: Path) -> Path:
    """``folder`` (a tiny model) copied to ``target`` with the tool tokenizer."""
    from transformers import AutoTokenizer

    shutil.copytree(folder, target)
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.add_tokens(ADDED)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(target))
    assert [tok.convert_tokens_to_ids(t) for t in ADDED] == list(map(token_id, ADDED))
    return target
