"""The server's prefix cache on disk (``--prompt-cache-dir``): entries outlive
the process and the memory bound, requests sharing a prefix reuse them
(``cached_tokens``, Anthropic's ``cache_read_input_tokens``), and a folder
with partial, truncated or foreign entries, or a full disk, still gives right
answers and says what it skipped."""

import os
import re
import shutil
import threading
import time

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
        assert skipped == {  # a write under way is no damaged entry
            "truncated.safetensors": skipped["truncated.safetensors"],
            "other.safetensors": "another model",
            "quantized.safetensors": "other cache settings",
            "notes.safetensors": skipped["notes.safetensors"],
        }
        assert "truncated" in skipped["truncated.safetensors"]
        assert skipped["notes.safetensors"].startswith("damaged")
        lines = server.engine.notices()
        assert any("skipped 4 files" in line for line in lines)
        assert ask(server, DOC + "Q1") == (answers(DOC + "Q1"), 0)  # nothing served
    finally:
        server.close()
    # nothing of theirs was removed, nor the write under way
    names = {p.name for p in folder.iterdir()}
    assert names >= set(skipped) | {".x.safetensors.abc.tmp.safetensors"}


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


def _damage_in_place(path, size=4096):
    """Overwrite ``size`` bytes in the middle of the file's arrays, keeping its
    size and header (what a bad disk or a stray write does)."""
    raw = bytearray(path.read_bytes())
    data = 8 + int.from_bytes(raw[:8], "little")
    at = data + (len(raw) - data - size) // 2
    raw[at : at + size] = bytes((b + 1) % 256 for b in raw[at : at + size])
    path.write_bytes(bytes(raw))


def test_an_entry_damaged_in_place_is_never_served(models, answers, tmp_path, caplog):
    first = serve(models[0], tmp_path)
    try:
        ask(first, DOC + "Q1")
    finally:
        first.close()
    (entry,) = tmp_path.glob("*.safetensors")
    size = entry.stat().st_size
    _damage_in_place(entry)
    assert entry.stat().st_size == size
    prompt_file.peek(entry)  # the header still reads: only the checksum tells
    caplog.set_level("WARNING", logger="mlx_mtp.serve")
    server = serve(models[0], tmp_path)
    try:
        # not served: the answer is a cold read's
        assert ask(server, DOC + "Q2") == (answers(DOC + "Q2"), 0)
        disk = server.get("/health")[1]["prompt_cache"]["disk"]
        assert "checksum does not match" in disk["skipped"][entry.name]
        assert any(entry.name in r.message and "checksum" in r.message
                   for r in caplog.records)  # fmt: skip
        server.wait_idle()
        server.engine.prompt_cache.disk.flush()
    finally:
        server.close()
    # the server's own damaged entry is gone; what it wrote since is sound
    assert not entry.exists()
    again = serve(models[0], tmp_path)
    try:
        text, cached = ask(again, DOC + "Q3")
        assert text == answers(DOC + "Q3") and cached > len(DOC) - 8
        assert not again.get("/health")[1]["prompt_cache"]["disk"]["skipped"]
    finally:
        again.close()


def _drop_checksum(path):
    """Make ``path`` as an older version wrote it: no checksum in its header
    (padded with spaces to its length, as safetensors allows)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = re.sub(rb'"0\.mlx_mtp\.checksum":"[^"]*",?', b"", raw[8 : 8 + n])
    path.write_bytes(raw[:8] + header.ljust(n) + raw[8 + n :])
    assert b"checksum" not in path.read_bytes()[: 8 + n]


def test_an_entry_without_a_checksum_is_removed(models, answers, tmp_path):
    """An older version's entry cannot be verified: removed, never served."""
    entry = _entry_of(models[0], tmp_path, DOC + "Q1")
    _drop_checksum(entry)
    server = serve(models[0], tmp_path)
    try:
        why = server.get("/health")[1]["prompt_cache"]["disk"]["skipped"][entry.name]
        assert "older version" in why
        assert ask(server, DOC + "Q2") == (answers(DOC + "Q2"), 0)
    finally:
        server.close()
    assert not entry.exists()


def test_writes_under_way_are_not_skipped_entries(models, tmp_path, caplog):
    """The server's own temporary files, seen while its writer writes them, are
    passed over silently; a stale one (its writer died) is removed."""
    stale = tmp_path / ".dead.safetensors.x1.tmp.safetensors"
    stale.write_bytes(b"partial")
    os.utime(stale, (time.time() - 7200,) * 2)
    started, release = threading.Event(), threading.Event()
    save = prompt_file.save_prompt_cache

    def slow(tmp, *args):
        save(tmp, *args)
        started.set()
        release.wait(30)  # the temporary file stands while requests scan

    caplog.set_level("WARNING", logger="mlx_mtp.serve")
    server = serve(models[0], tmp_path)
    try:
        assert not stale.exists()
        prompt_file.save_prompt_cache = slow
        for i in range(4):  # a burst: each request scans the changed folder
            ask(server, f"request number {i} " * 8)
            started.wait(30)
            assert list(tmp_path.glob("*.tmp.safetensors"))
        disk = server.get("/health")[1]["prompt_cache"]["disk"]
        assert disk["skipped"] == {}
        assert not [r for r in caplog.records if "skipped" in r.message]
    finally:
        release.set()
        prompt_file.save_prompt_cache = save
        server.close()
    assert not list(tmp_path.glob("*.tmp.safetensors"))
    assert len(list(tmp_path.glob("*.safetensors"))) == 4
