"""Run llama.cpp's own ``convert_hf_to_gguf.py`` (a checkout at ``$LLAMA_CPP``,
its ``gguf-py`` first on the path) on a tiny checkpoint.

The tiny tokenizer is no published one, so llama.cpp's pre-tokenizer check
(a hash of known tokenizers) cannot name it: the vocabulary is written as
plain GPT-2 BPE instead, the tensors and model keys as the converter writes
them. Usage: ``python llama_cpp_convert.py MODEL_DIR --outfile X.gguf ...``.
"""

import os
import runpy
import sys

root = os.environ["LLAMA_CPP"]
sys.path[:0] = [root, os.path.join(root, "gguf-py")]
sys.dont_write_bytecode = True  # the checkout may be read-only

import conversion.base as base  # noqa: E402
import conversion.glm as glm  # noqa: E402

base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
glm.Glm5NextModel.set_vocab = base.TextModel._set_vocab_gpt2
script = os.path.join(root, "convert_hf_to_gguf.py")
sys.argv = [script, *sys.argv[1:]]
runpy.run_path(script, run_name="__main__")
