"""Images through the server: OpenAI ``image_url`` parts and Anthropic
``image`` blocks, on the tiny Qwen3.5 VLM of ``tiny_vlm``, through a live
server and the official SDKs.

The reference is ``mlx_mtp.generate(image=...)`` on the same templated
prompt (greedy): the server's answer must be the same text. Bad images get
400s in each API's own shape, and the server serves on after them; image
prompts are batched and cached (in memory and on disk) by their images'
digests. Skipped where mlx-vlm is not installed (the ``vision`` extra).
"""

import base64
import http.server
import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip(
    "mlx_vlm", reason="mlx-vlm is not installed (pip install '.[vision]')"
)

import anthropic  # noqa: E402
import openai  # noqa: E402
import tiny_hybrid  # noqa: E402
import tiny_vlm  # noqa: E402
from live_server import LiveServer  # noqa: E402

import mlx_mtp  # noqa: E402
from mlx_mtp import prompt_file  # noqa: E402
from mlx_mtp.chat import ChatSession  # noqa: E402
from mlx_mtp.errors import MTPError  # noqa: E402
from mlx_mtp.draft_settings import DraftSettings  # noqa: E402
from mlx_mtp.prompt import digest_of, segment_key  # noqa: E402
from mlx_mtp.prompts import chat_text  # noqa: E402
from mlx_mtp.serve import ServeConfig  # noqa: E402

N = 12
SIZES = [(32, 32), (32, 48), (48, 32), (64, 32)]
LIMITS = dict(max_images=3, max_image_bytes=256 << 10, max_image_pixels=100 * 100)


def fixed(**config) -> ServeConfig:
    return ServeConfig(drafts=DraftSettings(adaptive=False), **config)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_vlm.build_folder(tmp_path_factory.mktemp("vlm") / "qwen3_5-vl")


@pytest.fixture(scope="module")
def vlm(folder):
    """(model, processor, image paths)."""
    images = [
        tiny_vlm.write_image(folder.parent / f"i{k}.png", k, SIZES[k % 4])
        for k in range(8)
    ]
    model, processor = mlx_mtp.load(folder)
    return model, processor, images


@pytest.fixture(scope="module")
def server(vlm):
    live = LiveServer(vlm[0], vlm[1], "vl", fixed(**LIMITS))
    yield live
    live.close()


def data_url(path, kind="image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(path.read_bytes()).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


_REFERENCES = {}


def reference(vlm, turns, images, n=N):
    """``generate(image=...)``'s greedy answer to the conversation ``turns``
    (messages whose content names each image by the processor's block)."""
    key = (json.dumps(turns), tuple(map(str, images)), n)
    if key not in _REFERENCES:
        model, processor, _ = vlm
        text = chat_text(processor, turns)
        _REFERENCES[key] = mlx_mtp.generate(
            model, processor, text, image=list(images), max_tokens=n, temp=0.0
        )
    return _REFERENCES[key]


def chat(client, content, n=N, stream=False, **kw):
    messages = [{"role": "user", "content": content}]
    r = client.chat.completions.create(
        model="vl", messages=messages, max_tokens=n, temperature=0.0,
        stream=stream, **kw,
    )  # fmt: skip
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in r if c.choices)
    return r


def test_openai_image_url_answers_as_generate_does(vlm, server):
    _, processor, images = vlm
    block = processor.image_block
    client = server.client()
    content = [image_part(data_url(images[0])), text_part("Describe it.")]
    want = reference(vlm, [{"role": "user", "content": block + "Describe it."}],
                     [images[0]])  # fmt: skip
    r = chat(client, content)
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens > 4  # the image's 4 placeholders among them
    assert chat(client, content, stream=True) == want
    # where the part stands, and two images in one message
    content = [text_part("Look: "), image_part(data_url(images[1])),
               text_part(" and "), image_part(data_url(images[2])),
               text_part(" what?")]  # fmt: skip
    text = "Look: " + block + " and " + block + " what?"
    want = reference(vlm, [{"role": "user", "content": text}], images[1:3])
    assert chat(client, content).choices[0].message.content == want
    assert chat(client, content, stream=True) == want
    # the other order of the same images is another prompt
    swapped = [content[0], content[3], content[2], content[1], content[4]]
    want = reference(vlm, [{"role": "user", "content": text}], images[2:0:-1])
    assert chat(client, swapped).choices[0].message.content == want


def test_images_in_an_earlier_turn_stay_where_they_were(vlm, server):
    _, processor, images = vlm
    block = processor.image_block
    messages = [
        {"role": "user", "content": [image_part(data_url(images[3])),
                                     text_part("What is this?")]},
        {"role": "assistant", "content": "A picture."},
        {"role": "user", "content": [text_part("And this? "),
                                     image_part(data_url(images[4]))]},
    ]  # fmt: skip
    turns = [
        {"role": "user", "content": block + "What is this?"},
        {"role": "assistant", "content": "A picture."},
        {"role": "user", "content": "And this? " + block},
    ]
    r = server.client().chat.completions.create(
        model="vl", messages=messages, max_tokens=N, temperature=0.0
    )
    assert r.choices[0].message.content == reference(vlm, turns, images[3:5])


def _anthropic_image(path) -> dict:
    return _anthropic_image_bytes(path.read_bytes())


def test_anthropic_image_blocks_answer_as_generate_does(vlm, server):
    _, processor, images = vlm
    an = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    content = [{"type": "text", "text": "Here: "}, _anthropic_image(images[5]),
               {"type": "text", "text": " is it red?"}]  # fmt: skip
    turns = [{"role": "user", "content": "Here: " + processor.image_block
              + " is it red?"}]  # fmt: skip
    want = reference(vlm, turns, [images[5]])
    kw = dict(model="vl", max_tokens=N,
              messages=[{"role": "user", "content": content}])  # fmt: skip
    m = an.messages.create(**kw)
    assert "".join(b.text for b in m.content if b.type == "text") == want
    with an.messages.stream(**kw) as s:
        assert s.get_final_text() == want
    counted = an.messages.count_tokens(
        model="vl", messages=[{"role": "user", "content": content}]
    )
    assert counted.input_tokens == m.usage.input_tokens + (
        m.usage.cache_read_input_tokens or 0
    )


# -- refused images --------------------------------------------------------------


def _png(size=(32, 32), seed=9) -> bytes:
    from PIL import Image
    import numpy as np

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _bmp() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (16, 16)).save(out, format="BMP")
    return out.getvalue()


def _url(data: bytes, kind="image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


def _post_chat(server, content, role="user"):
    body = {"model": "vl", "max_tokens": 4,
            "messages": [{"role": role, "content": content}]}  # fmt: skip
    status, raw = server.post("/v1/chat/completions", json.dumps(body).encode())
    return status, json.loads(raw)


BAD = {
    "broken": (_url(_png()[:200]), "broken image"),
    "not base64": ("data:image/png;base64,%%%%", "not valid base64"),
    "unsupported type": (_url(_bmp(), "image/bmp"), "not supported"),
    "bmp called png": (_url(_bmp()), "not a PNG, JPEG, WebP or GIF"),
    "too many bytes": (_url(_png() + b"\0" * (300 << 10)), "larger than"),
    "too many pixels": (_url(_png((128, 128))), "128 x 128 pixels"),
    "a URL": ("http://127.0.0.1:9/a.png", "--allow-image-urls"),
    "a file": ("/etc/hostname", "--allow-image-files"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_image_is_a_400_in_openai_shape(vlm, server, case):
    url, says = BAD[case]
    status, body = _post_chat(server, [image_part(url), text_part("Hi")])
    assert status == 400, body
    error = body["error"]
    assert says in error["message"] and error["param"] == "messages[0].content[0]"
    assert error["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match=says):
        chat(server.client(), [image_part(url), text_part("Hi")])


def test_too_many_images_and_images_outside_user_messages(vlm, server):
    images = vlm[2]
    parts = [image_part(data_url(p)) for p in images[:4]]
    status, body = _post_chat(server, parts)
    assert status == 400 and "more than 3 images" in body["error"]["message"]
    assert body["error"]["param"] == "messages[0].content[3]"
    status, body = _post_chat(server, parts[:1], role="assistant")
    assert status == 400 and "user messages" in body["error"]["message"]


def test_a_bad_image_is_a_400_in_anthropic_shape(vlm, server):
    an = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    broken = _anthropic_image_bytes(_png()[:200])
    bmp = _anthropic_image_bytes(_bmp(), "image/bmp")
    url = {"type": "image", "source": {"type": "url",
                                       "url": "http://127.0.0.1:9/a.png"}}  # fmt: skip
    for block, says in ((broken, "broken image"), (bmp, "media_type"),
                        (url, "--allow-image-urls")):  # fmt: skip
        body = {"model": "vl", "max_tokens": 4,
                "messages": [{"role": "user", "content": [block]}]}  # fmt: skip
        status, raw = server.post("/v1/messages", json.dumps(body).encode())
        answer = json.loads(raw)
        assert status == 400 and answer["type"] == "error", answer
        assert answer["error"]["type"] == "invalid_request_error"
        assert says in answer["error"]["message"]
        with pytest.raises(anthropic.BadRequestError):
            an.messages.create(**body)


def test_the_server_serves_on_after_bad_images(vlm, server):
    for url, _ in BAD.values():
        _post_chat(server, [image_part(url)])
    _, processor, images = vlm
    want = reference(vlm, [{"role": "user", "content": processor.image_block
                            + "Describe it."}], [images[0]])  # fmt: skip
    content = [image_part(data_url(images[0])), text_part("Describe it.")]
    assert chat(server.client(), content).choices[0].message.content == want
    assert server.get("/health")[0] == 200


def test_an_image_to_a_text_model_names_the_model(tmp_path):
    folder, _ = tiny_hybrid.build_folder(tmp_path / "text", "qwen3_5")
    model, tokenizer = mlx_mtp.load(folder)
    live = LiveServer(model, tokenizer, "texty", fixed())
    try:
        status, body = _post_chat(live, [image_part(_url(_png()))])
        assert status == 400
        assert "'texty' reads text only" in body["error"]["message"]
        body = {"model": "x", "max_tokens": 4, "messages": [{"role": "user",
                "content": [_anthropic_image_bytes(_png())]}]}  # fmt: skip
        status, raw = live.post("/v1/messages", json.dumps(body).encode())
        assert status == 400 and "'texty' reads text only" in raw.decode()
        # text still served
        r = live.client().chat.completions.create(
            model="texty", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert r.usage.completion_tokens >= 1
    finally:
        live.close()


def _anthropic_image_bytes(data: bytes, kind="image/png") -> dict:
    data = base64.b64encode(data).decode()
    return {"type": "image",
            "source": {"type": "base64", "media_type": kind, "data": data}}


# -- URLs and files, when allowed --------------------------------------------------


class _Images(http.server.BaseHTTPRequestHandler):
    files: dict = {}

    def do_GET(self):
        if self.path == "/slow.png":
            time.sleep(3)
        data = self.files.get(self.path)
        if data is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_urls_and_files_when_the_server_allows_them(vlm, tmp_path):
    model, processor, images = vlm
    folder = tmp_path / "pictures"
    folder.mkdir()
    (folder / "a.png").write_bytes(images[6].read_bytes())
    (tmp_path / "secret.png").write_bytes(images[6].read_bytes())
    _Images.files = {"/a.png": images[6].read_bytes(), "/slow.png": b"",
                     "/big.png": _png() + b"\0" * (300 << 10)}  # fmt: skip
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{web.server_address[1]}"
    config = fixed(**LIMITS, allow_image_urls=True, image_dir=str(folder),
                   image_fetch_timeout=1.0)  # fmt: skip
    live = LiveServer(model, processor, "vl", config)
    try:
        want = reference(vlm, [{"role": "user", "content": processor.image_block
                                + "Describe it."}], [images[6]])  # fmt: skip
        client = live.client()
        for url in (base + "/a.png", "a.png", (folder / "a.png").as_uri()):
            got = chat(client, [image_part(url), text_part("Describe it.")])
            assert got.choices[0].message.content == want, url
        an = anthropic.Anthropic(base_url=live.url, api_key="none", max_retries=0)
        m = an.messages.create(
            model="vl", max_tokens=N,
            messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": base + "/a.png"}},
                {"type": "text", "text": "Describe it."}]}],
        )  # fmt: skip
        assert m.content[0].text == want
        refused = {
            base + "/missing.png": "HTTP 404",
            base + "/big.png": "larger than",
            base + "/slow.png": "no answer within 1 s",
            "../secret.png": "not under the image folder",
            "ftp://127.0.0.1/a.png": "not supported",
        }
        for url, says in refused.items():
            status, body = _post_chat(live, [image_part(url)])
            assert status == 400 and says in body["error"]["message"], (url, body)
    finally:
        live.close()
        web.shutdown()


# -- batched and cached ------------------------------------------------------------


def test_eight_ragged_streams_with_their_own_images_decode_together(vlm):
    model, processor, images = vlm
    block = processor.image_block
    config = fixed(max_batch=8, prompt_cache_entries=0, lookup_memory_bytes=0)
    live = LiveServer(model, processor, "vl", config)
    questions = [("What is in it?" + " Tell me." * i) for i in range(8)]
    wants = [
        reference(vlm, [{"role": "user", "content": block + q}], [images[i]],
                  16 + 2 * i)
        for i, q in enumerate(questions)
    ]  # fmt: skip
    got = [None] * 8
    try:
        client = live.client()

        def ask(i):
            content = [image_part(data_url(images[i])), text_part(questions[i])]
            drafts = {"draft_max": [2, 3, 1, 0, 2, 3, 1, 2][i]}
            r = chat(client, content, n=16 + 2 * i, extra_body=drafts)
            got[i] = r.choices[0].message.content

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert got == wants
        assert live.get("/health")[1]["peak_batch"] == 8
    finally:
        live.close()


def _image_keys(entries) -> set:
    """The images (by digest) whose first key some entry holds."""
    keys = set()
    for e in entries:
        keys.update(k for k in e.keys if k < 0)
    return keys


def test_prompt_caches_key_on_the_images(vlm, tmp_path):
    model, processor, images = vlm
    block = processor.image_block
    turns = [{"role": "user", "content": block + "Same words."}]
    a, b = images[0], images[1]
    want_a, want_b = reference(vlm, turns, [a]), reference(vlm, turns, [b])

    def ask(live, path):
        content = [image_part(data_url(path)), text_part("Same words.")]
        r = chat(live.client(), content)
        return r.choices[0].message.content, r.usage

    first_keys = {segment_key(digest_of(p.read_bytes()), 0) for p in (a, b)}
    live = LiveServer(model, processor, "vl", fixed(prompt_cache_dir=str(tmp_path)))
    try:
        text, usage = ask(live, a)
        assert text == want_a and usage.prompt_tokens_details.cached_tokens == 0
        text, usage = ask(live, b)  # the same text, another image: not reused
        assert text == want_b and usage.prompt_tokens_details.cached_tokens == 0
        assert first_keys <= _image_keys(live.engine.prompt_cache.entries)
        text, usage = ask(live, a)  # the same image: all but the last token
        assert text == want_a
        assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    finally:
        live.close()  # what is queued for the disk is written
    on_disk = [prompt_file.peek(f) for f in tmp_path.glob("*.safetensors")]
    digests = {s.digest for h in on_disk for s in h.segments}
    assert digests == {digest_of(p.read_bytes()) for p in (a, b)}
    again = LiveServer(model, processor, "vl", fixed(prompt_cache_dir=str(tmp_path)))
    try:
        assert len(again.engine.prompt_cache) == 0
        for path, want in ((b, want_b), (a, want_a)):
            text, usage = ask(again, path)  # read back from disk
            assert text == want
            assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    finally:
        again.close()


# -- the command line and the chat session ---------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args, stdin=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "mlx_mtp", *args], input=stdin,
                          capture_output=True, text=True, env=env,
                          cwd="/")  # fmt: skip


def test_a_cached_image_prompt_continues_only_with_its_images(vlm, folder, tmp_path):
    _, processor, images = vlm
    cache = tmp_path / "seen.safetensors"
    made = _cli("cache-prompt", "--model", str(folder), "--prompt", "Look. ",
                "--image", str(images[0]),
                "--prompt-cache-file", str(cache))  # fmt: skip
    assert made.returncode == 0, made.stderr
    header = prompt_file.peek(cache)
    assert [s.digest for s in header.segments] == [digest_of(images[0].read_bytes())]
    go = ["generate", "--model", str(folder), "--prompt-cache-file", str(cache),
          "--prompt", "What is it?", "-n", str(N), "--json"]  # fmt: skip
    resumed = _cli(*go, "--image", str(images[0]))
    assert resumed.returncode == 0, resumed.stderr
    block = processor.image_block
    want = reference(vlm, [{"role": "user", "content": block + "Look. What is it?"}],
                     [images[0]])  # fmt: skip
    assert json.loads(resumed.stdout)["text"] == want
    for wrong in ([], ["--image", str(images[1])]):
        refused = _cli(*go, *wrong)
        assert refused.returncode != 0
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1 and "pass the same with --image" in lines[0], lines
        assert "Traceback" not in refused.stderr
    # the same text with the other image: another file, keyed by that image
    other = tmp_path / "other.safetensors"
    made = _cli("cache-prompt", "--model", str(folder), "--prompt", "Look. ",
                "--image", str(images[4]),
                "--prompt-cache-file", str(other))  # fmt: skip
    assert made.returncode == 0, made.stderr
    second = prompt_file.peek(other)
    assert second.tokens == header.tokens  # (images 0 and 4: the same size)
    assert [s.digest for s in second.segments] == [digest_of(images[4].read_bytes())]
    go[go.index(str(cache))] = str(other)
    resumed = _cli(*go, "--image", str(images[4]))
    assert resumed.returncode == 0, resumed.stderr
    want = reference(vlm, [{"role": "user", "content": block + "Look. What is it?"}],
                     [images[4]])  # fmt: skip
    assert json.loads(resumed.stdout)["text"] == want


def test_chat_session_turns_with_images_reuse_the_cache(vlm):
    model, processor, images = vlm
    block = processor.image_block
    session = ChatSession(model, processor, max_tokens=N, temp=0.0)
    first = "".join(r.text for r in session.send("What is it?", image=images[2]))
    turns = [{"role": "user", "content": block + "What is it?"}]
    assert first == reference(vlm, turns, [images[2]])
    second = "".join(r.text for r in session.send("And this?", image=images[3]))
    turns += [{"role": "assistant", "content": first},
              {"role": "user", "content": block + "And this?"}]  # fmt: skip
    assert second == reference(vlm, turns, images[2:4])
    # what the cache holds is keyed by both images
    assert [s.digest for s in session.cached_segments] == [
        digest_of(p.read_bytes()) for p in images[2:4]
    ]
    third = "".join(r.text for r in session.send("Same?"))
    turns += [{"role": "assistant", "content": second},
              {"role": "user", "content": "Same?"}]  # fmt: skip
    assert third == reference(vlm, turns, images[2:4])
    with pytest.raises(MTPError, match="no such file"):
        list(session.send("x", image="/nonexistent.png"))
    assert len(session.messages) == 6  # the refused turn left nothing


def test_chat_cli_shows_an_image_with_the_next_message(vlm, folder):
    _, processor, images = vlm
    lines = f"/image {images[4]}\nWhat is it?\n/image /nonexistent.png\n/quit\n"
    out = _cli("chat", "--model", str(folder), "-n", str(N), "--temp", "0",
               stdin=lines)  # fmt: skip
    assert out.returncode == 0, out.stderr
    turns = [{"role": "user", "content": processor.image_block + "What is it?"}]
    want = reference(vlm, turns, [images[4]])
    assert want.rsplit("\t", 1)[-1] in out.stdout  # (the terminal expands tabs)
    shown = processor.prompt(chat_text(processor, turns), [images[4]])
    assert f"prompt {len(shown)}," in out.stderr  # the image's tokens were read
    assert "shown with the next message" in out.stdout
    assert "/nonexistent.png: no such file" in out.stdout


# -- the Responses API ---------------------------------------------------------------


def input_image(url: str) -> dict:
    return {"type": "input_image", "image_url": url, "detail": "auto"}


def input_text(text: str) -> dict:
    return {"type": "input_text", "text": text}


def _responses(client, content, stream=False, **kw):
    """The answer's text to one user message of ``content``."""
    r = client.responses.create(
        model="vl", input=[{"role": "user", "content": content}],
        max_output_tokens=N, temperature=0.0, stream=stream, **kw,
    )  # fmt: skip
    if not stream:
        return r.output_text, r
    deltas, final = [], None
    for event in r:
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        elif event.type in ("response.completed", "response.incomplete"):
            final = event.response  # (incomplete: it ran to max_output_tokens)
    assert final is not None and final.output_text == "".join(deltas)
    return final.output_text, final


def test_responses_input_image_answers_as_the_cli_does(vlm, folder, server):
    _, processor, images = vlm
    cli = _cli("generate", "--model", str(folder), "--prompt", "Describe it.",
               "--image", str(images[7]), "-n", str(N), "--temp", "0",
               "--json")  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    want = json.loads(cli.stdout)["text"]
    assert want == reference(vlm, [{"role": "user", "content": processor.image_block
                                    + "Describe it."}], [images[7]])  # fmt: skip
    client = server.client()
    content = [input_image(data_url(images[7])), input_text("Describe it.")]
    text, r = _responses(client, content)
    assert text == want and r.usage.input_tokens > 4
    assert _responses(client, content, stream=True)[0] == want
    # an image in an earlier turn (previous_response_id) stays where it was
    later = client.responses.create(
        model="vl", previous_response_id=r.id, input="And now?",
        max_output_tokens=N, temperature=0.0,
    )  # fmt: skip
    turns = [{"role": "user", "content": processor.image_block + "Describe it."},
             {"role": "assistant", "content": want},
             {"role": "user", "content": "And now?"}]  # fmt: skip
    assert later.output_text == reference(vlm, turns, [images[7]])


def _post_responses(server, content, role="user", **body):
    body = {"model": "vl", "max_output_tokens": 4,
            "input": [{"role": role, "content": content}], **body}  # fmt: skip
    status, raw = server.post("/v1/responses", json.dumps(body).encode())
    return status, json.loads(raw)


@pytest.mark.parametrize("case", ["broken", "too many pixels", "a URL", "a file"])
def test_a_bad_input_image_is_a_400_naming_its_part(vlm, server, case):
    url, says = BAD[case]
    # (with instructions: the chat path's first message is the system's)
    status, body = _post_responses(server, [input_text("Hi"), input_image(url)],
                                   instructions="Be brief.")  # fmt: skip
    assert status == 400, body
    error = body["error"]
    assert error["type"] == "invalid_request_error"
    assert says in error["message"] and error["param"] == "input[0].content[1]"
    assert "messages[" not in error["message"]
    with pytest.raises(openai.BadRequestError, match=says):
        _responses(server.client(), [input_image(url), input_text("Hi")])


def test_responses_refuse_what_the_chat_path_refuses(vlm, server):
    images = vlm[2]
    parts = [input_image(data_url(p)) for p in images[:4]]
    status, body = _post_responses(server, parts)
    assert status == 400 and "more than 3 images" in body["error"]["message"]
    assert body["error"]["param"] == "input[0].content[3]"
    status, body = _post_responses(server, parts[:1], role="assistant")
    assert status == 400 and "user messages" in body["error"]["message"]
    status, body = _post_responses(server, [{"type": "input_image",
                                             "file_id": "file-1"}])  # fmt: skip
    assert status == 400 and "keeps no files" in body["error"]["message"]
    status, body = _post_responses(server, [{"type": "input_image", "image_url": 3}])
    assert status == 400 and body["error"]["param"] == "input[0].content[0]"
    # and it serves on
    content = [input_image(data_url(images[0])), input_text("Describe it.")]
    want = reference(vlm, [{"role": "user", "content": vlm[1].image_block
                            + "Describe it."}], [images[0]])  # fmt: skip
    assert _responses(server.client(), content)[0] == want


def test_responses_input_image_to_a_text_model_names_the_model(tmp_path):
    folder, _ = tiny_hybrid.build_folder(tmp_path / "text", "qwen3_5")
    model, tokenizer = mlx_mtp.load(folder)
    live = LiveServer(model, tokenizer, "texty", fixed())
    try:
        status, body = _post_responses(live, [input_image(_url(_png()))])
        assert status == 400 and body["error"]["param"] == "input[0].content[0]"
        assert "'texty' reads text only" in body["error"]["message"]
    finally:
        live.close()
