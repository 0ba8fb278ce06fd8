"""Images sent by the official OpenAI and Anthropic SDKs to `kapitsa serve` on the tiny
vision-language fixture (tests/fixtures/tiny/qwen35-vl-a, random weights: replies are
gibberish, so these tests check shapes, token counts and errors, and that both APIs build the
same prompt). scripts/sdk-tests.sh starts that second server (with --allow-image-urls) and
passes its address in KAPITSA_VL_BASE_URL; without it, or without the fixture, they are
skipped."""

import base64
import http.server
import os
import threading
from pathlib import Path

import anthropic
import openai
import pytest

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tiny" / "qwen35-vl-a"
IMAGES = FIXTURE / "images"


@pytest.fixture(scope="module")
def vl_base_url():
    if not (FIXTURE / "model.safetensors").exists():
        pytest.skip(f"{FIXTURE} is absent")
    url = os.environ.get("KAPITSA_VL_BASE_URL")
    if not url:
        pytest.skip("KAPITSA_VL_BASE_URL is not set (scripts/sdk-tests.sh starts the vision-language server)")
    return url.rstrip("/")


@pytest.fixture(scope="module")
def oai(vl_base_url, api_key):
    return openai.OpenAI(base_url=f"{vl_base_url}/v1", api_key=api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ant(vl_base_url, api_key):
    return anthropic.Anthropic(base_url=vl_base_url, api_key=api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def vl_model(oai):
    return oai.models.list().data[0].id


def b64(name):
    return base64.b64encode((IMAGES / name).read_bytes()).decode()


def data_url(name, mime):
    return f"data:{mime};base64,{b64(name)}"


def oai_chat(oai, model, content, **kw):
    return oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0, **kw
    )


def test_openai_image_counts_its_tokens(oai, vl_model):
    text_only = oai_chat(oai, vl_model, "Describe it.")
    r = oai_chat(
        oai,
        vl_model,
        [
            {"type": "image_url", "image_url": {"url": data_url("img1.png", "image/png"), "detail": "high"}},
            {"type": "text", "text": "Describe it."},
        ],
    )
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens > 0
    # The image adds its tokens (more than the three placeholder tokens).
    assert r.usage.prompt_tokens > text_only.usage.prompt_tokens + 3

    two = oai_chat(
        oai,
        vl_model,
        [
            {"type": "image_url", "image_url": {"url": data_url("img1.png", "image/png")}},
            {"type": "image_url", "image_url": {"url": data_url("img2.jpg", "image/jpeg")}},
            {"type": "text", "text": "Describe it."},
        ],
    )
    assert two.usage.prompt_tokens > r.usage.prompt_tokens + 3


def test_openai_streaming_with_an_image(oai, vl_model):
    chunks = list(
        oai_chat(
            oai,
            vl_model,
            [{"type": "image_url", "image_url": {"url": data_url("img2.jpg", "image/jpeg")}}, {"type": "text", "text": "Hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].prompt_tokens > 10


def test_anthropic_image_matches_openai(oai, ant, vl_model):
    o = oai_chat(
        oai,
        vl_model,
        [{"type": "image_url", "image_url": {"url": data_url("img1.png", "image/png")}}, {"type": "text", "text": "What is it?"}],
    )
    a = ant.messages.create(
        model=vl_model,
        max_tokens=8,
        extra_body={"temperature": 0},  # greedy (newer SDKs have no temperature argument)
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64("img1.png")}},
                    {"type": "text", "text": "What is it?"},
                ],
            }
        ],
    )
    assert a.usage.input_tokens == o.usage.prompt_tokens
    text = "".join(b.text for b in a.content if b.type == "text")
    assert text == o.choices[0].message.content
    n = ant.messages.count_tokens(
        model=vl_model,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64("img1.png")}},
                    {"type": "text", "text": "What is it?"},
                ],
            }
        ],
    )
    assert n.input_tokens == o.usage.prompt_tokens


def test_responses_input_image(oai, vl_model):
    r = oai.responses.create(
        model=vl_model,
        max_output_tokens=8,
        temperature=0,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url("img2.jpg", "image/jpeg")},
                    {"type": "input_text", "text": "What is it?"},
                ],
            }
        ],
    )
    assert r.usage.input_tokens > 10


@pytest.fixture(scope="module")
def image_host():
    """A local HTTP server for IMAGES (the test servers reach no network)."""

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(IMAGES), **kw)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_image_urls(oai, ant, vl_model, image_host):
    inline = oai_chat(
        oai,
        vl_model,
        [{"type": "image_url", "image_url": {"url": data_url("img2.jpg", "image/jpeg")}}, {"type": "text", "text": "Hi"}],
    )
    fetched = oai_chat(
        oai, vl_model, [{"type": "image_url", "image_url": {"url": f"{image_host}/img2.jpg"}}, {"type": "text", "text": "Hi"}]
    )
    assert fetched.usage.prompt_tokens == inline.usage.prompt_tokens
    assert fetched.choices[0].message.content == inline.choices[0].message.content
    a = ant.messages.create(
        model=vl_model,
        max_tokens=8,
        extra_body={"temperature": 0},  # greedy (newer SDKs have no temperature argument)
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "url", "url": f"{image_host}/img2.jpg"}},
                    {"type": "text", "text": "Hi"},
                ],
            }
        ],
    )
    assert a.usage.input_tokens == inline.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as e:
        oai_chat(oai, vl_model, [{"type": "image_url", "image_url": {"url": f"{image_host}/missing.png"}}])
    assert "404" in str(e.value)


def test_bad_images_are_400s(oai, ant, vl_model):
    png = (IMAGES / "img1.png").read_bytes()
    cases = [
        ("data:image/png;base64," + base64.b64encode(png[:200]).decode(), "invalid image"),
        ("data:image/png;base64,@@@@", "not valid base64"),
        (
            "data:image/bmp;base64," + base64.b64encode((FIXTURE.parents[1] / "images" / "bad_valid.bmp").read_bytes()).decode(),
            "unsupported image",
        ),
        ("ftp://example.com/a.png", "neither a data: URL"),
    ]
    for url, msg in cases:
        with pytest.raises(openai.BadRequestError) as e:
            oai_chat(oai, vl_model, [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "x"}])
        assert msg in str(e.value), str(e.value)
    too_many = [{"type": "image_url", "image_url": {"url": data_url("img2.jpg", "image/jpeg")}}] * 9
    with pytest.raises(openai.BadRequestError) as e:
        oai_chat(oai, vl_model, too_many)
    assert "over the limit of 8 per request" in str(e.value)
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(
            model=vl_model,
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "%%%"}}],
                }
            ],
        )
    assert "base64" in str(e.value)
    # The server goes on.
    assert oai_chat(oai, vl_model, "still there?").usage.completion_tokens > 0


def test_text_only_server_refuses_images(openai_client, model):
    """The main server (a text-only model, as scripts/sdk-tests.sh is usually run) answers
    400 with a clear message."""
    if not (IMAGES / "img2.jpg").exists():
        pytest.skip(f"{FIXTURE} is absent")
    try:
        r = openai_client.chat.completions.create(
            model=model,
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": data_url("img2.jpg", "image/jpeg")}},
                        {"type": "text", "text": "x"},
                    ],
                }
            ],
        )
    except openai.BadRequestError as e:
        assert "no vision tower" in str(e)
    else:
        pytest.skip(f"the main server's model takes images ({r.usage.prompt_tokens} prompt tokens)")
