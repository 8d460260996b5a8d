"""The server's prefix cache on disk (``--prompt-cache-dir``): entries outlive
the process and the memory bound, requests sharing a prefix reuse them
(``cached_tokens``, Anthropic's ``cache_read_input_tokens``), and a folder
with partial, truncated or foreign entries, or a full disk, still gives right
answers and says what it skipped."""

import shutil
import threading

import anthropic
import mlx_lm
import pytest
import tiny
from live_server import LiveServer

import mlx_mtp
from mlx_mtp import prompt_file
from mlx_mtp.disk_cache import DiskCache
from mlx_mtp.kv import KVSettings
from mlx_mtp.serve import ServeConfig

DOC = "The quick brown fox jumps over the lazy dog. " * 12
N = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("disk")
    wide = {"num_attention_heads": 2, "head_dim": 32}
    this = tiny.build_folder(root / "glm", "glm4_moe", **wide)[0]
    other = tiny.build_folder(root / "other", "glm4_moe", seed=1, **wide)[0]
    return mlx_mtp.load(this), mlx_mtp.load(other)


def serve(model, folder, **config):
    config = ServeConfig(prompt_cache_dir=str(folder), **config)
    return LiveServer(*model, "m", config)


def ask(server, prompt, **kw):
    r = server.client().completions.create(
        model="m", prompt=prompt, max_tokens=N, temperature=0.0, **kw
    )
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens


@pytest.fixture(scope="module")
def answers(models):
    """Each prompt's answer from a server without any prompt cache."""
    server = LiveServer(*models[0], "m", ServeConfig(prompt_cache_entries=0))
    done = {}

    def get(prompt):
        if prompt not in done:
            done[prompt] = ask(server, prompt)[0]
        return done[prompt]

    yield get
    server.close()


def test_a_restarted_server_reuses_the_prefix_from_disk(models, answers, tmp_path):
    first = serve(models[0], tmp_path)
    try:
        assert ask(first, DOC + "Q1") == (answers(DOC + "Q1"), 0)
    finally:
        first.close()  # what is queued is written before the engine stops
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    again = serve(models[0], tmp_path)  # a fresh engine: memory is empty
    try:
        assert len(again.engine.prompt_cache) == 0
        text, cached = ask(again, DOC + "Q2")
        assert text == answers(DOC + "Q2") and cached > len(DOC) - 8
        # Anthropic's count of the reused tokens
        an = anthropic.Anthropic(base_url=again.url, api_key="none", max_retries=0)
        m = an.messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": DOC}]
        )
        m2 = an.messages.create(
            model="m", max_tokens=4,
            messages=[{"role": "user", "content": DOC + " and more"}],
        )  # fmt: skip
        assert m2.usage.cache_read_input_tokens > 0
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens > 0
    finally:
        again.close()


def test_the_memory_bound_does_not_lose_prefixes(models, answers, tmp_path):
    server = serve(models[0], tmp_path, prompt_cache_entries=1)
    try:
        ask(server, DOC + "Q1")
        ask(server, "something else entirely, and long enough to matter " * 3)
        server.wait_idle()
        server.engine.prompt_cache.disk.flush()
        text, cached = ask(server, DOC + "Q3")  # evicted from memory: from disk
        assert text == answers(DOC + "Q3") and cached > len(DOC) - 8
    finally:
        server.close()


def _entry_of(model, folder, prompt, kv=None):
    """Write one entry for ``prompt`` with ``model`` into ``folder``."""
    disk = DiskCache(folder, 1 << 30, model[0], kv)
    tokens = model[1].encode(prompt)
    cache = model[0].make_cache()
    if kv is not None:
        kv.apply(cache)
    mlx_mtp.generate(model[0], model[1], tokens, max_tokens=1, prompt_cache=cache)
    disk.put(tokens, cache)
    disk.close()
    return folder / disk.name(tokens)


def test_a_folder_with_bad_entries_still_serves_right(models, answers, tmp_path):
    good = _entry_of(models[0], tmp_path / "w", DOC + "Q1")
    folder = tmp_path / "cache"
    folder.mkdir()
    # killed while writing: the writer's temporary file
    (folder / ".x.safetensors.abc.tmp.safetensors").write_bytes(good.read_bytes()[:999])
    # a truncated entry
    (folder / "truncated.safetensors").write_bytes(good.read_bytes()[:-100])
    # another model's entry, another setting's entry, a file that is no cache
    shutil.copy(
        _entry_of(models[1], tmp_path / "o", DOC + "Q1"), folder / "other.safetensors"
    )
    q8 = _entry_of(models[0], tmp_path / "q", DOC + "Q1", KVSettings(8, 32, 0))
    shutil.copy(q8, folder / "quantized.safetensors")
    (folder / "notes.safetensors").write_text("not a cache")
    lines = []
    server = serve(models[0], folder)
    try:
        skipped = server.get("/health")[1]["prompt_cache"]["disk"]["skipped"]
        assert skipped == {
            ".x.safetensors.abc.tmp.safetensors": "an unfinished write",
            "truncated.safetensors": skipped["truncated.safetensors"],
            "other.safetensors": "another model",
            "quantized.safetensors": "other cache settings",
            "notes.safetensors": skipped["notes.safetensors"],
        }
        assert "truncated" in skipped["truncated.safetensors"]
        assert skipped["notes.safetensors"].startswith("damaged")
        lines = server.engine.notices()
        assert any("skipped 5 files" in line for line in lines)
        assert ask(server, DOC + "Q1") == (answers(DOC + "Q1"), 0)  # nothing served
    finally:
        server.close()
    # nothing of theirs was removed
    assert {p.name for p in folder.iterdir()} >= set(skipped)


def test_an_entry_damaged_after_start_is_skipped_then(models, answers, tmp_path):
    entry = _entry_of(models[0], tmp_path, DOC + "Q1")
    server = serve(models[0], tmp_path)
    try:
        entry.write_bytes(entry.read_bytes()[:-64])  # cut after it was indexed
        assert ask(server, DOC + "Q2") == (answers(DOC + "Q2"), 0)
        health = server.get("/health")[1]["prompt_cache"]["disk"]
        assert entry.name in health["skipped"]
    finally:
        server.close()


def test_a_full_disk_is_said_and_served_through(models, answers, tmp_path, monkeypatch):
    server = serve(models[0], tmp_path, prompt_cache_disk_bytes=1024)  # tiny cap
    try:
        assert ask(server, DOC + "Q1")[0] == answers(DOC + "Q1")
        server.wait_idle()
        server.engine.prompt_cache.disk.flush()
        assert not list(tmp_path.iterdir())
    finally:
        server.close()

    def no_space(path, *a, **k):
        open(path, "wb").write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prompt_file, "save_prompt_cache", no_space)
    server = serve(models[0], tmp_path)
    try:
        assert ask(server, DOC + "Q1")[0] == answers(DOC + "Q1")
        server.wait_idle()
        disk = server.engine.prompt_cache.disk
        disk.flush()
        assert disk.failed == 1 and not list(tmp_path.iterdir())  # no partial left
        assert ask(server, DOC + "Q2")[0] == answers(DOC + "Q2")
    finally:
        server.close()


def test_least_recently_used_entries_go_first(models, tmp_path):
    model, tokenizer = models[0]
    disk = DiskCache(tmp_path / "lru", 1 << 30, model)
    names = []
    for i, text in enumerate(["alpha " * 40, "beta " * 40, "gamma " * 40]):
        tokens = tokenizer.encode(text)
        cache = model.make_cache()
        mlx_mtp.generate(model, tokenizer, tokens, max_tokens=1, prompt_cache=cache)
        disk.put(tokens, cache)
        disk.flush()
        names.append(disk.name(tokens))
        if i == 0:  # room for two entries of this size
            disk.max_bytes = int(disk.nbytes * 2.5)
        if i == 1:
            disk.load(names[0])  # alpha used again: beta is the oldest now
    disk.close()
    left = {p.name for p in (tmp_path / "lru").iterdir()}
    assert left == {names[0], names[2]}


def test_two_servers_on_one_folder(models, answers, tmp_path):
    a, b = serve(models[0], tmp_path), serve(models[0], tmp_path)
    try:
        ask(a, DOC + "Q1")
        a.wait_idle()
        a.engine.prompt_cache.disk.flush()
        text, cached = ask(b, DOC + "Q2")  # b finds a's entry
        assert text == answers(DOC + "Q2") and cached > len(DOC) - 8
        ask(b, DOC + "Q1")  # the same prefix from both: one file
        b.wait_idle()
        b.engine.prompt_cache.disk.flush()
    finally:
        a.close()
        b.close()
    names = [p.name for p in tmp_path.iterdir()]
    assert all(not n.endswith(".tmp.safetensors") for n in names)
    for name in names:
        prompt_file.peek(tmp_path / name)  # every entry whole


def test_writes_stay_off_the_decoding_thread(models, answers, tmp_path, monkeypatch):
    release = threading.Event()
    write = prompt_file.write

    def slow(*args, **kwargs):
        release.wait(30)
        return write(*args, **kwargs)

    monkeypatch.setattr(prompt_file, "write", slow)
    server = serve(models[0], tmp_path)
    try:
        ask(server, DOC + "Q1")
        # the entry waits for the disk; requests are answered meanwhile
        assert ask(server, "hello there")[0] == answers("hello there")
        assert not list(tmp_path.glob("*.safetensors"))
        release.set()
        server.engine.prompt_cache.disk.flush()
        assert list(tmp_path.glob("*.safetensors"))
    finally:
        release.set()
        server.close()


def test_quantized_entries_round_trip(models, tmp_path):
    kv = KVSettings(8, 32, 0)
    server = serve(models[0], tmp_path, kv=kv)
    try:
        first, _ = ask(server, DOC + "Q1")
    finally:
        server.close()
    again = serve(models[0], tmp_path, kv=kv)
    try:
        text, cached = ask(again, DOC + "Q2")
        assert cached > len(DOC) - 8
    finally:
        again.close()
    caches, _ = mlx_lm.models.cache.load_prompt_cache(
        str(next(tmp_path.glob("*.safetensors"))), return_metadata=True
    )
    assert caches[0].bits == 8


def test_a_fresh_process_reads_the_prefix_from_disk(models, tmp_path):
    """``mlx-mtp serve --prompt-cache-dir``: stopped (SIGTERM), started again."""
    from test_cli_serve import Served

    folder = str(models[0][0].path)
    args = ["--model", folder, "--prompt-cache-dir", tmp_path, "--max-tokens", N]
    with Served(*map(str, args)) as s:
        assert "prompt cache on disk:" in s.log and "0 entries" in s.log
        first = s.complete(prompt=DOC + "Q1")
    with Served(*map(str, args)) as s:
        assert "1 entries" in s.log
        again = s.complete(prompt=DOC + "Q1")
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > len(DOC) - 8
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
