"""Chat templates in the tool-calling formats of the Qwen2.5, Qwen3 and Llama 3.1 families, for the
random-weight tiny configurations (which have no template of their own). Written for these tests: each
renders the family's markers, its tool list, an assistant's calls and the tool results the way that
family's checkpoints do (Qwen: ``<tools>`` in the system turn, ``<tool_call>`` JSON, results in
``<tool_response>``; Llama 3.1: tools in the first user turn, a call as ``{"name", "parameters"}``,
results in the ``ipython`` role)."""

QWEN25 = """
{%- if tools or messages[0].role == 'system' %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}
{%- if tools %}

# Tools
Function signatures, one per line, in <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a function by writing <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>
{%- endif %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content or '' }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}
<tool_response>
{{ message.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# Qwen3: Qwen2.5's tool format, and a reasoning block the generation prompt may close at once.
QWEN3 = QWEN25.replace("""{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}""", """{%- if add_generation_prompt %}<|im_start|>assistant
{%- if enable_thinking is defined and not enable_thinking %}
<think>

</think>
{% endif %}
{% endif %}""")

LLAMA31 = """{{ bos_token }}
{%- set first_user = namespace(done=false) %}
{%- if messages[0].role == 'system' %}<|start_header_id|>system<|end_header_id|>

{{ messages[0].content }}<|eot_id|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}<|start_header_id|>user<|end_header_id|>

{% if tools and not first_user.done %}Answer with a function call as JSON {"name": function name, "parameters": an object of its arguments}, using one of:
{% for tool in tools %}{{ tool | tojson }}

{% endfor %}{% endif %}{{ message.content }}<|eot_id|>
{%- set first_user.done = true %}
{%- elif message.role == 'assistant' %}<|start_header_id|>assistant<|end_header_id|>

{% if message.tool_calls %}{% for call in message.tool_calls %}{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}{% endfor %}{% else %}{{ message.content }}{% endif %}<|eot_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

FAMILIES = {"qwen2-style": (QWEN25, "hermes"), "qwen3-style": (QWEN3, "hermes"), "llama3-style": (LLAMA31, "llama3_json")}
