"""The Python API as an mlx-lm user meets it: ``load``'s keywords and default,
mlx-lm's own functions on a loaded model, logprobs, keyword errors, and
``batch_generate``."""

import importlib
import inspect
import json

import mlx.core as mx
import mlx_lm
import pytest
import tiny
import tiny_hybrid
from mlx.utils import tree_flatten
from test_default_model import cache, fake_build  # noqa: F401 (fixtures)

import mlx_mtp
from mlx_mtp.convert import default_model as dm


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    built = {}

    def get(family):
        if family not in built:
            builder = tiny_hybrid if family in tiny_hybrid.MODEL_TYPES else tiny
            built[family] = builder.build_folder(root / family, family)
        return built[family]

    return get


@pytest.fixture(scope="module")
def pair(folders):
    """(mlx-mtp's model, tokenizer, mlx-lm's model of the same trunk)."""
    full, trunk = folders("glm4_moe")
    model, tokenizer = mlx_mtp.load(full)
    return model, tokenizer, mlx_lm.load(str(trunk))[0]


PROMPT = "The quick brown fox"


def test_mlx_lm_generate_runs_on_a_loaded_model(pair):
    model, tokenizer, reference = pair
    got = mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=24)
    assert got == mlx_lm.generate(reference, tokenizer, PROMPT, max_tokens=24)
    # mlx-lm's cache of the model is mlx-mtp's, in both hands
    made = mlx_lm.models.cache.make_prompt_cache(model)
    assert isinstance(made, mlx_mtp.StreamCache)
    steps = mlx_lm.stream_generate(
        model, tokenizer, PROMPT, max_tokens=24, prompt_cache=made
    )
    assert "".join(r.text for r in steps) == got
    assert made.offset >= len(tokenizer.encode(PROMPT)) + 23
    # mlx-mtp's own functions still draft with the head
    r = list(mlx_mtp.stream_generate(model, tokenizer, PROMPT, 24, draft_source="mtp"))
    assert r[-1].stats.drafted > 0


def test_mlx_lm_batch_generate_runs_on_a_loaded_model(pair):
    model, tokenizer, reference = pair
    prompts = [tokenizer.encode(p) for p in ("hello", PROMPT, "a b c d e f g h")]
    kw = dict(max_tokens=16, return_token_ids=True, return_logprobs=True)
    got = mlx_lm.batch_generate(model, tokenizer, prompts, **kw)
    want = mlx_lm.batch_generate(reference, tokenizer, prompts, **kw)
    assert got.token_ids == want.token_ids
    assert _flat(got.logprobs) == pytest.approx(_flat(want.logprobs), abs=1e-4)


def _flat(rows):
    return [x for row in rows for x in row]


def test_load_without_a_path_loads_the_default_model(cache, fake_build):  # noqa: F811
    model, tokenizer, config = mlx_mtp.load(return_config=True, lazy=True)
    assert model.path == dm.default_model_path()
    assert model.head is not None and config is model.config
    assert mlx_mtp.generate(model, tokenizer, "hi", max_tokens=4, draft_max=2)


def test_load_takes_mlx_lm_keywords(folders, tmp_path):
    full, _ = folders("glm4_moe")
    _, _, config = mlx_mtp.load(
        full, model_config={"mlx_mtp_test": 1}, return_config=True
    )
    assert config["mlx_mtp_test"] == 1
    with pytest.raises(TypeError):
        mlx_mtp.load(full, revision="main")  # mlx-lm downloads; mlx-mtp does not


def _write_adapter(trunk, folder):
    """LoRA adapters on mlx-lm's model of ``trunk``, with nonzero weights."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = mlx_lm.load(str(trunk))
    model.freeze()
    params = {"rank": 4, "scale": 10.0, "dropout": 0.0}
    linear_to_lora_layers(model, 2, params)
    weights = {
        k: mx.random.normal(v.shape, key=mx.random.key(i)) * 0.2
        for i, (k, v) in enumerate(tree_flatten(model.trainable_parameters()))
    }
    folder.mkdir()
    mx.save_safetensors(str(folder / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": params}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def test_adapters_apply_to_the_trunk(folders, tmp_path):
    full, trunk = folders("glm4_moe")
    adapter = _write_adapter(trunk, tmp_path / "adapter")
    model, tokenizer = mlx_mtp.load(full, adapter_path=adapter)
    reference, _ = mlx_lm.load(str(trunk), adapter_path=str(adapter))
    plain, _ = mlx_lm.load(str(trunk))
    want = mlx_lm.generate(reference, tokenizer, PROMPT, max_tokens=24)
    assert want != mlx_lm.generate(plain, tokenizer, PROMPT, max_tokens=24)
    got = mlx_mtp.generate(model, tokenizer, PROMPT, max_tokens=24, draft_max=3)
    assert got == want
    with pytest.raises(mlx_mtp.MTPError, match="adapter_config.json"):
        mlx_mtp.load(full, adapter_path=tmp_path)


def test_logprobs_are_a_plain_forward_s(pair):
    model, tokenizer, reference = pair
    prompt = tokenizer.encode(PROMPT)
    responses = list(mlx_mtp.stream_generate(model, tokenizer, prompt, 24, draft_max=3))
    assert responses[-1].stats.accepted > 0  # some tokens came from drafts
    out = [r.token for r in responses]
    logits = reference(mx.array([prompt + out[:-1]]))[0, len(prompt) - 1 :]
    want = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    got = mx.stack([r.logprobs for r in responses])
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-4).item()


def test_logprobs_come_after_the_processors(pair):
    model, tokenizer, _ = pair
    prompt = tokenizer.encode(PROMPT)

    def ban(tokens, logits):  # a processor that changes the distribution
        return logits - 100.0 * (mx.arange(logits.shape[-1]) == 42)

    r = next(iter(mlx_mtp.stream_generate(model, tokenizer, prompt, 1)))
    banned = next(
        iter(
            mlx_mtp.stream_generate(
                model, tokenizer, prompt, 1, logits_processors=[ban]
            )
        )
    )
    assert banned.logprobs[42].item() < r.logprobs[42].item() - 50


def test_one_token_prompt_has_a_prompt_speed(pair):
    model, tokenizer, _ = pair
    r = next(iter(mlx_mtp.stream_generate(model, tokenizer, [65], 2)))
    assert r.prompt_tokens == 1 and r.prompt_tps > 0


def test_verbose_prints_mlx_lm_lines_then_the_mtp_line(pair, capsys):
    model, tokenizer, _ = pair
    text = mlx_mtp.generate(model, tokenizer, PROMPT, max_tokens=12, verbose=True)
    out = capsys.readouterr().out
    head = "=" * 10 + "\n" + text + "\n" + "=" * 10 + "\n"
    assert out.startswith(head)
    lines = out[len(head) :].split("\n")
    assert lines[0].startswith("Prompt: ")
    assert lines[0].endswith(" tokens-per-sec")
    assert lines[1].startswith("Generation: 12 tokens, ")
    assert lines[2].startswith("Peak memory: ")
    assert "draft acceptance" in lines[3] and "generation:" in lines[4]


@pytest.mark.parametrize("function", ["generate", "stream_generate", "batch_generate"])
def test_unknown_keywords_name_the_function(pair, function):
    model, tokenizer, _ = pair
    call = getattr(mlx_mtp, function)

    def run(**kw):
        out = call(model, tokenizer, [[65, 66]] if function == "batch_generate"
                   else "hi", **kw)  # fmt: skip
        return list(out) if function == "stream_generate" else out

    with pytest.raises(TypeError, match=rf"^{function}\(\).*'tmep'.*'temp'"):
        run(tmep=0.5)
    with pytest.raises(TypeError) as e:
        run(draft_model=model)
    message = str(e.value)
    assert message.startswith(f"{function}()") and "MTP head" in message
    assert "draft_source" in message and "--mtp" in message


def test_generate_takes_verbose_where_mlx_lm_does(pair, capsys):
    """mlx-lm's ``generate(model, tokenizer, prompt, verbose=False, **kwargs)``
    and ``stream_generate(model, tokenizer, prompt, max_tokens, ...)``: the
    fourth argument is ``verbose``, and ``max_tokens`` a keyword (an int in
    its place, the old order, is refused saying so)."""
    lm = importlib.import_module("mlx_lm.generate")

    def head(function, n):
        parameters = inspect.signature(function).parameters.values()
        return [(p.name, p.kind, p.default) for p in parameters][:n]

    assert head(mlx_mtp.generate, 5) == head(lm.generate, 5)
    assert head(mlx_mtp.stream_generate, 4) == head(lm.stream_generate, 4)
    model, tokenizer, _ = pair
    text = mlx_mtp.generate(model, tokenizer, "hi", True, max_tokens=4)
    out = capsys.readouterr().out
    assert text in out and "Generation: 4 tokens" in out
    with pytest.raises(TypeError, match=r"max_tokens is a keyword.*max_tokens=4\)"):
        mlx_mtp.generate(model, tokenizer, "hi", 4)


def _prompts(tokenizer):
    """8 prompts of different lengths, some repetitive (prompt lookup drafts)."""
    texts = [f"Q{i}: " + "abcdefgh"[: i + 1] * (i + 1) for i in range(7)]
    return [tokenizer.encode(t) for t in texts] + [[66]]


@pytest.mark.parametrize("family", ["glm4_moe", "qwen3_next"])
@pytest.mark.parametrize("adaptive", [True, False])
def test_batch_generate_gives_each_prompt_its_output_alone(folders, family, adaptive):
    model, tokenizer = mlx_mtp.load(folders(family)[0])
    prompts = _prompts(tokenizer)
    kw = dict(draft_max=3, adaptive_draft=adaptive)
    got = mlx_mtp.batch_generate(
        model,
        tokenizer,
        prompts,
        max_tokens=[20 + i for i in range(8)],
        return_token_ids=True,
        completion_batch_size=5,  # streams leave and others join
        prefill_batch_size=3,
        prefill_step_size=4,  # prompts read in chunks
        **kw,
    )
    alone = [
        [r.token for r in mlx_mtp.stream_generate(model, tokenizer, p, 20 + i, **kw)]
        for i, p in enumerate(prompts)
    ]
    assert got.token_ids == alone
    assert got.texts == [tokenizer.decode(t) for t in alone]
    assert sum(s.drafted for s in got.mtp_stats) > 0
    assert sum(s.accepted for s in got.mtp_stats) > 0
    assert got.stats.generation_tokens == sum(map(len, alone))
    assert got.stats.prompt_tokens == sum(len(p) - 1 for p in prompts)


def test_batch_generate_returns_what_mlx_lm_returns(pair):
    model, tokenizer, reference = pair
    prompts = _prompts(tokenizer)[:4]
    kw = dict(max_tokens=12, return_token_ids=True, return_logprobs=True)
    got = mlx_mtp.batch_generate(
        model, tokenizer, prompts, return_prompt_caches=True, **kw
    )
    want = mlx_lm.batch_generate(reference, tokenizer, prompts, **kw)
    assert got.texts == want.texts and got.token_ids == want.token_ids
    assert _flat(got.logprobs) == pytest.approx(_flat(want.logprobs), abs=1e-4)
    assert got.stats.generation_tps > 0 and got.stats.prompt_tps > 0
    # a returned cache continues its prompt
    kept, history = got.caches[0], prompts[0] + got.token_ids[0]
    assert kept.offset == len(history) - 1
    more = mlx_mtp.batch_generate(
        model,
        tokenizer,
        [history[-1:]],
        prompt_caches=[kept],
        max_tokens=6,
        return_token_ids=True,
    )
    whole = mlx_mtp.stream_generate(model, tokenizer, history, 6)
    assert more.token_ids[0] == [r.token for r in whole]
    assert kept.offset == len(history) - 1  # not changed


def test_batch_generate_verbose_prints_the_batchs_own_speeds(pair, capsys):
    """One summary over the batch's time: the stats line's speeds are the
    batch's (not each stream's share of every round, summed)."""
    import re

    model, tokenizer, _ = pair
    out = mlx_mtp.batch_generate(
        model, tokenizer, _prompts(tokenizer)[:4], max_tokens=12, verbose=True
    )
    printed = capsys.readouterr().out
    line = re.search(r"generation: (\d+) tokens, ([\d.]+) tok/s", printed)
    assert int(line.group(1)) == out.stats.generation_tokens
    assert float(line.group(2)) == pytest.approx(out.stats.generation_tps, abs=0.11)
    rounds = re.search(r"Rounds: (\d+) batched, (\d+) of single streams", printed)
    assert int(rounds.group(1)) == out.stats.generation_steps
    assert int(rounds.group(2)) == sum(s.rounds for s in out.mtp_stats)


def test_generate_prompts_file_writes_one_answer_per_line(
    pair, folders, tmp_path, capsys
):
    from mlx_mtp.cli import run_app

    model, tokenizer, _ = pair
    texts = ["hello", "The quick brown fox", "abc abc abc abc"]
    lines = [json.dumps(texts[0]), "", json.dumps({"prompt": texts[1]})]
    file = tmp_path / "prompts.jsonl"
    file.write_text("\n".join(lines + [json.dumps(texts[2])]) + "\n")
    args = ["generate", "--model", str(folders("glm4_moe")[0]), "--prompts", str(file)]
    assert run_app(args + ["-n", "10", "--no-chat-template"]) == 0
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [a["tokens"] for a in answers] == [
        [r.token for r in mlx_mtp.stream_generate(model, tokenizer, t, 10)]
        for t in texts
    ]
    assert all(a["finish_reason"] == "length" for a in answers)
    assert all(a["stats"]["generation_tokens"] == 10 for a in answers)


@pytest.mark.parametrize(
    "content, message",
    [
        ('"hi"\n{"text": "no prompt key"}\n', "prompts.jsonl:2: expected a non-empty"),
        ("not json\n", "prompts.jsonl:1: not valid JSON"),
        ("\n\n", "prompts.jsonl: no prompts"),
    ],
)
def test_generate_prompts_file_errors_are_one_line(tmp_path, capsys, content, message):
    from mlx_mtp.cli import run_app

    file = tmp_path / "prompts.jsonl"
    file.write_text(content)
    assert run_app(["generate", "--prompts", str(file)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert run_app(["generate", "--prompts", str(file), "-p", "x"]) == 1
    assert "one of --prompt and --prompts" in capsys.readouterr().err


def test_batch_generate_verbose_counts_prompt_tokens_as_mlx_lm(pair, capsys):
    """Both lines of mlx-mtp's verbose output count the prompt as mlx-lm's
    does: the tokens the prompt reads took, each prompt's last token left to
    its first round (the stats line had said one token a prompt more: 15
    against 11 on these four)."""
    import re

    model, tokenizer, reference = pair
    prompts = [tokenizer.encode(t) for t in ("ab", "cde", "fghi", "jklmnq")]
    mlx_lm.batch_generate(reference, tokenizer, prompts, max_tokens=4, verbose=True)
    theirs = capsys.readouterr().out
    mlx_mtp.batch_generate(model, tokenizer, prompts, max_tokens=4, verbose=True)
    mine = capsys.readouterr().out
    want = re.search(r"\[batch_generate\] Prompt: (\d+) tokens", theirs).group(1)
    assert re.findall(r"\[batch_generate\] Prompt: (\d+) tokens", mine) == [want]
    assert re.findall(r"\bprompt: (\d+) tokens", mine) == [want]
    assert int(want) == sum(len(p) - 1 for p in prompts)
