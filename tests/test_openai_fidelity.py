"""OpenAI fidelity through real processes: the tracker lists the models its heads serve
exactly as the heads do, and routes a served name (--served-model-name) to its model."""

from __future__ import annotations

import httpx
import pytest
from swarm_harness import Swarm, covered, wait_for

pytestmark = [pytest.mark.integration]

FP32 = ("--quantization", "float32", "--kv-budget-tokens", "2048")


def test_models_and_served_names_through_the_tracker(models_dir, tiny_snapshot, tiny_model_id,
                                                      tmp_path):  # fmt: skip
    tiny_snapshot("llama")
    model_id = tiny_model_id("llama")
    swarm = Swarm(models_dir, tmp_path, heartbeat_s=0.5)
    names = ("--served-model-name", "tiny", "--served-model-name", "tiny-2")
    try:
        tracker = swarm.tracker().wait_healthy()
        head = swarm.node(tracker, model_id, 0, 3, *FP32, *names, "--max-model-len", "512")
        swarm.node(tracker, model_id, 3, 6, *FP32, *names).wait_healthy()
        head.wait_healthy()
        wait_for(lambda: covered(tracker, model_id), timeout=30)
        listed = httpx.get(f"{tracker.url}/v1/models", timeout=5).json()["data"]
        direct = httpx.get(f"{head.url}/v1/models", timeout=5).json()["data"]
        keys = ("id", "object", "created", "owned_by", "root", "max_model_len")
        assert [{k: c[k] for k in keys} for c in listed] == direct
        assert [c["id"] for c in listed] == ["tiny", "tiny-2"]
        assert listed[0]["max_model_len"] == 512
        body = {"model": "tiny-2", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
        reply = httpx.post(f"{tracker.url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == "tiny-2"
        _echo_scores_match_the_unsplit_model(tracker.url, tiny_snapshot("llama"), "tiny")
        too_long = {**body, "prompt": "Hello " * 600}
        refused = httpx.post(f"{tracker.url}/v1/completions", json=too_long, timeout=60)
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "context_length_exceeded"
    finally:
        swarm.close()


def _echo_scores_match_the_unsplit_model(url: str, snapshot, model: str) -> None:
    """echo + logprobs with the openai client: the prompt's own log-probabilities (scored
    on the tail process, 200 tokens across two prefill chunks) equal the unsplit model's."""
    import openai
    import torch
    from baselines import load_reference_model

    prompt = [(i * 29) % 400 + 5 for i in range(200)]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True,
                                      logprobs=1)  # fmt: skip
    logprobs = reply.choices[0].logprobs
    assert reply.usage.completion_tokens == 0 and logprobs.token_logprobs[0] is None
    with torch.no_grad():
        logits = load_reference_model(snapshot, torch.float32)(torch.tensor([prompt])).logits
    rows = torch.log_softmax(logits[0].float(), -1)
    want = [float(rows[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    assert logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}  # fmt: skip


def test_structured_output_with_the_openai_client(models_dir, tiny_snapshot, tiny_model_id,
                                                   tmp_path):  # fmt: skip
    """json_schema through the tracker, a head and a tail process, with the official client:
    the random model's answer parses and matches the schema (the tail masks the rest)."""
    import json

    import jsonschema
    import openai

    tiny_snapshot("qwen3")
    model_id = tiny_model_id("qwen3")
    swarm = Swarm(models_dir, tmp_path, heartbeat_s=0.5)
    try:
        tracker = swarm.tracker().wait_healthy()
        swarm.node(tracker, model_id, 0, 3, *FP32).wait_healthy()
        swarm.node(tracker, model_id, 3, 6, *FP32).wait_healthy()
        wait_for(lambda: covered(tracker, model_id), timeout=30)
        client = openai.OpenAI(base_url=f"{tracker.url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "Who are you?"}],
            max_tokens=80, temperature=0,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": PERSON}},
        )  # fmt: skip
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            )  # fmt: skip
        assert refused.value.body["param"] == "tools"
    finally:
        swarm.close()


def test_requests_wait_for_room_instead_of_failing(models_dir, tiny_snapshot, tiny_model_id,
                                                   tmp_path):  # fmt: skip
    """One session of room on the node: of three requests, one runs, one waits its turn and
    completes, the third finds the queue (of one) full: 503 with Retry-After."""
    from concurrent.futures import ThreadPoolExecutor

    tiny_snapshot("llama")
    model_id = tiny_model_id("llama")
    swarm = Swarm(models_dir, tmp_path, heartbeat_s=0.5)
    try:
        tracker = swarm.tracker().wait_healthy()
        node = swarm.node(
            tracker, model_id, 0, 6, *FP32, "--max-sessions", "1", "--max-queued-requests", "1",
            "--step-delay-ms", "10", "--speculative", "off",  # 120 steps: over a second each
        ).wait_healthy()  # fmt: skip
        wait_for(lambda: covered(tracker, model_id), timeout=30)
        body = {"model": model_id, "prompt": "Hello", "max_tokens": 120, "temperature": 0,
                "ignore_eos": True}  # fmt: skip

        def post() -> httpx.Response:
            return httpx.post(f"{node.url}/v1/completions", json=body, timeout=120)

        def gauge(name: str) -> float:
            metrics = httpx.get(f"{node.url}/metrics", timeout=5).text
            return next(float(ln.split()[-1]) for ln in metrics.splitlines()
                        if ln.startswith(f"{name} "))  # fmt: skip

        # Each request once the one before it is seen running, then waiting: the order is
        # the one the node saw, whatever the machine's speed.
        with ThreadPoolExecutor(3) as pool:
            sent = [pool.submit(post)]
            wait_for(lambda: gauge("meshnet_num_requests_running") >= 1, 30, interval=0.01)
            sent.append(pool.submit(post))
            wait_for(lambda: gauge("meshnet_num_requests_waiting") >= 1, 30, interval=0.01)
            sent.append(pool.submit(post))
            replies = [future.result() for future in sent]
        codes = [r.status_code for r in replies]
        assert codes == [200, 200, 503], [r.text[:200] for r in replies]
        refused = next(r for r in replies if r.status_code == 503)
        assert refused.json()["error"]["code"] == "queue_full"
        assert int(refused.headers["retry-after"]) >= 1
        done = [r.json() for r in replies if r.status_code == 200]
        assert all(d["usage"]["completion_tokens"] == 120 for d in done)
        metrics = httpx.get(f"{node.url}/metrics", timeout=5).text
        for name in ("meshnet_num_requests_running", "meshnet_num_requests_waiting",
                     "meshnet_request_queue_time_seconds_count",
                     "meshnet_time_to_first_token_seconds_count",
                     "meshnet_inter_token_latency_seconds_count", "meshnet_build_info",
                     "process_resident_memory_bytes"):  # fmt: skip
            assert name in metrics, name
        waited = [ln for ln in metrics.splitlines()
                  if ln.startswith("meshnet_request_queue_time_seconds_count")]  # fmt: skip
        assert float(waited[0].split()[-1]) >= 1
    finally:
        swarm.close()


TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tool_calls_with_the_openai_client(tiny_snapshot, tmp_path):
    """tool_choice "required" through the tracker and two processes: the call comes back in
    message.tool_calls, its arguments valid against the function's schema."""
    import json
    import shutil

    import jsonschema
    import openai

    models = tmp_path / "models"
    snapshot = models / "meshnet-tiny" / "qwen3-tools"
    shutil.copytree(tiny_snapshot("qwen3"), snapshot)
    config = json.loads((snapshot / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOL_TEMPLATE
    (snapshot / "tokenizer_config.json").write_text(json.dumps(config))
    (snapshot / "chat_template.jinja").unlink(missing_ok=True)
    model_id = "meshnet-tiny/qwen3-tools"
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    swarm = Swarm(models, tmp_path, heartbeat_s=0.5)
    try:
        tracker = swarm.tracker().wait_healthy()
        swarm.node(tracker, model_id, 0, 3, *FP32).wait_healthy()
        swarm.node(tracker, model_id, 3, 6, *FP32).wait_healthy()
        wait_for(lambda: covered(tracker, model_id), timeout=30)
        client = openai.OpenAI(base_url=f"{tracker.url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "Weather in Rome?"}],
            tools=[{"type": "function", "function": {"name": "weather", "parameters": params}}],
            tool_choice="required", parallel_tool_calls=False, max_tokens=60, temperature=0,
        )  # fmt: skip
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "weather"
        jsonschema.validate(json.loads(call.function.arguments), params)
    finally:
        swarm.close()
