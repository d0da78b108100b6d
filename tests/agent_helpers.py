"""Shared by the agent-API tests (tool calling, reasoning, /v1/responses, /v1/messages): a
tool-capable chat template in Hermes / Qwen2.5 format, and a scripted tiny model whose
greedy output is a text the test chooses, served in-process.

The scripted model makes the server's parsing of a given model output testable end to end
(the tool and reasoning parsers, streaming deltas, each API's shapes) without a real model.
Under guided decoding (a forced tool call) the grammar masks what the script wants to write,
so the output is then whatever the grammar allows (the script's token where it may, else the
lowest-id allowed token): a valid call by construction from a "model" that wanted prose.
"""

from __future__ import annotations

import torch

from conftest import TINY_TEXT_VOCAB, InProcessServer, make_engine, tiny_model, tiny_model_config, tiny_tokenizer
from kvflow.config import CacheConfig, SchedulerConfig

# A Qwen2.5-style template (tools as JSON in <tools>, calls as <tool_call> blocks, tool results
# as <tool_response> user turns), plus Qwen3's enable_thinking switch.
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each function call, return a json object within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' and loop.first %}
{%- elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content or '' }}{% for c in m.tool_calls or [] %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

GENERATION_PROMPT = "<|im_start|>assistant\n"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip
# The scripted model's Hermes-format call of WEATHER_TOOL, and its arguments.
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
ARGS = {"city": "Paris", "unit": "celsius"}


class ScriptedModel:
    """Makes a tiny model's greedy output ``script`` (then EOS), for one request at a time.

    The model's forward records the tokens of the running sequence by position and returns,
    per row, a one-hot score of the script's next token (counted from the last
    ``GENERATION_PROMPT`` in the sequence); ``compute_logits`` passes the scores through.
    The engine runs with prefix caching off, so every prompt token passes through forward.
    """

    def __init__(self, model, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.marker = tokenizer.encode(GENERATION_PROMPT, add_special_tokens=False)
        self.eos = tokenizer.eos_token_id
        self.script: list[int] = [self.eos]
        self.seq: list[int] = []
        model.forward = self.forward
        model.compute_logits = lambda hidden: hidden

    def set(self, text: str) -> None:
        self.script = [*self.tokenizer.encode(text, add_special_tokens=False), self.eos]

    def _answer_start(self, end: int) -> int | None:
        m = len(self.marker)
        for i in range(end - m, -1, -1):
            if self.seq[i : i + m] == self.marker:
                return i + m
        return None

    def forward(self, input_ids, positions, kv_caches, metadata):
        out = torch.zeros(len(input_ids), TINY_TEXT_VOCAB)
        for row, (token, pos) in enumerate(zip(input_ids.tolist(), positions.tolist())):
            del self.seq[pos:]
            self.seq.append(token)
            start = self._answer_start(pos + 1)
            if start is not None:
                k = pos + 1 - start
                out[row, self.script[k] if k < len(self.script) else self.eos] = 100.0
        return out


def scripted_engine(max_model_len: int = 2048):
    """(engine, ScriptedModel) over ``tiny_tokenizer``."""
    tokenizer = tiny_tokenizer()
    config = tiny_model_config(vocab_size=TINY_TEXT_VOCAB, max_position_embeddings=max_model_len)
    model = tiny_model(config)
    script = ScriptedModel(model, tokenizer)
    engine = make_engine(
        model, config, CacheConfig(block_size=16, num_blocks=max_model_len // 16, dtype=torch.float32,
                                   enable_prefix_caching=False),
        SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=4, max_model_len=max_model_len), tokenizer=tokenizer,
    )  # fmt: skip
    return engine, script


def scripted_server(**server_kwargs):
    """Yield (InProcessServer, ScriptedModel): a server over ``scripted_engine`` with the
    Hermes template and ``--reasoning-parser qwen3`` (``server_kwargs`` added), stopped after;
    the body of a test module's ``served`` fixture (``yield from scripted_server()``)."""
    engine, script = scripted_engine()
    server = InProcessServer(engine, chat_template=HERMES_TEMPLATE, reasoning_parser="qwen3", **server_kwargs)
    try:
        yield server, script
    finally:
        server.stop()
