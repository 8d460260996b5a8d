"""A tiny DeepSeek-style model whose tokenizer has a tool template: Qwen's
``<tool_call>`` JSON, or DeepSeek-V3's ``<｜tool▁calls▁begin｜>`` section.

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

# DeepSeek-V3's way: the arguments are joined to the text as JSON strings
DS_TEMPLATE = """\
{%- if tools %}## Tools
{{ tools | tojson }}
{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}<｜User｜>{{ m.content }}
{%- elif m.role == 'tool' %}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>
{%- elif m.role == 'assistant' and m.tool_calls %}<｜Assistant｜><｜tool▁calls▁begin｜>
{%- for tc in m.tool_calls %}{{ '<｜tool▁call▁begin｜>' + tc.type + '<｜tool▁sep｜>'
  + tc.function.name + '\n```json\n' + tc.function.arguments
  + '\n```<｜tool▁call▁end｜>' }}{% endfor %}<｜tool▁calls▁end｜>
{%- else %}{{ m.content }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<｜Assistant｜>{% endif %}"""

# scripted answers (each one token), after the forced starts of a call
ARGS = '{"city": "Paris"}}\n</tool_call>DONE'
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>DONE'
AUTO = "Let me look.<tool_call>\n" + CALL
DS_ARGS = '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>DONE'
STYLES = {
    "qwen": (TEMPLATE, ["<tool_call>", "</tool_call>", ARGS, CALL, AUTO]),
    "deepseek": (
        DS_TEMPLATE,
        [
            "<｜User｜>",
            "<｜Assistant｜>",
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>",
            DS_ARGS,
        ],
    ),
}


def token_id(text: str, style: str = "qwen") -> int:
    return 256 + len(tiny.SPECIALS) + STYLES[style][1].index(text)


def build(folder: Path, target: Path, style: str = "qwen") -> Path:
    """``folder`` (a tiny model) copied to ``target`` with a tool tokenizer."""
    from transformers import AutoTokenizer

    template, added = STYLES[style]
    shutil.copytree(folder, target)
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.add_tokens(added)
    tok.chat_template = template
    tok.save_pretrained(str(target))
    ids = [tok.convert_tokens_to_ids(t) for t in added]
    assert ids == [token_id(t, style) for t in added]
    return target
