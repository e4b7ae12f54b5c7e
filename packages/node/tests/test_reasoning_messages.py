"""Reasoning both ways (issue 39): an earlier reply's reasoning comes back as ``reasoning``
(vLLM's current name) or ``reasoning_content`` and reaches the chat template under both
names; with ``--reasoning-parser`` replies carry it as both, whole and streamed."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from meshnet_common.errors import InvalidRequest
from meshnet_common.layers import LayerRange
from meshnet_common.openai_protocol import ChatCompletionRequest, ChatMessage
from meshnet_common.precision import Precision

MODEL_ID = "meshnet-tiny/llama"
# Qwen3's way with an earlier reply's reasoning: a <think> block before its content
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content is string %}<think>\n{{ m.reasoning_content }}\n</think>\n"
    "{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EARLIER = {"role": "assistant", "content": "Rome.", "reasoning": "Italy's capital is Rome."}
TURNS = [{"role": "user", "content": "Capital of Italy?"}, EARLIER,
         {"role": "user", "content": "And of France?"}]  # fmt: skip


def test_a_message_takes_reasoning_under_either_name():
    for key in ("reasoning", "reasoning_content"):
        message = ChatMessage(role="assistant", content="Rome.", **{key: "Because."})
        shown = message.for_template()
        assert shown["reasoning"] == shown["reasoning_content"] == "Because."
    assert (
        "reasoning" not in ChatMessage(role="assistant", content="x", reasoning=None).for_template()
    )
    same = ChatMessage(role="assistant", content="x", reasoning="a", reasoning_content="a")
    assert same.for_template()["reasoning_content"] == "a"
    with pytest.raises(InvalidRequest) as refused:
        ChatMessage(role="assistant", content="x", reasoning="a", reasoning_content="b")
    assert refused.value.param == "messages"


@pytest.fixture(scope="module")
def thinking(tiny_snapshot, tmp_path_factory) -> Iterator:
    """The tiny model with a template that shows earlier reasoning, and deepseek_r1's
    reasoning parser."""
    from meshnet_node.runtime import build_runtime, create_app
    from meshnet_node.settings import NodeSettings

    copy = tmp_path_factory.mktemp("thinking") / "snapshot"
    shutil.copytree(tiny_snapshot("llama"), copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["chat_template"] = THINKING_TEMPLATE
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    (copy / "chat_template.jinja").unlink(missing_ok=True)

    async def no_route(_model_id: str, _exclude=frozenset()) -> tuple[str, ...]:
        return ()

    settings = NodeSettings(model_id=MODEL_ID, model_path=copy, layers=LayerRange(0, 6),
                            quantization=Precision.FLOAT32, reasoning_parser="deepseek_r1")  # fmt: skip
    runtime = build_runtime(settings, route_provider=no_route)
    with TestClient(create_app(runtime)) as http:
        yield runtime, http


def test_earlier_reasoning_reaches_the_template_and_replies_carry_both_names(thinking):
    runtime, http = thinking
    body = {"model": MODEL_ID, "messages": TURNS, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    serving = runtime.openai
    (job,) = serving.chat_jobs(ChatCompletionRequest(**body))
    prompt = serving.tokenizer.decode(job.prompt_ids)
    assert "<think>\nItaly's capital is Rome.\n</think>\nRome." in prompt
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"]  # no </think>: all reasoning
    assert message["reasoning"] and message["content"] is None
    stream = http.post("/v1/chat/completions", json={**body, "stream": True})
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in stream.text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    assert "".join(d.get("reasoning", "") for d in deltas) == message["reasoning"]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning"]
    conflict = {**body, "messages": [{**EARLIER, "reasoning_content": "Other."}]}
    refused = http.post("/v1/chat/completions", json=conflict)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"
